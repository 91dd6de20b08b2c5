"""What a step and a save ask of the other ranks: the stop flag rides in the loss's reduction,
the weights' finiteness is one device value, and every process group has the configured
timeout (parallel.timeout_minutes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from train_helpers import REPO, compose_train

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import free_port  # noqa: E402

from training.distributed import (DEFAULT_TIMEOUT_MINUTES, ParallelContext,  # noqa: E402
                                  step_loss_and_stop)
from training.signals import StopSignal  # noqa: E402
from training.trainer import all_finite  # noqa: E402


def _ctx(world: int, rank: int, tensor: int = 1) -> ParallelContext:
    return ParallelContext(world_size=world, rank=rank, tensor=tensor, pipeline=1,
                           data=world // tensor, tensor_rank=rank % tensor, pipeline_rank=0,
                           data_rank=rank // tensor, device=torch.device("cpu"))


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
        assert step_loss_and_stop(torch.tensor(2.5), stop.requested, _ctx(1, 0)) == (2.5, False)
        stop.name = "SIGTERM"
        assert stop.requested and stop.agreed(_ctx(1, 0))
        assert step_loss_and_stop(torch.tensor(2.5), stop.requested, _ctx(1, 0)) == (2.5, True)
    finally:
        stop.restore()


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        results = {
            # data parallel 2: the mean of the two ranks' losses; only rank 1 was signalled
            "dp": step_loss_and_stop(torch.tensor(1.0 + rank), rank == 1, _ctx(2, rank)),
            "dp_quiet": step_loss_and_stop(torch.tensor(1.0 + rank), False, _ctx(2, rank)),
            # tensor parallel 2 (one replica): both ranks hold the same loss, counted once
            "tp": step_loss_and_stop(torch.tensor(3.0), rank == 0, _ctx(2, rank, tensor=2)),
            # a non-finite loss stays what it was (not a NaN made of inf x 0)
            "inf": step_loss_and_stop(torch.tensor(float("inf")), False, _ctx(2, rank, tensor=2)),
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(json.dumps(results))


@pytest.mark.slow
def test_the_stop_flag_rides_in_the_loss_reduction_over_the_whole_world(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}").read_text())  # tuples come back lists
        assert results["dp"] == [1.5, True], rank
        assert results["dp_quiet"] == [1.5, False], rank
        assert results["tp"] == [3.0, True], rank
        assert results["inf"] == [float("inf"), False], rank


def test_the_timeout_is_a_setting_with_a_default_for_checkpoint_waits():
    cfg = compose_train()
    assert cfg.parallel.timeout_minutes == DEFAULT_TIMEOUT_MINUTES == 30  # NCCL's own is 10
    assert compose_train("parallel.timeout_minutes=90").parallel.timeout_minutes == 90


def test_every_process_group_gets_the_timeout():
    """The world's group and megatron's (data, tensor, pipeline), in a fresh process."""
    code = (
        "import torch, torch.distributed as dist\n"
        "from megatron.core import parallel_state as ps\n"
        "from training.distributed import init_distributed\n"
        "init_distributed(1, 1, 'gloo', timeout_minutes=45)\n"
        "groups = [dist.distributed_c10d._get_default_group(), ps.get_data_parallel_group(),\n"
        "          ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()]\n"
        "print([int(g._get_backend(torch.device('cpu')).options._timeout.total_seconds())\n"
        "       for g in groups])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == str([45 * 60] * 4)


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
