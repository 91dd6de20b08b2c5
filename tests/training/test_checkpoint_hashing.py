"""Checkpoint hashing at scale: each rank hashes the files it wrote, and verifies them at resume.

These check who hashes what (pure functions); saving and resuming over two gloo processes, with
a byte flipped in a file rank 1 wrote: tests/system/test_checkpoint_resume.py.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import flip_byte  # noqa: E402

from training.checkpoint import (MANIFEST, NoUsableCheckpoint, find_resume_checkpoint,  # noqa: E402
                                 verify_checkpoint, verifying_rank, writer_rank)
from training.distributed import ParallelContext  # noqa: E402


def test_each_file_is_hashed_by_the_rank_that_wrote_it():
    assert writer_rank("dist/__3_0.distcp", 8) == 3
    assert writer_rank("dist/__12_1.distcp", 16) == 12
    assert writer_rank("dist/optimizer__5_0.distcp", 8) == 5  # megatron's separation_hint prefix
    assert writer_rank("rng_rank7.pt", 8) == 7
    for shared in ("dist/.metadata", "dist/common.pt", "dist/metadata.json", "trainer.pt"):
        assert writer_rank(shared, 8) == 0
    # a rank this run does not have (a file left from another layout): rank 0 takes it
    assert writer_rank("dist/__9_0.distcp", 8) == 0
    assert writer_rank("rng_rank9.pt", 2) == 0


def test_each_manifest_entry_is_verified_by_one_rank_of_the_resuming_run():
    assert verifying_rank({"rank": 5}, 8) == 5
    assert verifying_rank({"rank": 5}, 4) == 1  # resumed at fewer ranks: folded onto them
    assert verifying_rank({}, 8) == 0  # a manifest written before writers were recorded
    assert verifying_rank({"rank": "1"}, 8) == 0 and verifying_rank({"rank": -1}, 8) == 0


def _fake_checkpoint(root: Path, step: int) -> Path:
    """A checkpoint of two ranks' files with their writers in the manifest."""
    import hashlib

    path = root / f"step_{step:07d}"
    (path / "dist").mkdir(parents=True)
    files = {"trainer.pt": 0, "dist/.metadata": 0, "dist/__0_0.distcp": 0,
             "dist/__1_0.distcp": 1, "rng_rank1.pt": 1}
    manifest = {"step": step, "files": {}}
    for name, rank in files.items():
        data = f"{name} of step {step}".encode()
        (path / name).write_bytes(data)
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                   "rank": rank}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return path


def test_a_rank_verifies_only_its_share_and_one_process_verifies_all(tmp_path):
    path = _fake_checkpoint(tmp_path, 2)
    flip_byte(path / "dist" / "__1_0.distcp")
    assert verify_checkpoint(path, rank=0, world_size=2) is None  # not rank 0's file
    assert "dist/__1_0.distcp does not match its checksum" in verify_checkpoint(path, 1, 2)
    assert "dist/__1_0.distcp" in verify_checkpoint(path)  # one process: every file
    # at one rank fewer than it was written at, rank 1's files fold onto rank 0
    assert "dist/__1_0.distcp" in verify_checkpoint(path, 0, 1)
    (path / "dist" / "stray").write_bytes(b"?")  # unlisted files: rank 0's check alone
    assert "does not list" in verify_checkpoint(path, 0, 2)
    assert "does not list" not in verify_checkpoint(path, 1, 2)


def test_a_file_that_cannot_be_read_is_an_answer_not_an_exception(tmp_path, monkeypatch):
    """Every rank must reach the collective after its check: an I/O error on a rank's share
    (a Lustre OST gone) is reported as the checkpoint's problem, not raised on that rank alone."""
    import errno

    from training import checkpoint

    path = _fake_checkpoint(tmp_path, 2)

    def failing(file):
        raise OSError(errno.EIO, "Input/output error", str(file))

    monkeypatch.setattr(checkpoint, "_sha256", failing)
    assert verify_checkpoint(path, 1, 2).startswith("unreadable (Input/output error: ")
    assert verify_checkpoint(path, 0, 2).startswith("unreadable (Input/output error: ")


def test_each_rank_lists_only_the_files_it_wrote(tmp_path):
    from training.checkpoint import _files_written_by

    path = _fake_checkpoint(tmp_path, 2)
    assert _files_written_by(path, 1, 2) == ["dist/__1_0.distcp", "rng_rank1.pt"]
    assert _files_written_by(path, 0, 2) == ["dist/.metadata", "dist/__0_0.distcp", MANIFEST,
                                             "trainer.pt"]


def test_a_corrupt_newest_checkpoint_falls_back_on_one_rank_too(tmp_path, caplog):
    single = ParallelContext(world_size=1, rank=0, tensor=1, pipeline=1, data=1, tensor_rank=0,
                             pipeline_rank=0, data_rank=0, device=torch.device("cpu"))
    _fake_checkpoint(tmp_path, 2)
    newest = _fake_checkpoint(tmp_path, 4)
    flip_byte(newest / "rng_rank1.pt")
    with caplog.at_level(logging.WARNING, logger="nvfp4_pretrain"):
        assert find_resume_checkpoint(tmp_path, single).name == "step_0000002"
    assert "step_0000004 is unusable: rng_rank1.pt does not match its checksum" in caplog.text
    flip_byte(tmp_path / "step_0000002" / "trainer.pt")
    with pytest.raises(NoUsableCheckpoint):
        find_resume_checkpoint(tmp_path, single)


def test_the_12b_projection_splits_the_checkpoint_over_the_ranks_that_write_it():
    from benchmarks.checkpoint_scaling import PARAMS_12B, per_rank_bytes, projection

    total = PARAMS_12B * 14  # BF16 weights, FP32 master weights, two FP32 Adam moments
    assert round(total / 1e9, 1) == 172.3
    assert per_rank_bytes(PARAMS_12B, 1, 1) == total
    assert round(per_rank_bytes(PARAMS_12B, 4, 184) / 1e6) == 234
    rows = {row["layout"]: row for row in projection(1e9, 2e9)}
    paper = rows["paper, TP=4 x DP=184"]
    assert paper["ranks"] == 736 and paper["before_s"] == round(total / 1e9, 1)
    assert paper["after_s"] == round(total / 736 / 2e9, 1)
    assert rows["DP=1, TP=4"]["after_s"] == round(total / 4 / 2e9, 1)
