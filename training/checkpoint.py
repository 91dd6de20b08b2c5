"""Atomic checkpoints in run.dir/checkpoints/step_XXXXXXX, verified on load.

Layout of one checkpoint:
  dist/                  BF16 model weights + FP32 master weights and Adam moments, a megatron-core
                         distributed checkpoint (torch_dist): every model tensor keyed by its
                         global shape and offset; the optimizer state in one of megatron's two
                         layouts (manifest: optimizer_layout, next to optimizer_format, the kind of
                         optimizer, and spec, the layer-spec family that named the keys):
                         'fully_reshardable' (keyed by parameter: loads at any tensor/pipeline/
                         data layout and on either spec) or, with the distributed optimizer,
                         'dp_reshardable' (each rank's shard of the flat buffers: loads at any
                         data-parallel size, at the same tensor/pipeline layout and spec)
  rng_rank{r}.pt         each rank's RNG state (stochastic rounding draws from it)
  trainer.pt             the trainer's state_dict() (rank 0): its step, counters and W&B id, and
                         the state_dict() of its scheduler and data stream
  manifest.json          every file's size, SHA-256 and writer rank, and the layout; written last
Model, optimizer and RNG are read from their objects and restored into them in place (the
optimizer through megatron's sharded_state_dict protocol, which knows its own state's layout);
the trainer's state goes in and comes back as its state_dict, for its load_state_dict.
Each checkpoint is written into a hidden temporary directory and renamed into place only
after every rank finished, so a crash leaves either a complete checkpoint or none. Each rank
hashes the files it wrote, in parallel, and rank 0 gathers the digests into the manifest. Resuming
verifies the manifest (each rank the files it wrote, rank 0 the shared ones, then one reduction)
and falls back to the previous checkpoint if the latest is torn or corrupt; when checkpoints
exist and none is usable the run stops (NoUsableCheckpoint) instead of starting over.
A checkpoint is trusted under its own name only: the manifest's step must be the step the
directory's name gives, and "newest" is the highest step, not the last name in sort order.
Saving and loading run inside megatron's fully-parallel wrappers over the data-parallel group:
each replicated tensor is written by one rank, read by one rank and broadcast to the others.
A checkpoint written by the other spec family (TE on Blackwell, portable elsewhere) loads with its
pre-norm keys translated (model/hf.py:spec_key), for the weights and the optimizer state.
No code runs from a checkpoint: the .pt files load with `torch.load(weights_only=True)` and the
distributed checkpoint through `safe_load` (its pickled metadata with an allow-listed unpickler).
Nothing is deleted but by `keep_last` retention, which never evicts the newest checkpoint written
with no skipped step since the one before it; a checkpoint this run no longer uses (a restart, an
unusable one at a step being saved again) is moved to checkpoints/abandoned-<UTC time>/.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from compat import cpu_dist_checkpoint_save, fully_parallel_save
from errors import ConfigError, ExitCode, ProjectError
from model.hf import spec_key

from .ddp_optimizer import uses_megatron_ddp
from .distributed import ParallelContext, any_rank, barrier
from .run_dir import remove_temporary
from .safe_load import CheckpointRefused  # noqa: F401  (raised from here, caught by the trainer)
from .safe_load import (SafeFileSystemReader, load_dist_checkpoint, load_weights_only,
                        unwrap_checkpoint_exception, vet_extra_state)

log = logging.getLogger("nvfp4_pretrain")

PREFIX = "step_"
MANIFEST = "manifest.json"
ABANDONED = "abandoned-"


class NoUsableCheckpoint(ProjectError):
    """run.dir holds checkpoints and none of them can be resumed from."""

    code = ExitCode.NO_USABLE_CHECKPOINT


class CheckpointMismatch(ConfigError):
    """The checkpoint was written for another model (shapes or keys differ)."""


class CheckpointNotWritten(ProjectError):
    """The file system refused a checkpoint (disk full, quota, read-only): its temporary is gone
    and the checkpoints before it are untouched. The message is one line naming the OS error."""

    code = ExitCode.UNWRITABLE


def step_dir_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def named_step(path: Path) -> Optional[int]:
    """The step a checkpoint directory's name gives (step_<digits>: 7 digits, or more past step
    9,999,999); None for any other name."""
    digits = path.name[len(PREFIX):]
    if path.name.startswith(PREFIX) and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def step_dirs(root: Path) -> list[Path]:
    """Every step_* entry of root, oldest first by the step its name gives (names that give
    none first): step_10000000 after step_9999999, which sorting the names would not do."""
    return sorted(root.glob(f"{PREFIX}*"), key=lambda p: (named_step(p) is not None,
                                                          named_step(p) or 0, p.name))


def _manifest_step(path: Path) -> Optional[int]:
    try:
        step = json.loads((path / MANIFEST).read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _is_complete(path: Path) -> bool:
    """A finished write under its own name (the checksums are verify_checkpoint's job)."""
    step = named_step(path)
    return step is not None and _manifest_step(path) == step


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:  # file_digest reads into one buffer, outside the GIL
        return hashlib.file_digest(f, "sha256").hexdigest()


# Files each rank's writer splits its shard into (megatron's thread_count: writer threads, one
# .distcp file each). 0.16.1 defaults to 2 (strategies/torch.py:602), core_v0.19.0 to 1
# (strategies/torch.py:673, read when saving at :820, as 0.16.1 does at :665): set on the
# strategy, so both write, and then hash, two files per rank in parallel.
SAVE_THREADS = 2
# Threads per rank for hashing its own files: hashlib and file reads release the GIL, and a rank
# writes SAVE_THREADS files plus its RNG file; more threads than files would idle.
HASH_THREADS = 4
# The files a rank writes into a checkpoint, by name: torch DCP's `__<rank>_<n>.distcp` (megatron's
# FileSystemWriterAsync prefixes `__{global rank}_` in prepare_decentralized_global_plan,
# strategies/filesystem_async.py:472, and torch's coordinator plan `__{i}_` over the default group,
# torch/distributed/checkpoint/filesystem.py:673; the file number follows, :132) and our
# `rng_rank<rank>.pt`. Everything else (.metadata, common.pt, metadata.json, trainer.pt) is rank 0's.
_RANK_FILE = re.compile(r"(?:^|/)[^/]*__(\d+)_\d+\.distcp$|(?:^|/)rng_rank(\d+)\.pt$")


def writer_rank(name: str, world_size: int) -> int:
    """The rank that wrote checkpoint file `name` (relative to the checkpoint) in a run of
    `world_size` ranks, and so hashes it at save: the rank its name carries, else rank 0 (the
    shared files, and any name that carries no rank of this run)."""
    found = _RANK_FILE.search(name)
    rank = int(next(g for g in found.groups() if g is not None)) if found else 0
    return rank if rank < world_size else 0


def verifying_rank(meta: dict, world_size: int) -> int:
    """The rank that checks a manifest entry at resume: its writer, folded onto this run's ranks
    (a run resumed at fewer ranks spreads the files over the ranks it has); entries of manifests
    written before writers were recorded go to rank 0, which checked every file then."""
    rank = meta.get("rank", 0)
    return rank % world_size if isinstance(rank, int) and rank >= 0 else 0


def _hash_files(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes", "sha256"}} of these files under root, hashed on up to HASH_THREADS."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> tuple[str, dict]:
        path = root / name
        return name, {"bytes": path.stat().st_size, "sha256": _sha256(path)}

    if len(names) <= 1:
        return dict(map(one, names))
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(names))) as pool:
        return dict(pool.map(one, names))


def _files_of(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _files_written_by(root: Path, rank: int, world_size: int) -> list[str]:
    """The files of checkpoint `root` that `rank` wrote. A rank other than 0 reads one directory
    listing (no stat per entry: at 736 ranks x ~1.5k files, a walk of the whole tree by every
    rank would be a million stats on the metadata server at once); rank 0 walks it all."""
    if rank == 0:
        return [n for n in _files_of(root) if writer_rank(n, world_size) == 0]
    found = []
    for directory in (root, root / "dist"):
        with os.scandir(directory) as entries:
            found += [str(Path(e.path).relative_to(root)) for e in entries
                      if e.is_file(follow_symlinks=False)
                      and writer_rank(str(Path(e.path).relative_to(root)), world_size) == rank]
    return sorted(found)


def _gather_on_main(value: Any, ctx: ParallelContext) -> Optional[list]:
    """Every rank's `value` on rank 0 (in rank order), None elsewhere: small objects only."""
    import torch.distributed as dist

    if ctx.world_size == 1:
        return [value]
    box = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(value, box, dst=0)
    return box


def _broadcast_str(value: str, ctx: ParallelContext) -> str:
    import torch.distributed as dist

    if ctx.world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# megatron's two optimizer-state layouts (`distrib_optimizer.py:1175-1293`, core 0.16.1;
# 'distrib_optim_sharding_type'), the CPU twin writes both (training/ddp_optimizer.py):
# - fully_reshardable: per parameter, model space. On save every data-parallel shard of the FP32
#   master weights and both moments is gathered into every rank's memory
#   (`sharded_param_state_fully_reshardable` -> `get_parameter_state_dp_zero(return_on_all_ranks)`,
#   distrib_optimizer.py:1404-1537 in 0.16.1, 1704-1737 and 1362-1392 in core_v0.19.0), and on load
#   every rank reads every full tensor. Loads anywhere.
# - dp_reshardable: each rank writes and reads its own shard of the flat buffers; "it allows
#   checkpoint resharding only in DP dimension" (distrib_optimizer.py:1187-1191, 0.16.1).
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"
# megatron's DDP bucket size when none is configured: max(40M, 1M x DP) elements
# (distributed/distributed_data_parallel.py:64-65 in 0.16.1, :68-69 in core_v0.19.0). The
# distributed optimizer's dp_reshardable state is per bucket and megatron asserts the buckets
# match on load (distrib_optimizer.py:1777-1783, 0.16.1).
MEGATRON_MIN_BUCKET, MEGATRON_BUCKET_PER_DP = 40_000_000, 1_000_000


def optimizer_layout(requested: str, distributed_optimizer: bool) -> str:
    """The layout a run writes: `trainer.checkpoint_layout` for the distributed optimizer; the
    unsharded optimizers keep their state per parameter already (megatron's
    `Float16OptimizerWithFloat16Params` has only that layout), which is fully_reshardable."""
    if requested not in (DP_RESHARDABLE, FULLY_RESHARDABLE):
        raise ValueError(f"trainer.checkpoint_layout={requested!r}: choose {DP_RESHARDABLE} or "
                         f"{FULLY_RESHARDABLE}")
    return requested if distributed_optimizer else FULLY_RESHARDABLE


def _megatron_bucket(data_parallel: int) -> int:
    return max(MEGATRON_MIN_BUCKET, MEGATRON_BUCKET_PER_DP * data_parallel)


def saved_layout_grid(manifest: dict) -> dict[str, int]:
    """The model-parallel grid a checkpoint was written at: tensor, pipeline, expert and expert
    tensor parallel sizes (manifests before expert parallelism: 1 and `tensor`)."""
    return {"tensor": manifest["tensor"], "pipeline": manifest["pipeline"],
            "expert": manifest.get("expert", 1),
            "expert_tensor": manifest.get("expert_tensor", manifest["tensor"])}


def layout_problem(saved: dict, now: dict, megatron_optimizer: bool) -> Optional[str]:
    """Why optimizer state saved in `saved` cannot load into a run at `now` (None: it can).

    Both: {"layout", "tensor", "pipeline", "data", "spec"} and optionally "expert" and
    "expert_tensor" (default 1 and "tensor"). fully_reshardable loads anywhere;
    dp_reshardable needs the same tensor/pipeline/expert layout and spec (the flat buffers list
    the parameters in the model's order, which the specs do not share: TE's fused pre-norm sits
    in the first linear; the expert buffer holds this rank's experts), and on megatron's
    optimizer (`megatron_optimizer`) the same DDP buckets, i.e. a data-parallel size with the
    same default bucket size."""
    if saved["layout"] != DP_RESHARDABLE:
        return None
    saved = {"expert": 1, "expert_tensor": saved["tensor"], **saved}
    now = {"expert": 1, "expert_tensor": now["tensor"], **now}
    differ = [f"{key} {saved[key]} -> {now[key]}"
              for key in ("tensor", "pipeline", "expert", "expert_tensor", "spec")
              if saved[key] != now[key]]
    if (megatron_optimizer and saved["data"] != now["data"]
            and _megatron_bucket(saved["data"]) != _megatron_bucket(now["data"])):
        differ.append(f"data {saved['data']} -> {now['data']} (megatron's DDP buckets of "
                      f"max(40M, 1M x DP) elements: {_megatron_bucket(saved['data'])} -> "
                      f"{_megatron_bucket(now['data'])})")
    if not differ:
        return None
    return (f"its optimizer state is in the {DP_RESHARDABLE} layout (each rank's shard of the "
            f"flat buffers), which loads only at the same tensor/pipeline/expert layout and spec "
            f"({'; '.join(differ)}): resume at tensor {saved['tensor']} x pipeline "
            f"{saved['pipeline']} x expert {saved['expert']} (expert tensor "
            f"{saved['expert_tensor']}) on the {saved['spec']} spec (once, with "
            f"trainer.checkpoint_layout={FULLY_RESHARDABLE}, to write a checkpoint that loads "
            "anywhere), or start a new run.dir from its weights alone with "
            "model.init_from=<this run.dir> (a fresh optimizer)")


def _sharded_state(model: torch.nn.Module, optimizer, is_loading: bool, layout: str) -> dict:
    """Model and optimizer state as megatron ShardedTensors (the optimizer's in `layout`).

    `model` is the unwrapped megatron model: megatron's DDP would prefix every key with
    "module." (as Megatron-LM, which unwraps first), and keys must not depend on the device.
    """
    model_state = model.sharded_state_dict()
    optim_state = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                               metadata={"distrib_optim_sharding_type": layout})
    return {"model": model_state, "optimizer": optim_state}


def _data_parallel_group(ctx: ParallelContext):
    """The group megatron's fully-parallel wrappers spread the work over (None: one rank)."""
    if ctx.data == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group()


def _rng_state(ctx: ParallelContext) -> dict[str, Optional[torch.Tensor]]:
    """This rank's RNG streams: the CPU's, and its GPU's on a CUDA run."""
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(ctx.device) if ctx.hardware.cuda else None}


def _restore_rng(state: dict[str, Optional[torch.Tensor]], ctx: ParallelContext) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and ctx.hardware.cuda:
        torch.cuda.set_rng_state(state["cuda"], ctx.device)


def save_checkpoint(root: Path, step: int, ctx: ParallelContext, *, model: torch.nn.Module,
                    optimizer, optimizer_format: str, trainer_state: dict,
                    keep_last: int, skipped_since_previous: int = 0,
                    optimizer_layout: str = FULLY_RESHARDABLE, spec: str = "portable") -> Path:
    """Write step_N atomically: model, optimizer (in `optimizer_layout`) and this rank's RNG from
    their objects, and `trainer_state` (the trainer's state_dict) as trainer.pt.
    `skipped_since_previous` (steps skipped for a non-finite loss since the previous checkpoint)
    goes into the manifest: 0 marks a clean checkpoint; so do the layout and `spec`, the layer-spec
    family whose names the keys carry.

    A write the file system refuses (disk full, quota, read-only), wherever the writers surface
    it, raises CheckpointNotWritten on every rank once rank 0 removed the temporary."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from torch.distributed.checkpoint.api import CheckpointException

    final = root / step_dir_name(step)
    tmp = _make_temporary(root, step, ctx)
    failure = None
    started = time.perf_counter()
    try:
        strategy = get_default_save_sharded_strategy()
        strategy.thread_count = SAVE_THREADS
        group = _data_parallel_group(ctx)
        if group is not None:  # each replicated tensor written by one data-parallel rank
            strategy = fully_parallel_save(strategy, group)
        with cpu_dist_checkpoint_save(ctx.hardware.cuda):
            dist_checkpointing.save(_sharded_state(model, optimizer, False, optimizer_layout),
                                    str(tmp / "dist"), sharded_strategy=strategy)
        _write_pt(_rng_state(ctx), tmp / f"rng_rank{ctx.rank}.pt")
        if ctx.is_main:
            _write_pt(trainer_state, tmp / "trainer.pt")
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - the writers wrap OS
        failure = _not_written(exc, final, tmp)      # errors (CheckpointException: a BaseException)
    _agree_or_raise(failure, ctx, final, tmp)
    # Every rank hashes the files it wrote, all at once (at 12B the checkpoint is ~170 GB: one
    # rank hashing it all would hold every other rank in the next collective); rank 0 gathers
    # the digests into the manifest.
    hashing = time.perf_counter()
    try:
        own = _files_written_by(tmp, ctx.rank, ctx.world_size)
        hashed = {name: {**meta, "rank": ctx.rank}
                  for name, meta in _hash_files(tmp, own).items()}
    except OSError as exc:
        hashed, failure = {}, _not_written(exc, final, tmp)
    # A checkpoint already under this step's name is checked the same way, each rank its share,
    # to say what it was when rank 0 moves it aside.
    previous = _check_share(final, ctx) if os.path.lexists(final) else None
    log.debug(f"rank {ctx.rank}: hashed {len(hashed)} checkpoint files "
              f"({sum(m['bytes'] for m in hashed.values()) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - hashing:.1f} s")
    reports = _gather_on_main((hashed, failure, previous), ctx)
    if ctx.is_main and failure is None:
        failure = next((f for _, f, _ in reports if f is not None), None)
    if ctx.is_main and failure is None:
        try:
            files = {name: meta for report, _, _ in reports for name, meta in report.items()}
            # a file no rank claimed (one another node's listing did not show yet): rank 0's
            unclaimed = [n for n in _files_of(tmp) if n not in files]
            files.update({n: {**m, "rank": 0} for n, m in _hash_files(tmp, unclaimed).items()})
            manifest = {"step": step, "world_size": ctx.world_size, "tensor": ctx.tensor,
                        "pipeline": ctx.pipeline, "data_parallel": ctx.data,
                        "expert": ctx.expert, "expert_tensor": ctx.expert_tensor,
                        "optimizer_format": optimizer_format,
                        "optimizer_layout": optimizer_layout, "spec": spec,
                        "skipped_since_previous": skipped_since_previous,
                        "files": dict(sorted(files.items()))}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if os.path.lexists(final):  # kept, out of the way, and said for what it is
                set_aside(root, [final], _why_replaced([p for _, _, p in reports]))
            os.replace(tmp, final)
            _apply_retention(root, keep_last)
        except OSError as exc:  # the manifest, set_aside's directory
            failure = _not_written(exc, final, tmp)
    _agree_or_raise(failure, ctx, final, tmp)
    log.info(f"checkpoint {final.name}: optimizer state in the {optimizer_layout} layout, "
             f"written in {time.perf_counter() - started:.1f} s")
    return final


def _write_pt(obj, path: Path) -> None:
    """torch.save through a buffer, so that a full disk is an OSError with its errno (torch's zip
    writer says only "unexpected pos")."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^:\n]+)")


def _os_error_in(exc: BaseException) -> Optional[OSError]:
    """The OSError inside an exception as the checkpoint writers wrap it: causes and contexts,
    CheckpointException.failures (per rank), torch's (exception, traceback) pairs, and, where a
    worker process's error came back as text only ("Worker failure: [Errno 28] No space left on
    device"), the errno its message names."""
    todo, seen = [exc], set()
    while todo:
        item = todo.pop(0)
        if isinstance(item, (tuple, list)):
            todo.extend(item)
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno:
            return item
        found = _ERRNO_TEXT.search(str(item))
        if found:
            return OSError(int(found.group(1)), found.group(2).strip())
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            todo.extend(failures.values())
        todo.extend((item.__cause__, item.__context__))
    return None


def _space_probe(directory: Path) -> Optional[OSError]:
    """The OSError that writing 1 MiB into `directory` meets now (ENOSPC on a full disk), or
    None. For a writer failure without an errno: megatron's forked writers hand back torch.save's
    "unexpected pos" when the disk fills."""
    probe = directory / ".space-probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            data = memoryview(bytes(1 << 20))
            while data:  # a write short of the whole is no error yet: the next one says ENOSPC
                data = data[os.write(fd, data):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def _not_written(exc: BaseException, final: Path, tmp: Path) -> str:
    """Why the file system refused the checkpoint, in one line; anything else is re-raised."""
    os_error = _os_error_in(exc) or _space_probe(tmp)
    if os_error is None:
        raise exc
    where = f" ({os_error.filename})" if getattr(os_error, "filename", None) else ""
    fix = ("free space (or raise the quota) where run.dir lives"
           if os_error.errno in (errno.ENOSPC, errno.EDQUOT) else "make run.dir writable")
    return (f"checkpoint {final.name} could not be written into {final.parent}: "
            f"{os_error.strerror or os_error}{where}; its temporary was removed and the "
            f"checkpoints before it are intact: {fix}, then run again to resume from the newest")


def _agree_or_raise(failure: Optional[str], ctx: ParallelContext, final: Path, tmp: Path) -> None:
    """Every rank learns whether any rank failed (this is also the save's barrier); if one did,
    rank 0 removes the temporary and every rank raises CheckpointNotWritten."""
    failed = any_rank(failure is not None, ctx)
    if not failed:
        return
    if ctx.is_main:
        remove_temporary(tmp)
    barrier()
    raise CheckpointNotWritten(failure or f"checkpoint {final.name} could not be written into "
                               f"{final.parent}: another rank failed (see its error)")


def _make_temporary(root: Path, step: int, ctx: ParallelContext) -> Path:
    """The hidden directory step_N is written into (rank 0 makes it; named after rank 0's host
    and pid). Whatever held its name (a leftover, a planted link) goes first, unfollowed, and
    mkdir never follows a link: no write lands outside the checkpoints directory."""
    tmp = root / _broadcast_str(f".tmp-{step_dir_name(step)}-{os.uname().nodename}-{os.getpid()}",
                                ctx)
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(tmp):
            remove_temporary(tmp)
        tmp.mkdir()
        (tmp / "dist").mkdir()
    barrier()
    return tmp


def _check_share(path: Path, ctx: ParallelContext) -> str:
    """What verify_checkpoint finds wrong with this rank's share of `path` ("" for nothing)."""
    if not path.is_dir() or path.is_symlink():
        return "not a checkpoint directory"
    return verify_checkpoint(path, ctx.rank, ctx.world_size) or ""


def _why_replaced(problems: list[Optional[str]]) -> str:
    """Why a checkpoint under the name being saved is moved aside, from every rank's check of
    its share (None: a rank that did not see it)."""
    found = [(rank, p) for rank, p in enumerate(problems) if p]
    if found:
        rank, problem = found[0]
        by = f", found by rank {rank}" if len(problems) > 1 else ""
        return f"it is unusable ({problem}{by}) and this step is being saved again"
    return ("it is an intact checkpoint of this step from an earlier attempt that this run did "
            "not resume from; this run's own replaces it")


def _is_clean(path: Path) -> bool:
    """Written with no step skipped (non-finite loss) since the previous checkpoint."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("skipped_since_previous", 0) == 0
    except (OSError, ValueError, AttributeError):
        return False


def _apply_retention(root: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints and the newest clean one. A torn one, or
    one whose manifest names another step (a renamed directory), is neither counted nor deleted."""
    if keep_last <= 0:
        return
    complete = [d for d in step_dirs(root) if _is_complete(d)]
    keep = set(complete[-keep_last:])
    clean = [d for d in complete if _is_clean(d)]
    if clean:
        keep.add(clean[-1])  # checkpoints after skipped steps never push the last good one out
    for old in complete:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)


def set_aside(root: Path, dirs: list[Path], why: str) -> Path:
    """Move checkpoint directories to root/abandoned-<UTC time>/ (rank 0); nothing is deleted."""
    target = root / f"{ABANDONED}{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    target.mkdir(parents=True, exist_ok=True)
    for d in dirs:
        dest, n = target / d.name, 1
        while dest.exists():
            dest, n = target / f"{d.name}.{n}", n + 1
        os.replace(d, dest)
    log.warning(f"moved {', '.join(d.name for d in dirs)} to {target} ({why})")
    return target


def set_aside_for_restart(root: Path, ctx: ParallelContext) -> Optional[Path]:
    """run.resume=restart: this run's checkpoints start again at step 1; the old ones are kept."""
    moved = ""
    if ctx.is_main and root.exists():
        old = step_dirs(root)
        if old:
            moved = str(set_aside(root, old, "run.resume=restart"))
    barrier()
    moved = _broadcast_str(moved, ctx)
    return Path(moved) if moved else None


def verify_checkpoint(path: Path, rank: int = 0, world_size: int = 1) -> Optional[str]:
    """None if the checkpoint is complete and intact, else what is wrong with it.

    One process checks everything. Of `world_size` ranks, each checks its share in parallel:
    the files `verifying_rank` gives it (the ones it wrote, on the same layout); rank 0 also the
    shared files and that the directory holds nothing the manifest does not list. Every rank
    checks the manifest and the name, so a torn checkpoint is refused by all of them alike.
    Never raises for what it reads: every rank must reach the collective that follows, so an
    unreadable file is an answer, not an exception that leaves the others waiting."""
    try:
        return _verify(path, rank, world_size)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc}{': ' + str(exc.filename) if exc.filename else ''})"


def _verify(path: Path, rank: int, world_size: int) -> Optional[str]:
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return "no manifest (the write never finished)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {name: (int(meta["bytes"]), str(meta["sha256"]), verifying_rank(meta, world_size))
                 for name, meta in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable manifest ({type(exc).__name__}: {exc})"
    named, saved = named_step(path), _manifest_step(path)
    if named is None:
        return f"its name {path.name} is not {PREFIX}<step>"
    if saved is None:
        return f"its manifest has no step, so its name {path.name} cannot be checked"
    if saved != named:
        return (f"its manifest says step {saved} but its name {path.name} says step {named} "
                f"(renamed?); a checkpoint is used only under its own step's name "
                f"({step_dir_name(saved)})")
    mine = {name: (size, sha) for name, (size, sha, owner) in files.items() if owner == rank}
    for name, (size, _) in mine.items():
        file = path / name
        if not file.exists():
            return f"missing {name}"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, expected {size}"
    hashed = _hash_files(path, list(mine))
    for name, (_, sha256) in mine.items():
        if hashed[name]["sha256"] != sha256:
            return f"{name} does not match its checksum"
    if rank == 0:
        unlisted = sorted(set(_files_of(path)) - set(files) - {MANIFEST})
        if unlisted:
            return f"files the manifest does not list: {', '.join(unlisted[:3])}"
    return None


def latest_valid_checkpoint(root: Path) -> Optional[Path]:
    """The newest intact checkpoint; torn or corrupt newer ones are reported and skipped."""
    if not root.exists():
        return None
    for candidate in reversed(step_dirs(root)):
        problem = verify_checkpoint(candidate)
        if problem is None:
            return candidate
        log.warning(f"checkpoint {candidate.name} is unusable: {problem}; trying an older one")
    return None


def find_resume_checkpoint(root: Path, ctx: ParallelContext) -> Optional[Path]:
    """The newest checkpoint every rank found intact; every rank loads the same one.

    Rank 0 lists the candidates; for each, newest first, every rank verifies its share
    (verify_checkpoint) in parallel and one reduction says whether all passed; a torn or
    corrupt one is reported (with the rank that found it) and the next older one tried.
    None when root holds no checkpoint; NoUsableCheckpoint (on every rank) when it holds some
    and none is intact: starting over would silently throw the run away.
    """
    names = [p.name for p in step_dirs(root)] if ctx.is_main and root.exists() else []
    names = json.loads(_broadcast_str(json.dumps(names), ctx))
    for name in reversed(names):
        candidate = root / name
        problem = verify_checkpoint(candidate, ctx.rank, ctx.world_size)
        if not any_rank(problem is not None, ctx):
            return candidate
        problems = _gather_on_main(problem, ctx)
        if ctx.is_main:
            rank, first = next((r, p) for r, p in enumerate(problems) if p is not None)
            found_by = f" (found by rank {rank})" if ctx.world_size > 1 else ""
            log.warning(f"checkpoint {name} is unusable: {first}{found_by}; trying an older one")
    if not names:
        return None
    raise NoUsableCheckpoint(
        f"{root} holds {len(names)} checkpoint(s) ({names[0]} .. {names[-1]}) and none is "
        "usable (see the warnings above); none was changed. Repair or restore one, or "
        "set run.resume=restart to train again from step 0 (they are kept, moved to "
        f"{root}/{ABANDONED}<time>/)")


def _load_pt(path: Path) -> Any:
    return load_weights_only(path, str(path), map_location="cpu")


def _mismatch_message(exc: BaseException) -> str:
    cause = unwrap_checkpoint_exception(exc)
    text = str(cause.args[0]) if isinstance(cause, KeyError) and cause.args else str(cause)
    first = text.strip().splitlines()[0] if text.strip() else type(cause).__name__
    if " from model not in state dict:" in first:  # megatron lists every key of the checkpoint
        first = first.split(":")[0] + " (the checkpoint has other layers)"
    return first if len(first) <= 300 else first[:300] + " ..."


def _saved_spec(path: Path, manifest: dict) -> str:
    """The layer-spec family whose names a checkpoint's keys carry: the manifest's, or for a
    checkpoint written before it recorded one, "te" when a TE fused pre-norm key is stored."""
    if manifest.get("spec") in ("portable", "te"):
        return manifest["spec"]
    keys = SafeFileSystemReader(path / "dist").read_metadata().state_dict_metadata
    return "te" if any(".layer_norm_" in key for key in keys) else "portable"


def _in_spec(sharded: dict, spec: str) -> dict:
    """The request for a checkpoint whose keys `spec` named: every ShardedTensor (model and
    optimizer) renamed through model/hf.py:spec_key; module extra state (TE's recipe metadata,
    per spec family) is not requested: each layer keeps its fresh one."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    sharded = {**sharded, "model": {k: v for k, v in sharded["model"].items()
                                    if not (isinstance(v, ShardedObject)
                                            and v.key.endswith("_extra_state"))}}
    for item in nested_values(sharded):
        if hasattr(item, "key") and isinstance(item.key, str):
            item.key = spec_key(item.key, spec)
    return sharded


def load_checkpoint(path: Path, ctx: ParallelContext, model: torch.nn.Module,
                    optimizer, optimizer_format: str, spec: str = "portable") -> dict[str, Any]:
    """Restore model, optimizer and RNG in place (any TP/PP/DP layout the checkpoint's optimizer
    layout allows, and a checkpoint of either spec family: `spec` is this run's); return the
    trainer's state_dict ("trainer") and the layout the checkpoint was written at ("resharded",
    "layout", "optimizer_layout", "spec").

    `model` is the unwrapped megatron model whose parameters the optimizer was built on.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    manifest = json.loads((path / MANIFEST).read_text())
    saved_format = manifest.get("optimizer_format", optimizer_format)
    if saved_format != optimizer_format:
        crossing = "cpu-twin" in (saved_format, optimizer_format)
        raise ValueError(
            f"checkpoint {path} holds optimizer state in the {saved_format!r} layout and this "
            f"run writes {optimizer_format!r}: "
            + ("the CPU twin's optimizer (CPU runs) and megatron's GPU optimizers keep different "
               "state and cannot be resumed across; " if crossing else
               "megatron's distributed and plain optimizers keep different state; resume with "
               "the same trainer.distributed_optimizer, or ")
            + f"start a new run.dir from its weights alone with model.init_from={path.parents[1]}"
            " (a fresh optimizer and schedule)")
    saved_layout = manifest.get("optimizer_layout", FULLY_RESHARDABLE)  # all before it were
    saved_spec = _saved_spec(path, manifest)
    saved_data = manifest.get("data_parallel",
                              manifest["world_size"] // (manifest["tensor"] * manifest["pipeline"]))
    saved_grid = saved_layout_grid(manifest)
    problem = layout_problem(
        {"layout": saved_layout, **saved_grid, "data": saved_data, "spec": saved_spec},
        {"tensor": ctx.tensor, "pipeline": ctx.pipeline, "expert": ctx.expert,
         "expert_tensor": ctx.expert_tensor, "data": ctx.data, "spec": spec},
        megatron_optimizer=uses_megatron_ddp(ctx.device))
    if problem:
        raise CheckpointMismatch(f"checkpoint {path} cannot be resumed here: {problem}")
    trainer = _load_pt(path / "trainer.pt")
    request = _sharded_state(model, optimizer, True, saved_layout)
    if saved_spec != spec:
        request = _in_spec(request, saved_spec)
    started = time.perf_counter()
    try:
        loaded = load_dist_checkpoint(request, path / "dist",
                                      parallel_group=_data_parallel_group(ctx),
                                      cuda=ctx.hardware.cuda)
    except (CheckpointingException, CheckpointException, KeyError) as exc:
        # megatron's shape check (strategies/torch.py:503-518) and torch's per-rank failures
        # (torch/distributed/checkpoint/utils.py:194-221) come back as one of these
        raise CheckpointMismatch(f"checkpoint {path} does not fit this model: "
                                 f"{_mismatch_message(exc)}; resume with the model it was "
                                 "written with (see config.yaml in run.dir) or use another "
                                 "run.dir") from None
    vet_extra_state(loaded["model"], path / "dist")  # TE would pickle.loads it (GPU runs)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    real_missing = [k for k in missing if not k.endswith("_extra_state")]
    if real_missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {real_missing}, "
                         f"unexpected {unexpected}")
    optimizer.load_state_dict(loaded["optimizer"])
    same_layout = manifest["world_size"] == ctx.world_size and saved_grid == {
        "tensor": ctx.tensor, "pipeline": ctx.pipeline, "expert": ctx.expert,
        "expert_tensor": ctx.expert_tensor}
    rng_file = path / f"rng_rank{ctx.rank}.pt"
    # Another layout draws other stochastic-rounding streams anyway: keep the fresh RNG then.
    if same_layout and rng_file.exists():
        _restore_rng(_load_pt(rng_file), ctx)
    crossed = (f"; keys of the {saved_spec} spec translated to the {spec} spec's"
               if saved_spec != spec else "")
    log.info(f"checkpoint {path.name}: optimizer state in the {saved_layout} layout, written at "
             f"data parallel {saved_data}, read at {ctx.data}{crossed}; loaded in "
             f"{time.perf_counter() - started:.1f} s")
    return {"trainer": trainer, "resharded": not same_layout,
            "layout": (manifest["tensor"], manifest["pipeline"], saved_grid["expert"],
                       manifest["world_size"]),
            "optimizer_layout": saved_layout, "spec": saved_spec}
