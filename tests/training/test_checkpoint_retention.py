"""Keep-last-N retention counts only complete checkpoints and never touches a torn one."""

import json

from training.checkpoint import MANIFEST, _apply_retention, latest_valid_checkpoint


def _fake_checkpoint(root, step, complete=True):
    path = root / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "trainer.pt").write_bytes(b"x")
    if complete:
        import hashlib

        digest = hashlib.sha256(b"x").hexdigest()
        (path / MANIFEST).write_text(json.dumps(
            {"step": step, "files": {"trainer.pt": {"bytes": 1, "sha256": digest}}}))
    return path


def test_keep_last_n_complete_checkpoints(tmp_path):
    for step in (2, 4, 6, 8):
        _fake_checkpoint(tmp_path, step)
    torn = _fake_checkpoint(tmp_path, 10, complete=False)
    _apply_retention(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_0000006", "step_0000008", "step_0000010"]
    assert torn.exists()  # not counted, not deleted: the next resume reports and skips it
    assert latest_valid_checkpoint(tmp_path).name == "step_0000008"
