"""The embedded demo corpus: builds, is cached, round-trips, survives a preparation race."""

import json
import os

import pytest

import data.demo as demo
from data.config import DemoConfig
from data.indexed import open_indexed


def test_demo_corpus_contents(demo_corpus):
    cache, corpus = demo_corpus
    names = set(corpus.manifest["datasets"])
    assert names == {"prose", "code", "math", "prose_val", "code_val", "math_val"}
    for name, st in corpus.manifest["datasets"].items():
        ds = open_indexed(os.path.join(corpus.path, name))
        assert len(ds) == st["documents"] > 0
        assert int(ds.sequence_lengths.sum()) == st["tokens"] >= 1000, name  # val sets hold real samples
    assert corpus.manifest["vocab_size"] == DemoConfig().vocab_size
    assert corpus.manifest["eod_id"] == 0


def test_second_call_uses_cache(demo_corpus):
    cache, corpus = demo_corpus
    count = demo.BUILD_COUNT
    mtime = os.path.getmtime(os.path.join(corpus.path, "prose.bin"))
    again = demo.ensure_demo_corpus(cache)
    assert again.path == corpus.path and not again.built
    assert demo.BUILD_COUNT == count
    assert os.path.getmtime(os.path.join(corpus.path, "prose.bin")) == mtime


def test_tokenizer_round_trips_and_dataset_matches_source(demo_corpus):
    from tokenizers import Tokenizer

    _, corpus = demo_corpus
    tok = Tokenizer.from_file(corpus.tokenizer_path)
    cfg = DemoConfig()
    docs = demo.raw_documents(cfg)
    for cat in ("prose", "code", "math"):
        train, val = demo.split_train_val(docs[cat], cfg.val_fraction)
        for text in (train[0], val[-1]):
            assert tok.decode(tok.encode(text).ids) == text
        ds = open_indexed(os.path.join(corpus.path, cat))
        ids = ds[0].tolist()
        assert ids[-1] == 0 and tok.decode(ids[:-1]) == train[0]
        vds = open_indexed(os.path.join(corpus.path, f"{cat}_val"))
        assert tok.decode(vds[len(vds) - 1].tolist()[:-1]) == val[-1]


def test_math_is_deterministic_and_correct():
    a = demo.math_documents(50, seed=7)
    assert a == demo.math_documents(50, seed=7) and a != demo.math_documents(50, seed=8)
    for doc in a:
        for line in doc.splitlines()[1:]:
            expr = line.split(". ", 1)[1]
            if expr.count("=") == 1 and "remainder" not in expr and "?" not in expr:
                lhs, rhs = expr.split(" = ")
                assert eval(lhs) == int(rhs), line


def test_key_changes_with_settings():
    cfg = DemoConfig()
    docs = demo.raw_documents(cfg)
    assert demo.corpus_key(cfg, docs) == demo.corpus_key(DemoConfig(), demo.raw_documents(DemoConfig()))
    other = DemoConfig(vocab_size=1024)
    assert demo.corpus_key(other, docs) != demo.corpus_key(cfg, docs)


def test_race_loser_uses_winner(tmp_path, monkeypatch):
    """Another process finishes first while we build: we discard ours and use theirs."""
    cfg = DemoConfig(math_documents=20, code_max_bytes=1000)
    key = demo.corpus_key(cfg, demo.raw_documents(cfg))
    final = tmp_path / f"demo-{key}"

    def fake_build(out, key, cfg, docs, show_progress):
        os.makedirs(out)
        (tmp_path / "winner").mkdir()
        (tmp_path / "winner" / "manifest.json").write_text(json.dumps({"who": "winner"}))
        os.rename(tmp_path / "winner", final)  # the competitor's rename lands first
        with open(os.path.join(out, "manifest.json"), "w") as f:
            json.dump({"who": "loser"}, f)

    monkeypatch.setattr(demo, "_build", fake_build)
    count = demo.BUILD_COUNT
    got = demo.ensure_demo_corpus(str(tmp_path), cfg)
    assert got.manifest == {"who": "winner"} and not got.built and demo.BUILD_COUNT == count
    assert sorted(os.listdir(tmp_path)) == [final.name]  # the loser's temp dir is gone


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(out, *a):
        os.makedirs(out)
        raise RuntimeError("boom")

    monkeypatch.setattr(demo, "_build", boom)
    with pytest.raises(RuntimeError):
        demo.ensure_demo_corpus(str(tmp_path), DemoConfig(math_documents=20, code_max_bytes=1000))
    assert os.listdir(tmp_path) == []
