"""Sharded preparation (`data.prepare --shard I/N`), `--check`, and schedules that glob the shards.

The Slurm array that runs the shards, and train.py on globbed shards:
tests/system/test_data_prepare_runs.py.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest

from data.indexed import open_indexed
from data.prepare import cli
from tests.prepare_helpers import WORDS, make_shards, prepare, write_corpus


def documents(prefix):
    ds = open_indexed(str(prefix))
    return [np.array(ds[i]) for i in range(len(ds))]


def shards_of(out, n):
    return [f"{out}_shard{i}" for i in range(n)]


def test_shards_in_order_hold_exactly_the_unsharded_documents(tmp_path, tiny_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = write_corpus(tmp_path / "in")
    rng = random.Random(1)
    pq.write_table(pa.table({"text": [" ".join(rng.choice(WORDS) for _ in range(30)) for _ in range(200)]}),
                   corpus / "part3.parquet", row_group_size=20)
    assert prepare([corpus], tiny_tokenizer, tmp_path / "all") == 0
    n = 4
    for i in range(n):
        assert prepare([corpus], tiny_tokenizer, tmp_path / "web", "--shard", f"{i}/{n}") == 0
    whole = documents(tmp_path / "all")
    parts = [doc for p in shards_of(tmp_path / "web", n) for doc in documents(p)]
    assert len(parts) == len(whole) and all(np.array_equal(a, b) for a, b in zip(parts, whole))
    metas = [json.loads(open(p + ".json").read()) for p in shards_of(tmp_path / "web", n)]
    single = json.loads((tmp_path / "all.json").read_text())
    assert all(m["documents"] > 0 for m in metas)  # the split spreads the bytes, not just the files
    assert sum(m["tokens"] for m in metas) == single["tokens"]
    assert sum(m["bad_records"]["malformed JSON"] for m in metas) == single["bad_records"]["malformed JSON"]
    # a shard starting mid-file reports the file's own line numbers
    assert {e for m in metas for e in m["bad_examples"]} >= set(single["bad_examples"])
    assert [m["shard"]["index"] for m in metas] == list(range(n))


def test_a_complete_shard_is_skipped_and_a_changed_input_is_refused(tmp_path, tiny_tokenizer, capsys):
    corpus = write_corpus(tmp_path / "in", sizes=(400, 400, 50))
    out = tmp_path / "web"
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "1/3") == 0
    shard = f"{out}_shard1"
    before = os.stat(shard + ".bin")
    capsys.readouterr()
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "1/3") == 0
    assert "shard 1/3 is complete" in capsys.readouterr().out
    after = os.stat(shard + ".bin")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not rewritten

    # same size, other bytes inside shard 1's range: the hash tells
    meta = json.loads(open(shard + ".json").read())
    piece = meta["pieces"][0]
    path = piece["path"]
    data = bytearray(open(path, "rb").read())
    at = data.index(b"alpha", piece["start"])
    data[at:at + 5] = b"omega"
    open(path, "wb").write(bytes(data))
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "1/3") == 2
    err = capsys.readouterr().err
    assert f"refusing to overwrite {shard}: it was made from inputs whose content changed: {path}" in err
    assert os.stat(shard + ".bin").st_ino == before.st_ino
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "1/3", "--overwrite") == 0
    assert os.stat(shard + ".bin").st_ino != before.st_ino

    # another split of the same prefix is refused, naming the shard that is in the way
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "0/4") == 2
    assert f"{shard} is shard 1/3, but this run splits into 4" in capsys.readouterr().err


def test_a_shard_whose_idx_never_landed_is_rebuilt(tmp_path, tiny_tokenizer):
    """A crash between the renames leaves PREFIX_shardI.bin without .idx: not complete, redone."""
    corpus = write_corpus(tmp_path / "in", sizes=(200,))
    out = tmp_path / "web"
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "0/2") == 0
    expected = documents(f"{out}_shard0")
    os.unlink(f"{out}_shard0.idx")
    assert prepare([corpus], tiny_tokenizer, out, "--shard", "0/2") == 0
    got = documents(f"{out}_shard0")
    assert len(got) == len(expected) and all(np.array_equal(a, b) for a, b in zip(got, expected))


@pytest.mark.parametrize("value,message", [
    ("3/3", "--shard '3/3': need 0 <= I < N"),
    ("1of3", "--shard '1of3': expected I/N with integers, e.g. 3/64"),
])
def test_a_bad_shard_value_is_a_usage_error(tmp_path, tiny_tokenizer, capsys, value, message):
    corpus = write_corpus(tmp_path / "in", sizes=(10,))
    assert prepare([corpus], tiny_tokenizer, tmp_path / "o" / "web", "--shard", value) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not (tmp_path / "o").exists()


def test_check_counts_tokens_and_names_each_bad_shard(tmp_path, tiny_tokenizer, capsys):
    from data.tokenizer import train_bpe_tokenizer

    corpus = write_corpus(tmp_path / "in", sizes=(300, 300, 30))
    web, code = tmp_path / "web" / "web", tmp_path / "code" / "code"
    for i in range(3):
        assert prepare([corpus], tiny_tokenizer, web, "--shard", f"{i}/3") == 0
    assert prepare([corpus / "part0.jsonl"], tiny_tokenizer, code, "--shard", "0/1") == 0
    capsys.readouterr()
    assert cli.main(["--check", str(web), str(code)]) == 0
    out = capsys.readouterr().out
    tokens = [json.load(open(p + ".json"))["tokens"] for p in shards_of(web, 3)]
    assert "│ web      │    3/3 │" in out and f"{sum(tokens):,}" in out and "all shards complete" in out

    os.unlink(f"{web}_shard1.idx")  # a task killed between the renames
    os.truncate(f"{web}_shard2.bin", 10)  # a shard cut short
    assert cli.main(["--check", str(web)]) == 3
    err = capsys.readouterr().err
    assert f"error: {web}_shard1: incomplete: .idx missing" in err
    assert f"error: {web}_shard2: its .bin is 10 bytes, expected" in err
    for ext in (".bin", ".idx", ".json"):
        if os.path.exists(f"{web}_shard1{ext}"):
            os.unlink(f"{web}_shard1{ext}")
    assert cli.main(["--check", str(web)]) == 3
    assert f"error: {web}_shard1: missing (shard 1/3 never completed" in capsys.readouterr().err

    other = tmp_path / "other.json"
    train_bpe_tokenizer(["something else entirely"] * 30, 280).save(str(other))
    assert prepare([corpus], str(other), web, "--shard", "1/3") == 0
    assert prepare([corpus], tiny_tokenizer, web, "--shard", "2/3", "--overwrite") == 0
    assert cli.main(["--check", str(web)]) == 2
    assert f"error: {web}_shard1: made with tokenizer {other}" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# schedules whose prefixes are globs


def glob_config(root, tok, web_prefixes, weights=None):
    from data.config import CategoryConfig, DataConfig, PhaseConfig

    return DataConfig(
        name="shards", cache_dir=str(root / "cache"), tokenizer=tok,
        categories={"web": CategoryConfig(prefixes=web_prefixes, weights=weights)},
        phases=[PhaseConfig(name="all", end_fraction=1.0, weights={"web": 1.0})],
    )


def build(cfg):
    from data import build_data

    return build_data(cfg, seq_length=32, micro_batch_size=2, global_batch_size=4, total_tokens=32 * 400,
                      seed=3, show_progress=False)


def test_a_glob_reads_every_shard_in_natural_order_weighted_by_tokens(tmp_path, tiny_tokenizer):
    from fractions import Fraction

    shards = make_shards(tmp_path, tiny_tokenizer, 11)
    (tmp_path / "web_shard3.tmp-1@host-0123abcd.bin").write_bytes(b"a writer's temporary")  # never a match
    bundle = build(glob_config(tmp_path, tiny_tokenizer, [str(tmp_path / "web_shard*")]))
    sources = bundle.train.sources
    assert [s.prefix for s in sources] == shards  # shard2 before shard10
    tokens = [json.load(open(p + ".json"))["tokens"] for p in shards]
    assert [s.weight_in_category for s in sources] == [Fraction(t, sum(tokens)) for t in tokens]
    bundle.train.next_global_batch()

    # a glob's weight is shared among its matches by tokens; a plain prefix keeps its own
    extra = make_shards(tmp_path, tiny_tokenizer, 1, name="books", seed=5)
    bundle = build(glob_config(tmp_path, tiny_tokenizer, [str(tmp_path / "web_shard*"), extra[0]],
                               weights=[0.75, 0.25]))
    w = [s.weight_in_category for s in bundle.train.sources]
    assert w[-1] == Fraction(1, 4) and sum(w[:-1]) == Fraction(3, 4)
    assert w[:-1] == [Fraction(3, 4) * Fraction(t, sum(tokens)) for t in tokens]


def test_a_glob_is_validated_at_start_up_naming_the_bad_shard(tmp_path, tiny_tokenizer):
    from data.config import MissingDataError, validate_config

    shards = make_shards(tmp_path, tiny_tokenizer, 3)
    cfg = glob_config(tmp_path, tiny_tokenizer, [str(tmp_path / "web_shard*")])
    validate_config(cfg, check_files=True)

    os.unlink(shards[1] + ".json")
    with pytest.raises(MissingDataError, match=rf"match {shards[1]} is incomplete: .json missing"):
        validate_config(cfg, check_files=True)
    for ext in (".bin", ".idx"):
        os.unlink(shards[1] + ext)
    with pytest.raises(MissingDataError, match=rf"shard {shards[1]} of the same split is missing"):
        validate_config(cfg, check_files=True)
    cfg = glob_config(tmp_path, tiny_tokenizer, [str(tmp_path / "nothing_shard*")])
    with pytest.raises(MissingDataError, match=r"prefixes\[0\] = '.*nothing_shard\*': the glob matches no dataset"):
        validate_config(cfg, check_files=True)


def test_an_empty_shard_is_complete_and_left_out_of_the_glob(tmp_path, tiny_tokenizer, capsys):
    """Two gzip files cannot be split in three: one shard is empty, written as such, skipped."""
    import gzip

    for k in range(2):
        with gzip.open(tmp_path / f"f{k}.jsonl.gz", "wt") as f:
            f.write("".join(json.dumps({"text": f"alpha beta {k} {i}"}) + "\n" for i in range(100)))
    for i in range(3):
        assert prepare([tmp_path / "f*.jsonl.gz"], tiny_tokenizer, tmp_path / "web", "--shard", f"{i}/3") == 0
    metas = [json.load(open(p + ".json")) for p in shards_of(tmp_path / "web", 3)]
    assert sorted(m["documents"] for m in metas) == [0, 100, 100]
    assert cli.main(["--check", str(tmp_path / "web")]) == 0
    bundle = build(glob_config(tmp_path, tiny_tokenizer, [str(tmp_path / "web_shard*")]))
    assert len(bundle.train.sources) == 2
