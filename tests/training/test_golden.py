"""The golden losses' corpus: the demo corpus built here is the one the golden runs trained on.

tests/golden/<precision>.json hold the losses of an 8-step train.py run per precision, and
tests/system/test_golden_losses.py re-runs them and compares; it first checks that the run
trains on the golden run's tokens (`corpus_tokens_sha256`). This is that check alone, without
training: another `tokenizers` version that trains another BPE fails it here, naming both
versions. The demo corpus is the same on every Python version (its texts are a snapshot in
data/demo_corpus/), so the check always runs.
"""

from __future__ import annotations

import json

import tokenizers

from studies import golden


def test_demo_corpus_holds_the_golden_runs_tokens(demo_corpus):
    """Fast, on every Python: the demo corpus built here is token for token the one the golden
    files were trained on (CPython 3.11.7, tokenizers 0.23.3), so the golden runs compare."""
    _, corpus = demo_corpus
    refs = [json.loads((golden.GOLDEN_DIR / f"{p}.json").read_text()) for p in golden.PRECISIONS]
    assert {r["corpus_tokens_sha256"] for r in refs} == {golden.corpus_tokens_sha256(corpus.path)}, (
        f"tokenizers {tokenizers.__version__}, golden runs' {refs[0]['tokenizers']}")


def test_each_golden_file_says_what_made_it():
    """Every precision has a file, and a file that names how it was made says the same as its
    gemm_compute: whether BF16 GEMMs multiplied in BF16 or in FP32 (the test's exact comparison
    holds only on that kind of machine)."""
    for p in golden.PRECISIONS:
        ref = json.loads((golden.GOLDEN_DIR / f"{p}.json").read_text())
        assert ref["precision"] == p and ref["overrides"] == golden.overrides(p)
        assert ref["gemm_compute"] in ("bf16", "fp32")
        if "made_on" in ref:  # files written since studies/golden.py records it
            assert ref["made_on"] == golden.made_on(ref["gemm_compute"], ref["machine"])
    assert "in FP32" in golden.made_on("fp32", "x") and "in BF16" in golden.made_on("bf16", "x")


def test_precisions_flag_picks_the_files_to_regenerate(monkeypatch, capsys):
    """--precisions regenerates only the named formats (so adding mxfp8 leaves bf16 / nvfp4 as
    they were made); a name that is not a golden precision exits 2 before anything runs."""
    from errors import ExitCode

    regenerated = []
    monkeypatch.setattr(golden, "regenerate", regenerated.append)
    assert golden.main(["--regenerate", "--precisions", "mxfp8"]) == ExitCode.OK
    assert golden.main(["--regenerate", "--precisions", "nvfp4, mxfp8,nvfp4"]) == ExitCode.OK
    assert golden.main(["--regenerate"]) == ExitCode.OK
    assert regenerated == [["mxfp8"], ["nvfp4", "mxfp8"], ["bf16", "nvfp4", "mxfp8"]]
    assert golden.main(["--regenerate", "--precisions", "mxfp8,fp4"]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert "--precisions='mxfp8,fp4'" in err and "bf16, nvfp4, mxfp8" in err
    assert len(regenerated) == 3  # refused before regenerating
    assert golden.main(["--precisions", "mxfp8"]) == ExitCode.CONFIG  # shows, refuses to write
    assert "tests/golden/mxfp8.json" in capsys.readouterr().out
