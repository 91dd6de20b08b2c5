"""What `python -m tools.hf_export` may never do: delete the run it exports or a user's files,
and the one-line errors of its refusals.

Fast: a run directory made here (config.yaml, checkpoints, metrics) whose checkpoint reader is
replaced by a small random model's tensors, so `main()` runs end to end in this process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install -e '.[hf]'")

from errors import ExitCode  # noqa: E402
from model import hf  # noqa: E402
from model.build import build_model  # noqa: E402
from model.config import ModelConfig  # noqa: E402
from nvfp4_recipe.policy import PrecisionConfig  # noqa: E402
from tools import hf_export  # noqa: E402

from tests.helpers import model_full_tensors, unwritable_output  # noqa: E402

TINY = ModelConfig(pattern="M-*", hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                   num_query_groups=2, kv_channels=16, mamba_num_heads=8, mamba_head_dim=16,
                   mamba_state_dim=16, mamba_num_groups=2, mamba_chunk_size=16, vocab_size=300,
                   spec="portable")


@pytest.fixture(scope="module")
def tiny_weights(parallel_context):
    from transformers import NemotronHForCausalLM, PreTrainedTokenizerFast  # noqa: F401
    # (imported here: their import-time warnings are not the tests' stderr)
    torch.manual_seed(0)
    model = build_model(TINY, PrecisionConfig(), vocab_size=TINY.vocab_size, backend="emulated",
                        params_dtype=torch.bfloat16).module
    return {k: v.clone() for k, v in model_full_tensors(model).items()}


@pytest.fixture
def run(tmp_path, monkeypatch, tiny_tokenizer, tiny_weights) -> Path:
    """tmp_path/runs/run: a finished run's files (what the export must never touch), beside a
    sibling run; the checkpoint reader returns `tiny_weights`."""
    run = tmp_path / "runs" / "run"
    for step in (2, 4):
        ckpt = run / "checkpoints" / f"step_{step:07d}"
        ckpt.mkdir(parents=True)
        (ckpt / "manifest.json").write_text(json.dumps({"step": step}))
    config = {"model": {k: (str(v) if k == "spec" else v)
                        for k, v in dataclasses.asdict(TINY).items()},
              "data": {"tokenizer": tiny_tokenizer}}
    (run / "config.yaml").write_text(json.dumps(config))  # YAML is a superset of JSON
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (tmp_path / "runs" / "sibling").mkdir()
    (tmp_path / "runs" / "sibling" / "config.yaml").write_text("model: {}\n")
    monkeypatch.setattr(hf_export, "pick_checkpoint",
                        lambda run_dir, step: run_dir / "checkpoints" / "step_0000004")
    monkeypatch.setattr(hf_export, "read_checkpoint_weights", lambda checkpoint: tiny_weights)
    return run


def files_under(root: Path) -> dict:
    """{relative path: bytes} of every file (and empty directory) under root."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(root))] = p.read_bytes()
        elif p.is_dir() and not any(p.iterdir()):
            out[str(p.relative_to(root))] = None
    return out


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.mark.parametrize("where", ["the_run", "its_parent", "inside_it"])
def test_overwrite_never_replaces_the_run_or_a_directory_holding_it(run, tmp_path, capsys,
                                                                      where):
    output = {"the_run": run, "its_parent": run.parent, "inside_it": run / "hf"}[where]
    before = files_under(tmp_path)
    assert hf_export.main([str(run), "--output", str(output), "--overwrite"]) == 2
    line = one_error_line(capsys)
    assert f"--output {output}" in line and str(run) in line
    assert files_under(tmp_path) == before  # the run, its sibling: not a byte changed, nothing added


def test_overwrite_replaces_only_a_previous_export(run, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("precious")
    before = files_under(tmp_path)
    assert hf_export.main([str(run), "--output", str(notes), "--overwrite"]) == 2
    assert "not an export" in one_error_line(capsys)
    assert files_under(tmp_path) == before

    out = tmp_path / "hf"
    assert hf_export.main([str(run), "--output", str(out)]) == 0
    assert (out / hf.EXPORT_MARKER).is_file() and (out / "model.safetensors").is_file()
    first = files_under(out)
    capsys.readouterr()
    assert hf_export.main([str(run), "--output", str(out), "--overwrite"]) == 0  # an export: replaced
    assert files_under(out).keys() == first.keys()
    capsys.readouterr()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]

    (out / "README.md").write_text("my model card")  # a file the export did not write
    before = files_under(tmp_path)
    assert hf_export.main([str(run), "--output", str(out), "--overwrite"]) == 2
    assert "README.md" in one_error_line(capsys)
    assert files_under(tmp_path) == before


def test_the_writer_checks_the_marker_again_before_moving_anything_aside(tiny_weights, tmp_path):
    """write_hf_dir itself (what a caller other than the CLI uses) never moves aside a directory
    that is not an export, even when asked to write there."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "corpus.bin").write_bytes(b"\x00\x01")
    config = hf.hf_config(TINY, TINY.vocab_size, eos_token_id=0)
    state = hf.to_hf(tiny_weights, TINY, TINY.vocab_size)
    with pytest.raises(hf.HFError, match="no nvfp4_export.json in it"):
        hf.write_hf_dir(out, config, state, tokenizer=None)
    assert files_under(tmp_path) == {"data/corpus.bin": b"\x00\x01"}


# -- a refusal or a fault is one `error:` line and a documented exit code ----------------------


@pytest.mark.parametrize("size", ["lots", "0", "-5GB", "5XB"])
def test_a_max_shard_size_that_is_not_a_size_is_one_line_and_exit_2(run, tmp_path, capsys, size):
    out = tmp_path / "hf"
    assert hf_export.main([str(run), "--output", str(out), f"--max-shard-size={size}"]) == 2
    assert f"--max-shard-size {size}: not a size" in one_error_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize("where", ["sysfs", "under_a_file"])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_8(run, tmp_path, capsys, where):
    out = unwritable_output(where, tmp_path, "nvfp4-hf" if where == "sysfs" else "hf")
    before = files_under(tmp_path)
    assert hf_export.main([str(run), "--output", str(out)]) == 8
    assert f"--output {out} cannot be written" in one_error_line(capsys)
    assert files_under(tmp_path) == before


def test_a_write_error_mid_export_is_one_line_and_exit_8_leaving_the_old_export(
        run, tmp_path, capsys, monkeypatch):
    """ENOSPC (or EROFS) while the files are written: the previous export stays whole and the
    temporary goes."""
    import errno

    out = tmp_path / "hf"
    assert hf_export.main([str(run), "--output", str(out)]) == 0
    capsys.readouterr()
    before = files_under(tmp_path)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", full)
    assert hf_export.main([str(run), "--output", str(out), "--overwrite"]) == 8
    assert "cannot be written: No space left on device; nothing was replaced" in \
        one_error_line(capsys)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("fault", ["safetensors_full_disk", "ctrl_c"])
def test_a_full_disk_in_safetensors_and_ctrl_c_are_one_line_and_their_codes(
        run, tmp_path, capsys, monkeypatch, fault):
    """safetensors' writer reports ENOSPC as its own SafetensorError (not an OSError): exit 8,
    as documented, not a traceback; Ctrl-C: exit 130, one line. Either way the previous export
    stays whole and the temporary goes."""
    from safetensors import SafetensorError

    out = tmp_path / "hf"
    assert hf_export.main([str(run), "--output", str(out)]) == 0
    capsys.readouterr()
    before = files_under(tmp_path)
    raised = {"safetensors_full_disk": SafetensorError(
                  "Error while serializing: I/O error: No space left on device (os error 28)"),
              "ctrl_c": KeyboardInterrupt()}[fault]

    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr("transformers.PreTrainedTokenizerBase.save_pretrained", fails)
    code = hf_export.main([str(run), "--output", str(out), "--overwrite"])
    line = one_error_line(capsys)
    if fault == "ctrl_c":
        assert code == ExitCode.INTERRUPTED and "interrupted" in line
    else:
        assert code == ExitCode.UNWRITABLE
        assert "cannot be written: No space left on device (os error 28); nothing was " \
               "replaced" in line
    assert files_under(tmp_path) == before


def test_a_failed_rename_puts_the_previous_export_back(run, tmp_path, capsys, monkeypatch):
    """The previous export is moved aside only once the new one is whole; should the new one's
    rename then fail, the previous one goes back under its name (exit 8, one line)."""
    import errno
    import os

    out = tmp_path / "hf"
    assert hf_export.main([str(run), "--output", str(out)]) == 0
    capsys.readouterr()
    before = files_under(tmp_path)
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".hf.tmp-"):  # the new export's rename into place
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert hf_export.main([str(run), "--output", str(out), "--overwrite"]) == 8
    assert "cannot be written: Input/output error; nothing was replaced" in one_error_line(capsys)
    assert files_under(tmp_path) == before
