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
