"""Fixtures for tests that need megatron's parallel_state on CPU (single-process gloo group).

Use from a test module with ``from tests.mamba_fixtures import megatron_single_process`` (or
``from mamba_fixtures import ...`` when tests/ is on sys.path) and request the fixture.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_megatron_single_process(tp: int = 1, pp: int = 1) -> bool:
    """Initialise a world-size-1 gloo process group and megatron model parallel (TP=PP=1).

    Returns True if this call created the process group (so the caller should destroy it).
    """
    from megatron.core import parallel_state

    created = False
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0
        )
        created = True
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
    # model_parallel_cuda_manual_seed is CUDA-only: seed the CPU generator instead.
    torch.manual_seed(1234)
    return created


@pytest.fixture(scope="module")
def megatron_single_process():
    """parallel_state initialised on a single-process gloo group (TP=1, PP=1) for the module."""
    from megatron.core import parallel_state

    created = init_megatron_single_process()
    yield
    if created:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
