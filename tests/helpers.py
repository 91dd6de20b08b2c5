"""Builders the tests of both tiers share (the fixtures are in conftest.py): data configs over the
demo corpus and over synthetic sources, model, training and recompute configs from the recipes, a
free TCP port, a counter of the emulated linears' weight quantizations, downstream tasks that
cannot be prepared, and what the run-directory and checkpoint tests do to files (a victim for
planted links, a flipped byte, a pickle that runs code, a snapshot of a tree)."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "data"

# synthetic sources: source j writes token ids in [BAND*j + 1, BAND*(j+1)], EOD = 0
BAND = 60


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a multi-process test's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def rank_context(world: int, rank: int, tensor: int = 1):
    """The ParallelContext of `rank` in a CPU world of `world` processes, `tensor`-way tensor
    parallel and data parallel over the rest (one pipeline stage)."""
    import torch

    from training.distributed import ParallelContext

    return ParallelContext(world_size=world, rank=rank, tensor=tensor, pipeline=1,
                           data=world // tensor, tensor_rank=rank % tensor, pipeline_rank=0,
                           data_rank=rank // tensor, device=torch.device("cpu"))

# -- data ---------------------------------------------------------------------------------------


def demo_config(cache_dir: str, **overrides):
    """recipes/data/demo.yaml as a DataConfig with ``cache_dir`` set."""
    from omegaconf import OmegaConf

    from data.config import to_data_config

    cfg = OmegaConf.load(RECIPES / "demo.yaml")
    cfg.cache_dir = cache_dir
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return to_data_config(cfg)


def write_source(prefix: str, index: int, num_docs: int, seed: int = 0, min_len: int = 5, max_len: int = 40) -> None:
    """An indexed dataset whose tokens all lie in source ``index``'s band (plus EOD 0 at doc ends)."""
    from data.indexed import mcore

    rng = np.random.default_rng(seed + 1000 * index)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    b = mcore().IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(min_len, max_len))
        ids = np.concatenate([rng.integers(BAND * index + 1, BAND * (index + 1) + 1, n - 1), [0]]).astype(np.uint16)
        b.add_document(ids, [len(ids)])
    b.finalize(prefix + ".idx")


def source_of_tokens(tokens) -> int:
    """Which synthetic source a sample's tokens came from."""
    t = np.asarray(tokens)
    t = t[t > 0]
    bands = np.unique((t - 1) // BAND)
    assert len(bands) == 1, f"sample mixes sources {bands}"
    return int(bands[0])


def synthetic_config(
    root: str,
    tokenizer: str,
    docs: Sequence[int] = (200, 120, 60),
    phases: Optional[List[dict]] = None,
    total_tokens: Optional[int] = None,
    val_docs: int = 30,
):
    """A DataConfig over synthetic sources c0, c1, ... (one prefix each) + one validation prefix."""
    from data.config import CategoryConfig, DataConfig, PhaseConfig

    cats = {}
    for j, n in enumerate(docs):
        prefix = os.path.join(root, f"c{j}")
        if not os.path.exists(prefix + ".idx"):
            write_source(prefix, j, n)
        cats[f"c{j}"] = CategoryConfig(prefixes=[prefix])
    val = os.path.join(root, "val")
    if not os.path.exists(val + ".idx"):
        write_source(val, 0, val_docs, seed=99)
    if phases is None:
        phases = [
            dict(name="a", end_fraction=0.5, weights={"c0": 0.5, "c1": 0.3, "c2": 0.2}),
            dict(name="b", end_fraction=0.8, weights={"c0": 0.2, "c1": 0.5, "c2": 0.3}),
            dict(name="c", end_fraction=1.0, weights={"c1": 0.25, "c2": 0.75}),
        ]
    return DataConfig(
        name="synthetic", cache_dir=os.path.join(root, "cache"), tokenizer=tokenizer, categories=cats,
        validation={"v": [val]}, phases=[PhaseConfig(**p) for p in phases], total_tokens=total_tokens,
    )


# -- model and training configs -----------------------------------------------------------------


def model_config(name: str):
    """A ModelConfig from recipes/model/<name>.yaml (its Hydra `defaults` list dropped)."""
    from omegaconf import OmegaConf

    from model.config import ModelConfig

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "model" / f"{name}.yaml"))
    raw.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))


def model_full_tensors(module) -> dict:
    """{checkpoint key (portable names): tensor} of a model built at TP = PP = 1: the keys and
    values its distributed checkpoint stores, read through megatron's sharded_state_dict as
    model/hf.py reads a checkpoint."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from model.hf import _sharded_tensors, canonical_key

    sharded, _ = _sharded_tensors(module)
    out = {}
    for sh in nested_values(sharded):
        if not isinstance(sh, ShardedTensor):
            continue
        key = canonical_key(sh.key)
        if sh.prepend_axis_num:  # an MoE layer's experts: one [experts, out, in] tensor
            full = out.setdefault(key, sh.data.new_empty(sh.global_shape))
            full[sh.global_slice()] = sh.data.detach()
            continue
        assert tuple(sh.local_shape) == tuple(sh.global_shape), f"{sh.key} is sharded"
        out[key] = sh.data.detach()
    return out


def nvfp4(**fields):
    """The NVFP4 recipe's PrecisionConfig with these fields changed."""
    from nvfp4_recipe.policy import PrecisionConfig

    return PrecisionConfig(name="nvfp4", format="nvfp4", **fields)


def recompute_settings() -> list:
    """The recompute settings the tests compare: megatron's none, selective and full, and full's
    uniform and block methods."""
    from model.recompute import RecomputeConfig

    return [RecomputeConfig(), RecomputeConfig("selective"), RecomputeConfig("full"),
            RecomputeConfig("full", "uniform", 2), RecomputeConfig("full", "block", 3)]


def train_config(model: str = "demo", precision=None, *, tensor: int = 1, pipeline: int = 1,
                 seq_length=None, micro_batch_size=None, global_batch_size=None, run_dir=None):
    """A TrainConfig dataclass (as run() passes it) with the given model recipe and precision."""
    from training.config import TrainConfig

    cfg = TrainConfig()
    cfg.model = model_config(model)
    if precision is not None:
        cfg.precision = precision
    cfg.parallel.tensor, cfg.parallel.pipeline = tensor, pipeline
    if seq_length is not None:
        cfg.trainer.seq_length = seq_length
    if micro_batch_size is not None:
        cfg.trainer.micro_batch_size = micro_batch_size
    if global_batch_size is not None:
        cfg.trainer.global_batch_size = global_batch_size
    if run_dir is not None:
        cfg.run.dir = str(run_dir)
    return cfg


def unwritable_output(where: str, tmp_path: Path, name: str) -> Path:
    """An output path no process can create, root included: under sysfs (`where="sysfs"`, where
    mkdir is refused) or under a regular file ("under_a_file"). Skips where there is no sysfs."""
    import pytest

    if where == "sysfs":
        if not Path("/sys/kernel").is_dir():
            pytest.skip("no sysfs")
        return Path("/sys/kernel") / name
    (tmp_path / "a_file").write_text("not a directory")
    return tmp_path / "a_file" / name



# -- quantization -------------------------------------------------------------------------------


def count_weight_quantizations(monkeypatch) -> dict:
    """{"fprop": n, "dgrad": n}: how often the emulated NVFP4 linears quantize a weight for each
    GEMM from now on (the counts go up in place)."""
    from nvfp4_recipe.operands import _NVFP4Ops

    calls = {"fprop": 0, "dgrad": 0}
    fprop, dgrad = _NVFP4Ops.weight_fprop, _NVFP4Ops.weight_dgrad

    def counted_fprop(self, weight):
        calls["fprop"] += 1
        return fprop(self, weight)

    def counted_dgrad(self, weight, operand):
        calls["dgrad"] += 1
        return dgrad(self, weight, operand)

    monkeypatch.setattr(_NVFP4Ops, "weight_fprop", counted_fprop)
    monkeypatch.setattr(_NVFP4Ops, "weight_dgrad", counted_dgrad)
    return calls


# -- downstream tasks ---------------------------------------------------------------------------

# An lm-eval task whose documents live on the Hugging Face Hub: offline, with an empty cache, it
# cannot be prepared.
NETWORK_TASK = """task: needs_the_hub
dataset_path: nvfp4-tests/not-a-cached-dataset
dataset_name: main
test_split: test
output_type: multiple_choice
doc_to_text: "{{q}}"
doc_to_choice: "{{c}}"
doc_to_target: 0
"""


def task_with_a_malformed_line(tmp_path: Path) -> Path:
    """A copy of a shipped task whose third document is a cut JSON line."""
    import shutil

    from training.downstream import SHIPPED_TASKS

    for name in ("demo_arith_choice.yaml", "demo_arith_choice.jsonl", "loader.py"):
        shutil.copy(SHIPPED_TASKS / name, tmp_path / name)
    lines = (tmp_path / "demo_arith_choice.jsonl").read_text().splitlines()
    lines[2] = lines[2][: len(lines[2]) // 2]
    (tmp_path / "demo_arith_choice.jsonl").write_text("\n".join(lines) + "\n")
    yaml = tmp_path / "cut_arith.yaml"
    yaml.write_text((tmp_path / "demo_arith_choice.yaml").read_text()
                    .replace("task: demo_arith_choice", "task: cut_arith"))
    return yaml


# -- files and checkpoints ----------------------------------------------------------------------


def victim_file(tmp_path: Path) -> tuple[Path, bytes]:
    """A file outside the run directory that a planted link points at, and its bytes."""
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"the user's own file, not the run's\n")
    return victim, victim.read_bytes()


def flip_byte(file: Path) -> None:
    """Corrupt `file` in place: its middle byte inverted, its size unchanged."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def snapshot(root: Path) -> dict:
    """{path relative to `root`: bytes} of every file under `root`."""
    return {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class RunsCode:
    """Unpickling this runs `touch MARKER`: what a crafted .metadata does to a plain pickle.load."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)
