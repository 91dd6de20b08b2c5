"""Reading a finished run: the checkpoint layer's API for whoever starts from a run directory.

- `read_run`: the settings the run was trained with (its config.yaml: model, precision,
  tokenizer, the demo corpus, the run's total tokens).
- `pick_checkpoint`: checkpoints/step_N verified against its manifest, or the newest intact one.
- `read_checkpoint_weights`: the model's full tensors from a checkpoint of any TP/PP layout and
  either spec family, keyed in the portable spec's names (model/hf.py:canonical_key).

Used by `model.init_from=<run dir>` (training/init_from.py) and by the offline commands over
finished runs (tools/hf_export.py, tools/evaluate.py). Nothing here writes. A run directory or
checkpoint that cannot be read this way is a `RunDirError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from data.config import DemoConfig
from errors import ConfigError, ExitCode
from model.config import ModelConfig
from model.hf import _MODEL_KEY_PREFIXES, canonical_key
from nvfp4_recipe.policy import PrecisionConfig


class RunDirError(ConfigError):
    """A run directory refused as the source of a read: not a run, an unreadable config.yaml, a
    step that is not there (exit 2), or a checkpoint torn, corrupt or refused (exit 6)."""


@dataclass
class RunFiles:
    model: ModelConfig
    tokenizer: Optional[str]  # data.tokenizer: a tokenizer.json or a Hugging Face directory
    cache_dir: str
    demo: object  # data.config.DemoConfig
    precision: object = None  # nvfp4_recipe.policy.PrecisionConfig (None: not read)
    total_tokens: Optional[int] = None  # trainer.max_steps x global batch x sequence length


def read_run(run_dir: Path) -> RunFiles:
    """The model and tokenizer settings a run was trained with (its config.yaml)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise RunDirError(f"RUN_DIR={run_dir}: not a directory")
    if not path.is_file():
        raise RunDirError(f"RUN_DIR={run_dir}: no config.yaml (not a run directory of train.py)")
    try:
        raw = OmegaConf.load(path)
        model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw.model))
        data = raw.get("data", {})
        demo = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DemoConfig),
                                                   data.get("demo", {})))
        precision = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PrecisionConfig),
                                                        raw.get("precision", {})))
        trainer = raw.get("trainer", {})
        total = (trainer["max_steps"] * trainer["global_batch_size"] * trainer["seq_length"]
                 if all(k in trainer for k in ("max_steps", "global_batch_size", "seq_length"))
                 else None)
    except (OmegaConfBaseException, ValueError, TypeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RunDirError(f"{path}: {first}") from None
    return RunFiles(model=model, tokenizer=data.get("tokenizer"),
                    cache_dir=str(data.get("cache_dir", ".cache/data")), demo=demo,
                    precision=precision, total_tokens=total)


def pick_checkpoint(run_dir: Path, step: Optional[int]) -> Path:
    """checkpoints/step_N (verified against its manifest), or the newest intact one."""
    # deferred: training.checkpoint imports megatron (~3 s), and training.config reaches this
    # module (model.init_from): a refused start exits before megatron loads
    from . import checkpoint as ckpt

    root = run_dir / "checkpoints"
    if step is not None:
        path = root / ckpt.step_dir_name(step)
        if not path.is_dir():
            have = sorted(p.name for p in root.glob(f"{ckpt.PREFIX}*")) if root.is_dir() else []
            raise RunDirError(f"--step {step}: {path} does not exist (checkpoints: "
                              f"{', '.join(have) or 'none'})")
        problem = ckpt.verify_checkpoint(path)
        if problem:
            raise RunDirError(f"--step {step}: {path} is unusable: {problem}",
                              ExitCode.NO_USABLE_CHECKPOINT)
        return path
    found = ckpt.latest_valid_checkpoint(root)
    if found is None:
        if root.is_dir() and any(root.glob(f"{ckpt.PREFIX}*")):
            raise RunDirError(f"RUN_DIR={run_dir}: none of its checkpoints is usable (see the "
                              "warnings above)", ExitCode.NO_USABLE_CHECKPOINT)
        raise RunDirError(f"RUN_DIR={run_dir}: no checkpoint in {root}")
    return found


def read_checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors {portable checkpoint key: tensor} from step_N/dist, assembled
    from the shards of any TP/PP layout by torch's checkpoint reader, metadata read by
    training/safe_load.py's allow-listed unpickler, tensors with weights_only loading."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    # deferred: megatron, as in pick_checkpoint
    from .safe_load import CheckpointRefused, SafeFileSystemReader, unwrap_checkpoint_exception

    reader = SafeFileSystemReader(checkpoint / "dist")
    try:
        metadata = reader.read_metadata()
    except CheckpointRefused as exc:
        raise RunDirError(str(exc), ExitCode.NO_USABLE_CHECKPOINT) from None
    wanted = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
              for key, meta in metadata.state_dict_metadata.items()
              if isinstance(meta, TensorStorageMetadata) and key.startswith(_MODEL_KEY_PREFIXES)}
    try:
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    except CheckpointException as exc:  # torch wraps each failure (dcp/utils.py)
        cause = unwrap_checkpoint_exception(exc)
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        raise RunDirError(f"refusing {checkpoint / 'dist'}: {first}",
                          ExitCode.NO_USABLE_CHECKPOINT) from None
    return {canonical_key(k): v for k, v in wanted.items()}
