"""Fixtures for the dry-run planner tests: a single-process gloo group with megatron's parallel
state at tensor = pipeline = 1 (what the planner needs), and TrainConfig builders."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plan_process_group():
    """world size 1, TP = PP = 1; torn down after the module (only what this fixture created)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    created_group = not dist.is_initialized()
    if created_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                world_size=1, rank=0)
    created_state = not parallel_state.model_parallel_is_initialized()
    if created_state:
        parallel_state.initialize_model_parallel(1, 1)
    yield
    if created_state:
        parallel_state.destroy_model_parallel()
    if created_group:
        dist.destroy_process_group()


def model_config(name: str):
    """A ModelConfig from recipes/model/<name>.yaml (its Hydra `defaults` list dropped)."""
    from omegaconf import OmegaConf

    from model.config import ModelConfig

    raw = OmegaConf.to_container(OmegaConf.load(REPO / "recipes" / "model" / f"{name}.yaml"))
    raw.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), raw))


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
