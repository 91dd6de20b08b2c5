"""What the ranks exchange, in processes of their own: over two gloo processes the stop flag
rides in the loss's reduction across the whole world, and in a fresh process every process group
(the world's and megatron's) gets the configured timeout (the in-process checks:
tests/training/test_collectives.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from helpers import free_port, rank_context
from train_helpers import REPO

from training.distributed import step_loss_and_stop


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        results = {
            # data parallel 2: the mean of the two ranks' losses; only rank 1 was signalled
            "dp": step_loss_and_stop(torch.tensor(1.0 + rank), rank == 1, rank_context(2, rank)),
            "dp_quiet": step_loss_and_stop(torch.tensor(1.0 + rank), False, rank_context(2, rank)),
            # tensor parallel 2 (one replica): both ranks hold the same loss, counted once
            "tp": step_loss_and_stop(torch.tensor(3.0), rank == 0, rank_context(2, rank, tensor=2)),
            # a non-finite loss stays what it was (not a NaN made of inf x 0)
            "inf": step_loss_and_stop(torch.tensor(float("inf")), False, rank_context(2, rank, tensor=2)),
        }
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(json.dumps(results))


def test_the_stop_flag_rides_in_the_loss_reduction_over_the_whole_world(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}").read_text())  # tuples come back lists
        assert results["dp"] == [1.5, True], rank
        assert results["dp_quiet"] == [1.5, False], rank
        assert results["tp"] == [3.0, True], rank
        assert results["inf"] == [float("inf"), False], rank


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
