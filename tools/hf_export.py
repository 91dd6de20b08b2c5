"""Export a training run to a transformers NemotronH directory (model/hf.py maps the weights).

    python -m tools.hf_export RUN_DIR [--step N] --output DIR [--tokenizer PATH] [--overwrite]
        [--weights bf16|nvfp4|mxfp8 [--format compressed-tensors|modelopt]
                                    [--weights-only | --zero-amax refuse|weights-only]]

Reads the run's config.yaml and its newest intact checkpoint (or --step N, verified against its
manifest) through the run reader (training/run_reader.py, with the checkpoint reader's
allow-listed unpickler), then writes the directory atomically; every check runs before anything
is written. --output may not be, hold or lie inside the run directory; --overwrite replaces only
a previous export (its nvfp4_export.json lists what it wrote, and nothing else may be in it).
Exit codes as the trainer's: 2 a bad argument (run directory, step, --output,
--max-shard-size), 3 the tokenizer is missing, 6 the checkpoint is torn, corrupt or refused,
8 --output cannot be written (read-only, no permission, disk full).

--weights nvfp4 (model/hf_nvfp4.py; docs/serving.md) stores every linear the run trained in NVFP4
as its forward pass quantized it, in compressed-tensors' nvfp4-pack-quantized format (vLLM) or
ModelOpt's NVFP4 (TensorRT-LLM, vLLM), with the activation scales from the input amax the run
recorded (precision.input_amax_steps); the BF16 layers of the run's precision map stay BF16.
The linears whose forward ran in MXFP8 go with them: in compressed-tensors' mxfp8-quantized
format (E4M3 weights, an E8M0 scale per 32; vLLM's CompressedTensorsW8A8Mxfp8), or in BF16 in the
ModelOpt export; the log and nvfp4_export.json's `mxfp8_linears` say which. --weights mxfp8 is the
same for a run without NVFP4 linears (precision=mxfp8): compressed-tensors only, no input scales
(MXFP8 activations are quantized by the serving engine per call).
Refused with exit 2, before anything is written: a run that never trained a linear in NVFP4
(MXFP8 for --weights mxfp8; one with NVFP4 linears takes --weights nvfp4), one
with MXFP4/FP8 linears, a weight that cannot be packed, a checkpoint without recorded input
amax (unless --weights-only, compressed-tensors' weight-only NVFP4A16), and a linear whose
recorded amax gives no usable input scale (0 over the window: all-zero or non-finite inputs;
or non-finite), the line naming each such linear. `--zero-amax weights-only` instead exports
those linears weights-only (W4A16, no input scale; compressed-tensors only), prints each, and
lists them in config.json's second config group and nvfp4_export.json's weights_only_modules.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import torch

from compat import quiet_cpu_fallback_warnings
from data.demo import ensure_demo_corpus
from data.tokenizer import EOD_TOKEN
from errors import ExitCode, ProjectError
from model import hf_nvfp4
from model.hf import (HF_EXTRA_HINT, HFError, hf_config, not_replaceable, refuse_unmappable_moe,
                      to_hf, write_hf_dir)
from nvfp4_recipe.megatron.input_amax import running_input_amax
from training.run_reader import RunFiles, pick_checkpoint, read_checkpoint_weights, read_run

log = logging.getLogger("nvfp4_pretrain")


def _hf_tokenizer(files: RunFiles, override: Optional[str]):
    """The run's tokenizer as a transformers tokenizer (saved with save_pretrained)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = override or files.tokenizer
    key = "--tokenizer" if override else "data.tokenizer"
    if path is None:  # the demo tokenizer, found (or rebuilt, deterministically) in the cache
        path = ensure_demo_corpus(os.path.abspath(os.path.expanduser(files.cache_dir)),
                                  files.demo).tokenizer_path
        key = "the demo tokenizer"
    path = os.path.expanduser(str(path))
    if os.path.isdir(path):  # a Hugging Face tokenizer directory: its special tokens as configured
        return AutoTokenizer.from_pretrained(path)
    if not os.path.isfile(path):
        raise HFError(f"{key}={path}: file not found (pass --tokenizer PATH)", ExitCode.MISSING)
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
                      ExitCode.UNWRITABLE) from None


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


WEIGHTS = ("bf16", "nvfp4", "mxfp8")
ZERO_AMAX = ("refuse", "weights-only")  # what --weights nvfp4 does with an unusable input amax
SERVED = ("bf16", "nvfp4", "mxfp8")  # the forward formats a serving export writes (docs/serving.md)


def serving_formats(files: RunFiles, weights: str,
                    switched: Optional[dict] = None) -> dict[str, str]:
    """{`layers.<i>.<linear>`: the format its forward ran in} of the run's precision map
    (hf_nvfp4.forward_formats), refusing (exit 2) a run with MXFP4/FP8 linears (no serving
    format here), one without a linear in `weights`' format, and for --weights mxfp8 one with
    NVFP4 linears (--weights nvfp4 writes both). `switched`: the formats the run switched
    linears to (precision.adaptive's map in the checkpoint's trainer.pt), which win."""
    # deferred: model.build imports megatron (~3 s); export refuses bad arguments and --output first
    from model.build import precision_policy

    try:
        linear_formats = precision_policy(files.model, files.precision).linear_formats()
        formats = hf_nvfp4.forward_formats({**linear_formats, **(switched or {})})
    except ValueError as exc:
        raise HFError(f"the run's precision config: {exc}") from None
    other = sorted({f for f in formats.values() if f not in SERVED})
    if other:
        first = next(k for k, f in formats.items() if f in other)
        raise HFError(f"--weights {weights}: the run trained {first} (and others) in {other[0]}; "
                      "only NVFP4 and MXFP8 linears export to a serving format here "
                      "(docs/serving.md): use --weights bf16")
    trained = set(formats.values())
    if weights == "mxfp8" and "nvfp4" in trained:
        raise HFError("--weights mxfp8: the run also trained NVFP4 linears; --weights nvfp4 "
                      "writes both (the MXFP8 ones as mxfp8-quantized)")
    if weights not in trained:
        hint = " (its MXFP8 linears: --weights mxfp8)" if "mxfp8" in trained else ""
        raise HFError(f"--weights {weights}: the run never trained a linear in "
                      f"{weights.upper()} (its forward; precision.format="
                      f"{files.precision.format}): use --weights bf16{hint}")
    return formats


def recorded_input_amax(checkpoint: Path, formats: dict[str, str], weights_only: bool):
    """{linear: input amax} of the NVFP4 linears from the checkpoint's trainer.pt (None with
    --weights-only), refusing (exit 2) a checkpoint where any was not recorded."""
    if weights_only:
        return None, 0
    try:
        state = torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError) as exc:
        raise HFError(f"refusing {checkpoint / 'trainer.pt'}: {str(exc).splitlines()[0]}",
                      ExitCode.NO_USABLE_CHECKPOINT) from None
    amax, steps = running_input_amax(state.get("input_amax") if isinstance(state, dict) else None)
    missing = [k for k, f in formats.items() if f == "nvfp4" and k not in amax]
    if missing:
        raise HFError(f"{checkpoint.name} has no recorded input amax for {missing[0]}"
                      f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} (a "
                      "checkpoint written before precision.input_amax_steps, with it 0, or by "
                      "TE layers): resume the run for a step to record it, or pass "
                      "--weights-only (weights NVFP4, activations BF16; compressed-tensors)")
    return amax, steps


def weights_only_linears(amax: dict[str, float], steps: int, formats: dict[str, str],
                         zero_amax: str) -> dict[str, float]:
    """{linear: amax} of the NVFP4 linears whose recorded input amax gives no usable static input
    scale (hf_nvfp4.unusable_input_amax): refused (exit 2), one line naming each, unless
    zero_amax is "weights-only", when they are returned to be exported without an input scale."""
    bad = hf_nvfp4.unusable_input_amax(amax, formats)
    if bad and zero_amax != "weights-only":
        them = "it" if len(bad) == 1 else "them"
        raise HFError("; ".join(hf_nvfp4.amax_problem(k, v, steps) for k, v in sorted(bad.items()))
                      + f"; pass --zero-amax weights-only to export {them} without an input "
                      "scale (W4A16), or --weights-only for every linear")
    return bad


def _switched_to_bf16(files: RunFiles, checkpoint: Path) -> Optional[float]:
    """The share of the run's tokens after which its forward ran in BF16, if the checkpoint
    is past it (precision.switch_to_bf16), else None."""
    from training.precision import switch_due  # deferred: megatron, as in serving_formats

    switch = files.precision.switch_to_bf16
    if switch.at_fraction is None or files.total_tokens is None:
        return None
    try:
        state = torch.load(checkpoint / "trainer.pt", map_location="cpu", weights_only=True)
        consumed = int(state["consumed_tokens"])
    except Exception:  # noqa: BLE001  (informational only; the weights are read separately)
        return None
    return switch.at_fraction if switch_due(files.precision, consumed, files.total_tokens) else None


def export(run_dir, output, step: Optional[int] = None, tokenizer: Optional[str] = None,
           overwrite: bool = False, max_shard_size: str = "5GB", weights: str = "bf16",
           fmt: Optional[str] = None, weights_only: bool = False,
           zero_amax: Optional[str] = None) -> Path:
    """A run's checkpoint as a transformers NemotronH directory; every check before writing.

    weights="nvfp4": its NVFP4 linears as the forward quantized them, in `fmt`
    (model.hf_nvfp4.FORMATS; default compressed-tensors); `zero_amax` (ZERO_AMAX; default
    refuse): what to do with a linear whose recorded input amax gives no usable input scale."""
    run_dir, output = Path(run_dir).expanduser(), Path(output).expanduser()
    if weights not in WEIGHTS:
        raise HFError(f"--weights {weights}: choose one of {', '.join(WEIGHTS)}")
    if weights == "bf16" and (fmt is not None or weights_only):
        raise HFError("--format and --weights-only apply to --weights nvfp4 only (--format "
                      "also to mxfp8)")
    fmt = fmt or hf_nvfp4.FORMATS[0]
    if fmt not in hf_nvfp4.FORMATS:
        raise HFError(f"--format {fmt}: choose one of {', '.join(hf_nvfp4.FORMATS)}")
    if weights == "mxfp8" and fmt == "modelopt":
        raise HFError("--weights mxfp8: written in compressed-tensors' mxfp8-quantized format "
                      "only; this export does not write ModelOpt's MXFP8 (use --format "
                      "compressed-tensors, or --weights bf16)")
    if weights == "mxfp8" and weights_only:
        raise HFError("--weights-only: an MXFP8 export has no input scales to leave out (the "
                      "serving engine quantizes MXFP8 activations per call)")
    if weights_only and fmt == "modelopt":
        raise HFError("--weights-only: ModelOpt's NVFP4 carries input scales; use --format "
                      "compressed-tensors (NVFP4A16) for a weight-only export")
    if zero_amax is not None:
        if zero_amax not in ZERO_AMAX:
            raise HFError(f"--zero-amax {zero_amax}: choose one of {', '.join(ZERO_AMAX)}")
        if weights != "nvfp4" or weights_only:
            raise HFError(f"--zero-amax {zero_amax}: applies to --weights nvfp4 with input "
                          "scales only (not --weights bf16 or mxfp8, not --weights-only)")
        if zero_amax == "weights-only" and fmt == "modelopt":
            raise HFError("--zero-amax weights-only: ModelOpt's quant_algo NVFP4 gives every "
                          "quantized linear an input_scale and this export does not write its "
                          "per-layer MIXED_PRECISION layout; use --format compressed-tensors")
    _check_output(output, overwrite, run_dir)  # first: nothing below may touch a run
    shard_bytes = parse_max_shard_size(max_shard_size)
    files = read_run(run_dir)
    refuse_unmappable_moe(files.model, "the Hugging Face export")
    formats = serving_formats(files, weights) if weights != "bf16" else None
    checkpoint = pick_checkpoint(run_dir, step)
    if formats is not None:
        # deferred: megatron, as in serving_formats
        from training.precision import checkpoint_precision_map

        # the map the checkpoint's forward ran: the adaptive fallback's switches win
        switched = checkpoint_precision_map(checkpoint)
        if switched:
            formats = serving_formats(files, weights, switched)
    if formats is not None:
        hf_nvfp4.check_moe_servable(formats, fmt, weights)
    amax, amax_steps = (recorded_input_amax(checkpoint, formats, weights_only)
                        if weights == "nvfp4" else (None, 0))
    if amax is not None:  # routed experts no token reached share their layer's scale
        amax = hf_nvfp4.fill_expert_input_amax(amax, formats)
    unusable = (weights_only_linears(amax, amax_steps, formats, zero_amax or "refuse")
                if amax is not None else {})
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
    serving = None
    if formats is not None:
        dense = to_hf(full, cfg, vocab)
        packed = hf_nvfp4.packed_linears(full, cfg, formats, files.precision.weight_2d)
        inputs = (hf_nvfp4.input_scales(amax, formats, frozenset(unusable))
                  if amax is not None else None)
        # The MXFP8 linears: compressed-tensors' own MXFP8 format, or BF16 in ModelOpt's export.
        mxfp8_as = hf_nvfp4.MXFP8_FORMAT if fmt == "compressed-tensors" else "bf16"
        mxfp8 = (hf_nvfp4.mxfp8_linears(full, cfg, formats)
                 if mxfp8_as != "bf16" else {})
        quantized = ("nvfp4", "mxfp8") if mxfp8_as != "bf16" else ("nvfp4",)
        serving = hf_nvfp4.serving_export(fmt, dense, packed, inputs,
                                          hf_nvfp4.bf16_linear_names(cfg, formats, quantized),
                                          mxfp8)
        about.update({"weights": weights, "format": fmt})
        if packed:
            about.update({"weight_2d": files.precision.weight_2d,
                          "input_amax_steps": amax_steps,
                          "activations": "bf16" if weights_only else "nvfp4"})
            if not weights_only:
                about["weights_only_modules"] = serving.weights_only
        mxfp8_modules = sorted(m for key, f in formats.items() if f == "mxfp8"
                               for m in hf_nvfp4.hf_names(key))
        if mxfp8_modules:
            about["mxfp8_linears"] = {"written_as": mxfp8_as, "modules": mxfp8_modules}
            if mxfp8_as == "bf16":
                log.warning(f"warning: {len(mxfp8_modules)} MXFP8 linears written in BF16 "
                            f"({fmt}'s quant_algo NVFP4 names one algorithm for the model; "
                            "--format compressed-tensors writes them in MXFP8): "
                            f"{', '.join(mxfp8_modules)}")
            else:
                log.info(f"{len(mxfp8_modules)} MXFP8 linears written as compressed-tensors "
                         f"{mxfp8_as} (E4M3 weights, an E8M0 scale per 32; activations "
                         f"quantized by the serving engine): {', '.join(mxfp8_modules)}")
        for key, value in sorted(unusable.items()):
            log.warning(f"warning: {hf_nvfp4.amax_problem(key, value, amax_steps)}: exported "
                        f"weights-only (W4A16, no input scale): "
                        f"{', '.join(hf_nvfp4.hf_names(key))}")
        for limit in hf_nvfp4.vllm_limits(cfg, formats):
            log.warning(f"warning: {limit}")
        switched = _switched_to_bf16(files, checkpoint)
        if switched is not None:
            log.warning(f"warning: this run's forward ran in BF16 after {switched:.0%} of its "
                        f"tokens (precision.switch_to_bf16), before {checkpoint.name}: these "
                        "quantized weights are its BF16 weights rounded to nearest, not weights "
                        "its forward computed with")
            about["switched_to_bf16_at"] = switched
    from safetensors import SafetensorError
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # stderr stays for the one error line (a few seconds at 12B)
    try:
        write_hf_dir(output, config, to_hf(full, cfg, vocab) if formats is None else dense, hf_tokenizer,
                     shard_bytes, about, serving)
    except OSError as exc:  # read-only, no permission, disk full: the temporary is gone
        raise HFError(f"--output {output} cannot be written: {_os_reason(exc)}; nothing was "
                      "replaced", ExitCode.UNWRITABLE) from None
    except SafetensorError as exc:  # safetensors' writer reports the disk's refusal as its own
        if "I/O error" not in str(exc):  # "Error while serializing: I/O error: No space left..."
            raise
        raise HFError(f"--output {output} cannot be written: {str(exc).rpartition('I/O error: ')[2]}"
                      "; nothing was replaced", ExitCode.UNWRITABLE) from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return checkpoint


def main(argv: Optional[list[str]] = None) -> int:
    ex = argparse.ArgumentParser(prog="python -m tools.hf_export", description=__doc__.split("\n")[0])
    ex.add_argument("run_dir", help="the run directory (run.dir) of train.py")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the newest intact one)")
    ex.add_argument("--output", required=True, help="the directory to write")
    ex.add_argument("--tokenizer", help="tokenizer.json or HF tokenizer directory (default: the "
                                        "run's data.tokenizer, or the demo tokenizer)")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty --output")
    ex.add_argument("--max-shard-size", default="5GB",
                    help="split model.safetensors above this size, with an index (default 5GB)")
    ex.add_argument("--weights", default="bf16",
                    help="bf16 (default), nvfp4 or mxfp8: the NVFP4 (and MXFP8) linears as the "
                         "forward quantized them, for vLLM / TensorRT-LLM (docs/serving.md)")
    ex.add_argument("--format", dest="fmt", default=None,
                    help="with --weights nvfp4: compressed-tensors (default; vLLM) or modelopt "
                         "(TensorRT-LLM, vLLM)")
    ex.add_argument("--weights-only", action="store_true",
                    help="with --weights nvfp4 --format compressed-tensors: no activation scales "
                         "(NVFP4A16), for a run without recorded input amax")
    ex.add_argument("--zero-amax", default=None,
                    help="with --weights nvfp4: a linear whose recorded input amax is 0 (or "
                         "non-finite) has no usable input scale: refuse (default) or "
                         "weights-only (that linear W4A16, the others W4A4; compressed-tensors)")
    args = ex.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    quiet_cpu_fallback_warnings()
    try:
        checkpoint = export(args.run_dir, args.output, args.step, args.tokenizer, args.overwrite,
                            args.max_shard_size, args.weights, args.fmt, args.weights_only,
                            args.zero_amax)
    except ProjectError as exc:  # HFError, or the run reader's RunDirError
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:  # the temporary is gone (write_hf_dir), a previous export kept
        print(f"error: interrupted: nothing was written to --output {args.output}",
              file=sys.stderr)
        return ExitCode.INTERRUPTED
    print(f"exported {checkpoint} to {Path(args.output)}")
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
