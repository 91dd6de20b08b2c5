"""The run reader (training/run_reader.py): a directory that is not a finished run, or whose
checkpoints cannot be read, is one RunDirError line with its code (2, or 6 for a checkpoint that
is torn or refused), and nothing is written. The reads that succeed are checked where they are
used: tests/model/test_hf.py (the export's tensors), tests/training/test_checkpoint_layouts.py
(`model.init_from` of a run directory)."""

from __future__ import annotations

import pytest

from errors import ConfigError, ExitCode
from training.run_reader import RunDirError, pick_checkpoint, read_checkpoint_weights, read_run


def test_a_directory_that_is_not_a_run_is_refused_with_exit_2(tmp_path):
    with pytest.raises(RunDirError, match="not a directory") as caught:
        read_run(tmp_path / "nope")
    assert caught.value.code == ExitCode.CONFIG and isinstance(caught.value, ConfigError)
    with pytest.raises(RunDirError, match="no config.yaml") as caught:
        read_run(tmp_path)
    assert caught.value.code == ExitCode.CONFIG
    (tmp_path / "config.yaml").write_text("model: {hidden_size: wide}\n")
    with pytest.raises(RunDirError, match="config.yaml: ") as caught:
        read_run(tmp_path)
    assert caught.value.code == ExitCode.CONFIG and "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_checkpoints_missing_or_torn_are_refused_with_their_codes(tmp_path):
    with pytest.raises(RunDirError, match="no checkpoint in") as caught:
        pick_checkpoint(tmp_path, None)
    assert caught.value.code == ExitCode.CONFIG
    torn = tmp_path / "checkpoints" / "step_0000004"
    torn.mkdir(parents=True)  # no manifest: a writer killed before it finished
    with pytest.raises(RunDirError, match="none of its checkpoints is usable") as caught:
        pick_checkpoint(tmp_path, None)
    assert caught.value.code == ExitCode.NO_USABLE_CHECKPOINT
    with pytest.raises(RunDirError, match="step_0000004 is unusable") as caught:
        pick_checkpoint(tmp_path, 4)
    assert caught.value.code == ExitCode.NO_USABLE_CHECKPOINT
    with pytest.raises(RunDirError, match=r"--step 2: .* does not exist \(checkpoints: "
                                          r"step_0000004\)") as caught:
        pick_checkpoint(tmp_path, 2)
    assert caught.value.code == ExitCode.CONFIG


def test_checkpoint_metadata_that_would_run_code_is_refused_with_exit_6(tmp_path):
    """dist/.metadata is read by the allow-listed unpickler: a pickle naming any other callable
    is refused, never called."""
    import pickle

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(RunDirError) as caught:
        read_checkpoint_weights(tmp_path)
    assert caught.value.code == ExitCode.NO_USABLE_CHECKPOINT and "\n" not in str(caught.value)
    assert [p.name for p in (tmp_path / "dist").iterdir()] == [".metadata"]
