"""The embedded demo corpus: builds, is cached, round-trips, survives a preparation race, and
is the same on every Python version."""

import hashlib
import json
import lzma
import os
import platform
from pathlib import Path

import pytest

import data.demo as demo
import data.demo_snapshot as demo_snapshot
from data.config import DEMO_CATEGORIES, DemoConfig
from data.indexed import open_indexed
from errors import ExitCode, MissingError

# sha256 over the default corpus's documents (each document's sha256, "|" after each category),
# as CPython 3.11.7's own standard library gave them before the snapshot (corpus key
# 43ec024f1a09cca4 with tokenizers 0.23.3, the golden files' key). Pinned here so that a
# change of the texts on any Python fails this test instead of silently moving the golden key.
DEFAULT_DOCUMENTS_SHA256 = "ca2951eb43327816d5c9f6617236e0ae4d5570f237f01ffe24e310285047fae5"


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


def documents_sha256(docs):
    h = hashlib.sha256()
    for cat in DEMO_CATEGORIES:
        for d in docs[cat]:
            h.update(hashlib.sha256(d.encode("utf-8")).digest())
        h.update(b"|")
    return h.hexdigest()


def test_default_documents_are_the_pinned_ones_on_this_python():
    """The texts come from data/demo_corpus/, not the running Python's standard library,
    so every Python version (this suite runs on 3.11 and 3.12) hashes to the same documents."""
    docs = demo.raw_documents(DemoConfig())
    assert {c: len(docs[c]) for c in DEMO_CATEGORIES} == {"prose": 79, "code": 73, "math": 1500}
    assert documents_sha256(docs) == DEFAULT_DOCUMENTS_SHA256, platform.python_version()


def test_code_cap_takes_the_snapshot_files_in_name_order():
    files = demo_snapshot.load()["code"]
    names = [name for name, _ in files]
    assert names == sorted(names) and len(names) == 168
    sizes = [len(text.encode("utf-8")) for _, text in files]
    cap = sum(sizes[:10]) + sizes[10] - 1  # one byte short of the 11th file
    assert demo.code_documents(cap) == [text for _, text in files[:10] if text.strip()]
    assert len(demo.code_documents(sum(sizes))) == sum(1 for _, t in files if t.strip())


@pytest.mark.skipif(platform.python_version() != demo_snapshot.SNAPSHOT_PYTHON,
                    reason=f"the snapshot is CPython {demo_snapshot.SNAPSHOT_PYTHON}'s texts")
def test_snapshot_holds_exactly_this_pythons_texts():
    """On the Python it was taken from, the snapshot is what the interpreter carries, file by file."""
    live = demo_snapshot.texts_of_this_python()
    snap = demo_snapshot.load()
    for cat in ("prose", "code"):
        assert [(d["name"], d["text"]) for d in live[cat]] == list(snap[cat]), cat


def test_missing_or_corrupt_snapshot_is_a_missing_error(tmp_path):
    with pytest.raises(MissingError, match="not found: .*absent.json.xz") as exc:
        demo_snapshot.load(str(tmp_path / "absent.json.xz"))
    assert exc.value.code == ExitCode.MISSING
    (tmp_path / "cut.json.xz").write_bytes(Path(demo_snapshot.SNAPSHOT_PATH).read_bytes()[:5000])
    with pytest.raises(MissingError, match="unreadable: .*cut.json.xz"):
        demo_snapshot.load(str(tmp_path / "cut.json.xz"))
    with lzma.open(tmp_path / "future.json.xz", "wt") as f:
        json.dump({"format": 99}, f)
    with pytest.raises(MissingError, match="format 99, expected 1"):
        demo_snapshot.load(str(tmp_path / "future.json.xz"))


def test_write_refuses_on_another_python(monkeypatch, capsys):
    """Another Python's texts would move the corpus key and every golden loss: --write refuses
    (exit 2, one line) and leaves the snapshot as it was."""
    before = os.stat(demo_snapshot.SNAPSHOT_PATH)
    monkeypatch.setattr(demo_snapshot.platform, "python_version", lambda: "3.12.1")
    assert demo_snapshot.main(["--write"]) == ExitCode.CONFIG
    assert capsys.readouterr().err.splitlines() == [
        f"error: --write on Python 3.12.1: the snapshot is CPython {demo_snapshot.SNAPSHOT_PYTHON}'s "
        "texts; run it there"]
    after = os.stat(demo_snapshot.SNAPSHOT_PATH)
    assert (after.st_mtime_ns, after.st_size) == (before.st_mtime_ns, before.st_size)
