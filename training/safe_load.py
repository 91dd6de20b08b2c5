"""Load a megatron-core torch_dist checkpoint without running code from it.

megatron-core 0.16.1 and torch 2.13 unpickle three things on the way in, two with plain pickle:
  dist/.metadata   torch's FileSystemReader.read_metadata: `pickle.load`
                   (torch/distributed/checkpoint/filesystem.py:926-936), reached from megatron's
                   TorchDistLoadShardedStrategy (dist_checkpointing/strategies/torch.py:750-760,
                   798-812, 826-827, 843-844)
  ShardedObjects   (the `_extra_state` entries in the .distcp files) DefaultLoadPlanner.load_bytes:
                   `torch.load(weights_only=False)`
                   (torch/distributed/checkpoint/default_planner.py:382-393)
  dist/common.pt   megatron's TorchCommonLoadStrategy.load_common: `torch.load` without
                   `weights_only` (dist_checkpointing/strategies/common.py:74-98), safe only
                   while torch's default stays weights_only=True (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD
                   turns it off)
(the tensors themselves already load with weights_only=True, filesystem.py:897-903), and on
GPUs Transformer Engine `pickle.loads` its modules' extra state when the model loads it.
The strategies below are passed to `dist_checkpointing.load` (serialization.py:61-65, 106-107):
the metadata goes through an unpickler that knows only torch's checkpoint-metadata classes, the
other two through `torch.load(weights_only=True)`; `vet_extra_state` unpickles TE's extra state
first, allowing only TE's recipe classes. Nothing is patched globally.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, Union

import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch

try:  # megatron-core <= 0.18: common state in dist/common.pt, loaded by a common strategy
    from megatron.core.dist_checkpointing.strategies.common import (COMMON_STATE_FNAME,
                                                                    TorchCommonLoadStrategy)
except ImportError:  # >= 0.19: a "common_state" ShardedObject in the .distcp files
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    TorchCommonLoadStrategy = None
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from compat import cpu_fully_parallel_load, fully_parallel_load
from errors import ExitCode, ProjectError


class CheckpointRefused(ProjectError):
    """A checkpoint file would run code (or import something) to load: refused, nothing ran."""

    code = ExitCode.NO_USABLE_CHECKPOINT


# Every global a torch_dist `.metadata` pickle names (torch 2.13, megatron-core 0.16.1): the
# checkpoint-metadata dataclasses, torch.Size, dtypes and layouts. Nothing that executes.
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata", "TensorProperties",
        "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks up a torch layout (serialization.py:1641)
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not checkpoint metadata")


def load_weights_only(source, what: str, **kwargs) -> Any:
    """`torch.load(source, weights_only=True)`: a pickle naming anything but tensors and plain
    containers is refused (CheckpointRefused naming `what`), never run."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0]
        raise CheckpointRefused(f"refusing {what}: {first}") from None


def read_metadata_safely(path: Path) -> Metadata:
    """Unpickle a torch_dist `.metadata` file allowing only checkpoint-metadata classes."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, KeyError,
            IndexError) as exc:
        raise CheckpointRefused(f"refusing {path}: {exc} (a tampered or foreign file; "
                                "nothing in it was run)") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointRefused(f"refusing {path}: it holds a {type(metadata).__name__}, not "
                                "checkpoint metadata")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    """torch's FileSystemReader, its metadata read with the allow-listed unpickler and cached.

    `read_metadata` takes no `rank` keyword on purpose: torch then never falls back to per-rank
    metadata files (state_dict_loader.py:242-251).
    """

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        if self._metadata is None:
            metadata = read_metadata_safely(Path(self.path) / mcore_torch._metadata_fn)
            # what FileSystemReader.read_metadata does after unpickling (filesystem.py:932-934)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata


class _SafeLoadPlanner(mcore_torch.MCoreLoadPlanner):
    """megatron's planner, ShardedObjects unpickled with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes with weights_only=True (default_planner.py:382-393)
        obj = load_weights_only(value, f"{read_item.dest_index.fqn} in the checkpoint's .distcp "
                                       "files")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def unwrap_checkpoint_exception(exc: BaseException) -> BaseException:
    """The first cause inside torch's per-rank CheckpointException (dcp/utils.py:194-221)."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return unwrap_checkpoint_exception(inner)
    return exc


class SafeTorchDistLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """megatron's TorchDistLoadShardedStrategy reading through SafeFileSystemReader."""

    def load(self, sharded_state_dict, checkpoint_dir: Path, async_strategy: str = "mcore"):
        # (core_v0.19 passes async_strategy, which only picks its reader: ours reads files.)
        # megatron's TorchDistLoadShardedStrategy.load (strategies/torch.py:770-821) with our
        # reader and planner in place of `_get_filesystem_reader` and `MCoreLoadPlanner`.
        flexible_shape_sharded_tensors = [
            sh_ten for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and not sh_ten.allow_shape_mismatch]
        allow_shape_mismatch_sharded_tensors = {
            sh_ten.key: sh_ten for sh_ten in nested_values(sharded_state_dict)
            if isinstance(sh_ten, ShardedTensor) and sh_ten.allow_shape_mismatch}
        orig_sharded_state_dict = sharded_state_dict
        sharded_state_dict, flat_mapping, rename_mapping = (
            mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict))
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(sharded_state_dict, True)
        fsr = SafeFileSystemReader(checkpoint_dir)
        # Read (and vet) the metadata before torch does: its failures would come back wrapped,
        # after a logged traceback (state_dict_loader.py:233-240).
        self.cached_global_metadata = fsr.read_metadata()
        try:
            dcp.load_state_dict(
                pyt_state_dict, fsr,
                planner=_SafeLoadPlanner(
                    shapes_validation_sharded_tensors=flexible_shape_sharded_tensors,
                    allow_shape_mismatch_sharded_tensors=allow_shape_mismatch_sharded_tensors))
        except CheckpointException as exc:  # a BaseException: hand on the first rank's cause
            cause = unwrap_checkpoint_exception(exc)
            if isinstance(cause, pickle.UnpicklingError):  # a tensor (weights_only=True refused)
                first = str(cause).strip().splitlines()[0]
                raise CheckpointRefused(f"refusing a tensor in {checkpoint_dir}: {first}") from None
            if isinstance(cause, Exception):
                raise cause from None
            raise
        mcore_state_dict = {k: mcore_torch._unwrap_pyt_sharded_tensor(v)
                            for k, v in pyt_state_dict.items()}
        mcore_state_dict = mcore_torch._replace_sharded_keys_with_state_dict_keys(
            mcore_state_dict, flat_mapping, rename_mapping)
        mcore_torch._restore_dict_types(mcore_state_dict, orig_sharded_state_dict)
        return mcore_state_dict

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Metadata = None):
        if metadata is None:  # strategies/torch.py:825-827
            metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path):
        # strategies/torch.py:841-855 with the safe reader
        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        sharded_metadata = {}
        for key, storage_metadata in metadata.state_dict_metadata.items():
            if isinstance(storage_metadata, BytesStorageMetadata):
                sh_obj = ShardedObject.empty_from_unique_key(key)
                sharded_metadata[sh_obj.unique_key] = sh_obj
        sharded_metadata.update(self.load_tensors_metadata(checkpoint_dir, metadata))
        return sharded_metadata


class _SafeCommonLoad:
    """megatron's common.pt loader, weights_only=True spelled out (strategies/common.py:74-98)."""

    def load_common(self, checkpoint_dir: Union[str, Path]):
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        if not path.exists():
            raise CheckpointingException(f"Common file {path} does not exist")
        return load_weights_only(path, str(path), map_location="cpu")

    def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
        # torch_dist keeps ShardedObjects in its .distcp files; megatron only calls this for
        # strategies that cannot (serialization.py:152-160), and it would use plain torch.load.
        raise CheckpointingException("ShardedObjects outside the .distcp files are not loaded")


_TE_RECIPE = "transformer_engine.common.recipe"


class _ExtraStateUnpickler(pickle.Unpickler):
    """What TE's extra state may name: its recipe dataclasses and enums, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _TE_RECIPE or module.startswith(_TE_RECIPE + "."):
            found = super().find_class(module, name)
            if isinstance(found, type) and found.__module__.startswith(_TE_RECIPE):
                return found
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which is not a Transformer Engine recipe class")


def vet_extra_state(model_state: Any, where: Path, key: str = "") -> None:
    """Refuse Transformer Engine extra state that would run code when the model loads it.

    TE's `set_extra_state` (transformer_engine/pytorch/module/base.py, TE 2.8: `pickle.loads`
    of the uint8 tensor its `get_extra_state` made) unpickles whatever a checkpoint holds; the
    per-step recipes used here store a recipe dataclass and plain values there. Each such
    tensor is unpickled here first with only TE's recipe classes allowed. From TE 2.18 these
    recipes write an empty extra state and TE no longer unpickles theirs (PR #3123; v2.19
    pytorch/module/base.py:1392, 1433, pytorch/_extra_state.py:55-64, 98-187), so this matters for checkpoints
    written by TE 2.8-2.17, which later releases still resume.
    """
    if isinstance(model_state, dict):
        for k, v in model_state.items():
            vet_extra_state(v, where, f"{key}.{k}" if key else str(k))
    elif isinstance(model_state, (list, tuple)):
        for v in model_state:
            vet_extra_state(v, where, key)
    elif (key.endswith("_extra_state") and isinstance(model_state, torch.Tensor)
          and model_state.dtype == torch.uint8 and model_state.numel() > 0):
        try:
            _ExtraStateUnpickler(io.BytesIO(model_state.cpu().numpy().tobytes())).load()
        except Exception as exc:  # noqa: BLE001  (any failure: refused, nothing ran)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointRefused(f"refusing {key} in {where}: {first} (a tampered or "
                                    "foreign checkpoint; nothing in it was run)") from None


SafeTorchCommonLoadStrategy = (type("SafeTorchCommonLoadStrategy",
                                    (_SafeCommonLoad, TorchCommonLoadStrategy), {})
                               if TorchCommonLoadStrategy is not None else None)


def vet_pickled_objects(checkpoint_dir: Union[str, Path]) -> None:
    """Unpickle, safely, everything pickled in a torch_dist checkpoint before megatron does.

    megatron-core >= 0.19 reads the common state before any load strategy runs
    (`load_common_state_dict`, core_v0.19.0 dist_checkpointing/serialization.py:148, :206-238):
    torch's FileSystemReader `pickle.load`s `.metadata` and its DefaultLoadPlanner loads the
    "common_state" bytes with `torch.load(weights_only=False)` (default_planner.py:382-393).
    So the metadata goes through the allow-listed unpickler and every bytes object through
    `weights_only=True` here first: what passes names only allowed classes, and unpickling the
    same bytes again runs nothing else. Raises CheckpointRefused."""
    common = Path(checkpoint_dir) / COMMON_STATE_FNAME  # <= 0.18, or a legacy one in 0.19
    if common.exists():
        _SafeCommonLoad().load_common(checkpoint_dir)
    reader = SafeFileSystemReader(checkpoint_dir)
    metadata = reader.read_metadata()
    objects = {key: io.BytesIO() for key, item in metadata.state_dict_metadata.items()
               if isinstance(item, BytesStorageMetadata)}
    if not objects:
        return
    planner = _SafeBytesPlanner()
    try:
        dcp.load(objects, storage_reader=reader, planner=planner, no_dist=True)
    except CheckpointException as exc:
        cause = unwrap_checkpoint_exception(exc)
        raise cause if isinstance(cause, Exception) else exc from None


class _SafeBytesPlanner(dcp.DefaultLoadPlanner):
    """Loads each bytes object with weights_only=True (and keeps nothing)."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        load_weights_only(value, f"{read_item.dest_index.fqn} in the checkpoint's .distcp files")


def strategies() -> dict:
    """Keyword arguments for `dist_checkpointing.load` (call `vet_pickled_objects` first)."""
    kwargs = {"sharded_strategy": SafeTorchDistLoadStrategy()}
    if SafeTorchCommonLoadStrategy is not None:  # megatron-core <= 0.18
        kwargs["common_strategy"] = SafeTorchCommonLoadStrategy()
    return kwargs


def load_dist_checkpoint(sharded_state_dict, checkpoint_dir: Union[str, Path], *,
                         parallel_group=None, cuda: bool = True):
    """megatron's `dist_checkpointing.load`, with nothing in the checkpoint able to run code:
    every pickle vetted first, then loaded through the safe strategies.

    `parallel_group` (the data-parallel group, when it has more than one rank): the safe strategy
    runs inside megatron's FullyParallelLoadStrategyWrapper, so each rank reads 1/DP of what the
    group's ranks share (the model weights) and receives the rest from the rank that read it,
    instead of every rank reading everything (compat item 7; `cuda`: the run's device)."""
    from megatron.core import dist_checkpointing

    vet_pickled_objects(checkpoint_dir)
    kwargs = strategies()
    if parallel_group is not None:
        kwargs["sharded_strategy"] = fully_parallel_load(kwargs["sharded_strategy"],
                                                         parallel_group)
    with cpu_fully_parallel_load(cuda):
        return dist_checkpointing.load(sharded_state_dict, str(checkpoint_dir), **kwargs)
