"""Export a training run to a transformers NemotronH directory (model/hf.py maps the weights).

    python -m training.hf_export RUN_DIR [--step N] --output DIR [--tokenizer PATH] [--overwrite]

Reads the run's config.yaml and its newest intact checkpoint (or --step N, verified against its
manifest) through the checkpoint reader's allow-listed unpickler, then writes the directory
atomically; every check runs before anything is written. --output may not be, hold or lie inside
the run directory; --overwrite replaces only a previous export (its nvfp4_export.json lists what
it wrote, and nothing else may be in it). Exit codes as the trainer's: 2 a bad argument (run
directory, step, --output, --max-shard-size), 3 the tokenizer is missing, 6 the checkpoint is
torn, corrupt or refused, 8 --output cannot be written (read-only, no permission, disk full).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from model.config import ModelConfig
from model.hf import (
    _MODEL_KEY_PREFIXES,
    canonical_key,
    EXIT_MISSING,
    EXIT_NO_CHECKPOINT,
    EXIT_UNWRITABLE,
    HF_EXTRA_HINT,
    HFError,
    hf_config,
    not_replaceable,
    to_hf,
    write_hf_dir,
)


@dataclass
class RunFiles:
    model: ModelConfig
    tokenizer: Optional[str]  # data.tokenizer: a tokenizer.json or a Hugging Face directory
    cache_dir: str
    demo: object  # data.config.DemoConfig


def read_run(run_dir: Path) -> RunFiles:
    """The model and tokenizer settings a run was trained with (its config.yaml)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from data.config import DemoConfig

    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise HFError(f"RUN_DIR={run_dir}: not a directory")
    if not path.is_file():
        raise HFError(f"RUN_DIR={run_dir}: no config.yaml (not a run directory of train.py)")
    try:
        raw = OmegaConf.load(path)
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))
        data = raw.get("data", {})
        demo = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemoConfig),
                                                   data.get("demo", {})))
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise HFError(f"{path}: {first}") from None
    return RunFiles(model=model, tokenizer=data.get("tokenizer"),
                    cache_dir=str(data.get("cache_dir", ".cache/data")), demo=demo)


def pick_checkpoint(run_dir: Path, step: Optional[int]) -> Path:
    """checkpoints/step_N (verified against its manifest), or the newest intact one."""
    from training import checkpoint as ckpt

    root = run_dir / "checkpoints"
    if step is not None:
        path = root / ckpt.step_dir_name(step)
        if not path.is_dir():
            have = sorted(p.name for p in root.glob(f"{ckpt.PREFIX}*")) if root.is_dir() else []
            raise HFError(f"--step {step}: {path} does not exist (checkpoints: "
                          f"{', '.join(have) or 'none'})")
        problem = ckpt.verify_checkpoint(path)
        if problem:
            raise HFError(f"--step {step}: {path} is unusable: {problem}", EXIT_NO_CHECKPOINT)
        return path
    found = ckpt.latest_valid_checkpoint(root)
    if found is None:
        if root.is_dir() and any(root.glob(f"{ckpt.PREFIX}*")):
            raise HFError(f"RUN_DIR={run_dir}: none of its checkpoints is usable (see the "
                          "warnings above)", EXIT_NO_CHECKPOINT)
        raise HFError(f"RUN_DIR={run_dir}: no checkpoint in {root}")
    return found


def read_checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors {portable checkpoint key: tensor} from step_N/dist, assembled
    from the shards of any TP/PP layout by torch's checkpoint reader, metadata read by
    training/safe_load.py's allow-listed unpickler, tensors with weights_only loading."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from training.safe_load import (CheckpointRefused, SafeFileSystemReader,
                                    unwrap_checkpoint_exception)

    reader = SafeFileSystemReader(checkpoint / "dist")
    try:
        metadata = reader.read_metadata()
    except CheckpointRefused as exc:
        raise HFError(str(exc), EXIT_NO_CHECKPOINT) from None
    wanted = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in metadata.state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata) and key.startswith(_MODEL_KEY_PREFIXES)}
    try:
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:  # torch wraps each failure (dcp/utils.py)
        cause = unwrap_checkpoint_exception(exc)
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise HFError(f"refusing {checkpoint / 'dist'}: {first}", EXIT_NO_CHECKPOINT) from None
    return {canonical_key(k): v for k, v in wanted.items()}


def _hf_tokenizer(files: RunFiles, override: Optional[str]):
    """The run's tokenizer as a transformers tokenizer (saved with save_pretrained)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from data.tokenizer import EOD_TOKEN

    path = override or files.tokenizer
    key = "--tokenizer" if override else "data.tokenizer"
    if path is None:  # the demo tokenizer, found (or rebuilt, deterministically) in the cache
        from data.demo import ensure_demo_corpus

        path = ensure_demo_corpus(os.path.abspath(os.path.expanduser(files.cache_dir)),
                                  files.demo).tokenizer_path
        key = "the demo tokenizer"
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):  # a Hugging Face tokenizer directory: its special tokens as configured
        return AutoTokenizer.from_pretrained(path)
    if not os.path.isfile(path):
        raise HFError(f"{key}={path}: file not found (pass --tokenizer PATH)", EXIT_MISSING)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    eod = EOD_TOKEN if tok.token_to_id(EOD_TOKEN) is not None else None
    # The data pipeline ends every document with <|endoftext|> and adds no BOS (data/prepare.py).
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eod, pad_token=eod)


def _check_output(output: Path, overwrite: bool, run_dir: Optional[Path] = None) -> None:
    """Refuse an --output that is, holds or lies inside the run directory, one that exists and is
    not empty (unless --overwrite and a previous export: model/hf.py's marker), and one that
    cannot be written (exit 8, found by creating and removing a directory where the export's
    temporary goes). Nothing is left behind."""
    real = Path(os.path.realpath(output))
    if run_dir is not None:
        run = Path(os.path.realpath(run_dir))
        where = ("is the run directory" if real == run else
                 "lies inside the run directory" if run in real.parents else
                 "holds the run directory" if real in run.parents else None)
        if where is not None:
            raise HFError(f"--output {output}: {where} {run_dir}; an export is written beside "
                          "the run, never over it or into it: choose another directory")
    if real.exists() and not real.is_dir():
        raise HFError(f"--output {output}: exists and is not a directory")
    if real.is_dir() and any(real.iterdir()):
        if not overwrite:
            raise HFError(f"--output {output}: exists and is not empty; choose another directory "
                          "or pass --overwrite to replace a previous export")
        problem = not_replaceable(real)
        if problem is not None:
            raise HFError(f"--output {output}: {problem}; --overwrite replaces only a previous "
                          "export: choose another directory")
    _probe_writable(output, real)


def _probe_writable(output: Path, real: Path) -> None:
    """The export's temporary goes beside --output: make and remove one directory there (the
    nearest existing ancestor when the parent does not exist yet)."""
    import errno
    import tempfile

    parent = real.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(parent))
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=parent))
    except OSError as exc:
        raise HFError(f"--output {output} cannot be written: {_os_reason(exc)}",
                      EXIT_UNWRITABLE) from None


def _os_reason(exc: OSError) -> str:
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def parse_max_shard_size(value) -> int:
    """--max-shard-size in bytes: a number of bytes, or one with a unit (5GB, 500MB, 0.5TB) as
    huggingface_hub parses it when transformers' save_pretrained splits the weights."""
    from huggingface_hub.serialization._base import parse_size_to_int

    text = str(value).strip()
    try:
        size = int(text) if text.isdigit() else parse_size_to_int(text)
    except ValueError:
        size = 0
    if size < 1:
        raise HFError(f"--max-shard-size {value}: not a size; give bytes or a number with a "
                      "unit: KB, MB, GB or TB (e.g. 5GB, 500MB)")
    return size


def export(run_dir, output, step: Optional[int] = None, tokenizer: Optional[str] = None,
           overwrite: bool = False, max_shard_size: str = "5GB") -> Path:
    """A run's checkpoint as a transformers NemotronH directory; every check before writing."""
    run_dir, output = Path(run_dir).expanduser(), Path(output).expanduser()
    _check_output(output, overwrite, run_dir)  # first: nothing below may touch a run
    shard_bytes = parse_max_shard_size(max_shard_size)
    files = read_run(run_dir)
    checkpoint = pick_checkpoint(run_dir, step)
    try:
        import transformers  # noqa: F401  (only whether it imports)
    except ImportError:
        raise HFError(f"export needs transformers: {HF_EXTRA_HINT}") from None
    hf_tokenizer = _hf_tokenizer(files, tokenizer)
    cfg = files.model
    full = read_checkpoint_weights(checkpoint)
    rows = full["embedding.word_embeddings.weight"].shape[0]
    vocab = cfg.vocab_size or len(hf_tokenizer)
    if vocab > rows:
        raise HFError(f"the tokenizer has {vocab} tokens but the checkpoint's embedding "
                      f"{rows} rows: pass the run's tokenizer with --tokenizer")
    dtype = str(full["embedding.word_embeddings.weight"].dtype).removeprefix("torch.")
    config = hf_config(cfg, vocab, eos_token_id=hf_tokenizer.eos_token_id,
                       bos_token_id=hf_tokenizer.bos_token_id,
                       pad_token_id=hf_tokenizer.pad_token_id, dtype=dtype)
    about = {"run_dir": str(Path(os.path.realpath(run_dir))), "checkpoint": checkpoint.name}
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr stays for the one error line (a few seconds at 12B)
    try:
        write_hf_dir(output, config, to_hf(full, cfg, vocab), hf_tokenizer, shard_bytes, about)
    except OSError as exc:  # read-only, no permission, disk full: the temporary is gone
        raise HFError(f"--output {output} cannot be written: {_os_reason(exc)}; nothing was "
                      "replaced", EXIT_UNWRITABLE) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return checkpoint


def main(argv: Optional[list[str]] = None) -> int:
    ex = argparse.ArgumentParser(prog="python -m training.hf_export", description=__doc__.split("\n")[0])
    ex.add_argument("run_dir", help="the run directory (run.dir) of train.py")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the newest intact one)")
    ex.add_argument("--output", required=True, help="the directory to write")
    ex.add_argument("--tokenizer", help="tokenizer.json or HF tokenizer directory (default: the "
                                        "run's data.tokenizer, or the demo tokenizer)")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    ex.add_argument("--max-shard-size", default="5GB",
                    help="split model.safetensors above this size, with an index (default 5GB)")
    args = ex.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        checkpoint = export(args.run_dir, args.output, args.step, args.tokenizer, args.overwrite,
                            args.max_shard_size)
    except HFError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    print(f"exported {checkpoint} to {Path(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
