"""What a step and a save ask of the other ranks: the stop flag rides in the loss's reduction,
the weights' finiteness is one device value, and every process group has the configured
timeout (parallel.timeout_minutes). Over two gloo processes, and the groups' timeout in a fresh
process: tests/system/test_process_groups.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from train_helpers import compose_train

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import rank_context  # noqa: E402

from training.distributed import DEFAULT_TIMEOUT_MINUTES, step_loss_and_stop  # noqa: E402
from training.signals import StopSignal  # noqa: E402
from training.trainer import all_finite  # noqa: E402


def test_all_finite_reads_no_tensor_on_the_host(monkeypatch):
    params = [torch.ones(3, dtype=torch.bfloat16), torch.zeros(2, 2)]

    def no_host_read(self):  # what `all(... .all() for p in ...)` did once per parameter
        raise AssertionError("a per-tensor host sync")

    monkeypatch.setattr(torch.Tensor, "__bool__", no_host_read)
    assert all_finite(params, torch.device("cpu")).tolist() == 1.0
    for bad in (float("nan"), float("inf"), float("-inf")):
        params[1][1, 0] = bad
        assert all_finite(params, torch.device("cpu")).tolist() == 0.0
    assert all_finite([], torch.device("cpu")).tolist() == 1.0


def test_one_rank_reads_the_loss_and_its_own_signal():
    stop = StopSignal()
    try:
        assert step_loss_and_stop(torch.tensor(2.5), stop.requested, rank_context(1, 0)) == (2.5, False)
        stop.name = "SIGTERM"
        assert stop.requested and stop.agreed(rank_context(1, 0))
        assert step_loss_and_stop(torch.tensor(2.5), stop.requested, rank_context(1, 0)) == (2.5, True)
    finally:
        stop.restore()


def test_the_timeout_is_a_setting_with_a_default_for_checkpoint_waits():
    cfg = compose_train()
    assert cfg.parallel.timeout_minutes == DEFAULT_TIMEOUT_MINUTES == 30  # NCCL's own is 10
    assert compose_train("parallel.timeout_minutes=90").parallel.timeout_minutes == 90


def test_the_configured_timeout_reaches_the_process_groups(monkeypatch):
    """train.py's start-up passes parallel.timeout_minutes to init_distributed."""
    from omegaconf import OmegaConf

    from training import entry

    class Joined(BaseException):
        pass

    def record(*args, **kwargs):
        raise Joined(kwargs)

    monkeypatch.setattr(entry, "init_distributed", record)
    raw = OmegaConf.structured(compose_train("parallel.timeout_minutes=75", "run.dir=/nonexistent"))
    with pytest.raises(Joined) as joined:
        entry._start_up(raw)
    assert joined.value.args[0]["timeout_minutes"] == 75
