"""python -m data.prepare: round trip, bad input, --strict, interruption, refuse-overwrite, workers."""

import gzip
import json
import os

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from data.indexed import open_indexed
from data.prepare import cli, tokenizing
from data.prepare.pieces import plan_pieces
from data.prepare.readers import iter_records
from errors import ExitCode
from tests.prepare_helpers import no_temporaries, write_jsonl

TEXTS = [
    "Hello world.\nA second line.",
    "Ünïcödé — 中文 — emoji 🙂 and tabs\tand  double  spaces",
    "def f(x):\n    return x * 2\n",
    "  leading and trailing whitespace  \n\n",
]


def _decode_all(prefix, tok_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    ds = open_indexed(prefix)
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == tok.token_to_id("<|endoftext|>")
        out.append(tok.decode(ids[:-1]))
    return out


def test_round_trip_jsonl(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "out" / "ds"
    assert cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--no-progress"]) == 0
    assert _decode_all(str(out), tiny_tokenizer) == TEXTS
    meta = json.loads((tmp_path / "out" / "ds.json").read_text())
    assert meta["documents"] == len(TEXTS) and meta["bad_records"] == {}
    assert no_temporaries(tmp_path / "out")


def test_bad_lines_counted_and_reported(tmp_path, tiny_tokenizer, capsys):
    bad = [b"{not json", json.dumps({"body": "x"}).encode(), json.dumps({"text": 3}).encode(), b'{"text": "bad \xff"}']
    write_jsonl(tmp_path / "in.jsonl", TEXTS[:2], bad)
    out = tmp_path / "ds"
    assert cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "ds.json").read_text())
    assert meta["documents"] == 2
    assert sum(meta["bad_records"].values()) == 4
    assert set(meta["bad_records"]) == {"malformed JSON", "missing field 'text'", "field 'text' is int, not a string", "invalid UTF-8"}
    report = capsys.readouterr().out
    assert "bad records skipped" in report and "in.jsonl:3" in report


def test_strict_fails_naming_file_and_line(tmp_path, tiny_tokenizer, capsys):
    write_jsonl(tmp_path / "in.jsonl", TEXTS, [b"{oops"])
    out = tmp_path / "ds"
    rc = cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--strict", "--no-progress"])
    assert rc == ExitCode.BAD_INPUT
    assert f"{tmp_path / 'in.jsonl'}:5: malformed JSON" in capsys.readouterr().err.replace("\n", "")
    assert not os.path.exists(str(out) + ".bin") and not os.path.exists(str(out) + ".idx")
    assert no_temporaries(tmp_path)


def test_interrupted_run_leaves_no_dataset(tmp_path, tiny_tokenizer, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", TEXTS * 50)
    real, calls = tokenizing.encode_batch, []

    def dying(batch):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # as if ^C arrived mid-run
        return real(batch)

    monkeypatch.setattr(tokenizing, "encode_batch", dying)
    out = tmp_path / "ds"
    rc = cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
                   "--batch-bytes", "200", "--no-progress"])
    assert rc == 130 and len(calls) == 2
    assert not IndexedDataset.exists(str(out)) and no_temporaries(tmp_path)


def test_crash_between_renames_does_not_look_complete(tmp_path, tiny_tokenizer, monkeypatch,
                                                     capsys):
    """Even a crash inside commit (after .bin is in place) leaves no .idx: not a dataset; the
    error is one line (exit 8: the output cannot be written)."""
    write_jsonl(tmp_path / "in.jsonl", TEXTS)
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".idx"):
            raise OSError("disk vanished")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "ds"
    assert cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
                     "--no-progress"]) == ExitCode.UNWRITABLE
    assert capsys.readouterr().err.strip() == (f"error: --output {out} cannot be written: disk vanished; "
                                                "no output written")
    assert not IndexedDataset.exists(str(out))


def test_refuses_overwrite_unless_asked(tmp_path, tiny_tokenizer, capsys):
    write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = str(tmp_path / "ds")
    args = [str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", out, "--no-progress"]
    assert cli.main(args) == 0
    before = open(out + ".bin", "rb").read()
    write_jsonl(tmp_path / "in.jsonl", TEXTS[:1])
    assert cli.main(args) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert open(out + ".bin", "rb").read() == before
    assert cli.main(args + ["--overwrite"]) == 0
    assert _decode_all(out, tiny_tokenizer) == TEXTS[:1]


def test_text_modes_gzip_and_train_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\npara two\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("gz doc\n")
    out = tmp_path / "o" / "ds"
    rc = cli.main([str(tmp_path / "*.txt*"), "--train-tokenizer", "300", "--text-doc", "paragraph",
                   "--output", str(out), "--no-progress"])
    assert rc == 0
    tok_path = str(tmp_path / "o" / "tokenizer.json")
    assert os.path.isfile(tok_path)
    assert _decode_all(str(out), tok_path) == ["para one\nstill one\n", "para two\n", "gz doc\n"]
    out2 = tmp_path / "o" / "lines"
    assert cli.main([str(tmp_path / "a.txt"), "--tokenizer", tok_path, "--text-doc", "line", "--output", str(out2), "--no-progress"]) == 0
    assert _decode_all(str(out2), tok_path) == ["para one\n", "still one\n", "para two\n"]


def test_missing_input_is_usage_error(tmp_path, tiny_tokenizer):
    assert cli.main([str(tmp_path / "nope*.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(tmp_path / "x")]) == 2


def test_workers_give_identical_output(tmp_path, tiny_tokenizer):
    texts = [f"document {i}: " + " ".join(["alpha", "beta", "gamma"][i % 3] for _ in range(i % 17 + 1)) for i in range(400)]
    write_jsonl(tmp_path / "in.jsonl", texts, [b"{bad"])
    base = [str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--no-progress", "--batch-bytes", "2000"]
    assert cli.main(base + ["--output", str(tmp_path / "w1")]) == 0
    assert cli.main(base + ["--output", str(tmp_path / "w2"), "--workers", "2"]) == 0
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"w1{ext}").read_bytes() == (tmp_path / f"w2{ext}").read_bytes()
    assert json.loads((tmp_path / "w2.json").read_text())["bad_records"] == {"malformed JSON": 1}


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # exited and reaped: nothing runs under this pid now
    return proc.pid


def test_temporaries_of_a_dead_writer_are_removed_by_the_next_run(tmp_path, tiny_tokenizer, capsys):
    """A writer killed mid-way leaves PREFIX.tmp-<pid>@<host>-*: the next run on that prefix removes
    them when the pid is dead on this host; a live writer's and another host's stay."""
    import socket

    write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "ds"
    host = socket.gethostname()
    dead = [f"ds.tmp-{_dead_pid()}@{host}-0123abcd{ext}" for ext in (".bin", ".idx")]
    alive = f"ds.tmp-{os.getpid()}@{host}-4567cdef.bin"
    elsewhere = f"ds.tmp-{_dead_pid()}@not-{host}-89abcdef.bin"
    for name in (*dead, alive, elsewhere):
        (tmp_path / name).write_bytes(b"half a dataset")
    assert cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
                     "--no-progress"]) == 0
    left = sorted(p for p in os.listdir(tmp_path) if ".tmp-" in p)
    assert left == sorted([alive, elsewhere])
    assert f"removed {tmp_path / dead[0]}" in capsys.readouterr().err
    assert _decode_all(str(out), tiny_tokenizer) == TEXTS


def test_no_documents_says_every_record_was_dropped_as_invalid(tmp_path, tiny_tokenizer, capsys):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\nna\xefve\n\xff\xfe\n")
    rc = cli.main([str(tmp_path / "latin1.txt"), "--tokenizer", tiny_tokenizer, "--text-doc", "line",
                   "--output", str(tmp_path / "ds"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == ExitCode.BAD_INPUT
    assert "no documents in the input: all 3 records were dropped, 3 as invalid (3 invalid UTF-8)" in err
    assert "latin1.txt:1: invalid UTF-8 at byte 3" in err
    assert not IndexedDataset.exists(str(tmp_path / "ds")) and no_temporaries(tmp_path)


# ----------------------------------------------------------------------------------------------
# Parquet, Arrow (datasets.save_to_disk) and Hugging Face tokenizer directories


def _write_parquet(path, values, row_group_size=None, column="text", **extra):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({column: pa.array(values, pa.string()), **extra}), path,
                   row_group_size=row_group_size)


def _write_arrow_stream(path, values, batch_rows=7):
    """As datasets.Dataset.save_to_disk writes its data-*.arrow files: the IPC stream format."""
    import pyarrow as pa

    table = pa.table({"text": pa.array(values, pa.string()), "id": list(range(len(values)))})
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        for b in table.to_batches(max_chunksize=batch_rows):
            w.write_batch(b)


def _save_to_disk_dir(d, parts):
    """A directory shaped like datasets' save_to_disk: state.json listing data-*.arrow in order."""
    d.mkdir(parents=True)
    names = [f"data-{i:05d}-of-{len(parts):05d}.arrow" for i in range(len(parts))]
    for name, values in zip(names, parts):
        _write_arrow_stream(d / name, values)
    (d / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names],
                                              "_fingerprint": "x", "_split": "train"}))
    (d / "dataset_info.json").write_text("{}")


def _ids(prefix):
    ds = open_indexed(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))]


def test_parquet_and_saved_datasets_give_the_jsonl_tokens(tmp_path, tiny_tokenizer):
    texts = [f"{TEXTS[i % len(TEXTS)]} #{i}" for i in range(60)]
    write_jsonl(tmp_path / "in.jsonl", texts)
    _write_parquet(tmp_path / "in.parquet", texts, row_group_size=16)
    _save_to_disk_dir(tmp_path / "saved", [texts[:25], texts[25:]])
    run = ["--tokenizer", tiny_tokenizer, "--no-progress", "--batch-bytes", "300"]
    assert cli.main([str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "j"), *run]) == 0
    assert cli.main([str(tmp_path / "in.parquet"), "--output", str(tmp_path / "p"), *run]) == 0
    assert cli.main([str(tmp_path / "saved"), "--output", str(tmp_path / "a"), *run]) == 0
    for other in ("p", "a"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"j{ext}").read_bytes() == (tmp_path / f"{other}{ext}").read_bytes(), other
    meta = json.loads((tmp_path / "a.json").read_text())
    assert meta["inputs"] == [
        str(tmp_path / "saved" / f"data-0000{i}-of-00002.arrow") for i in range(2)]


def test_parquet_bad_values_are_counted_with_file_and_row(tmp_path, tiny_tokenizer, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # row 1 null, row 3 not UTF-8 (pyarrow writes a string column it never validated)
    raw = pa.array([b"good one", None, b"good two", b"caf\xe9", b"   "], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"body": raw}), tmp_path / "x.parquet")
    out = tmp_path / "ds"
    args = [str(tmp_path / "x.parquet"), "--text-column", "body", "--tokenizer", tiny_tokenizer, "--output",
            str(out), "--no-progress"]
    assert cli.main(args) == 0
    meta = json.loads((tmp_path / "ds.json").read_text())
    assert meta["documents"] == 2 and meta["empty_documents"] == 1
    assert meta["bad_records"] == {"field 'body' is null": 1, "invalid UTF-8": 1}
    assert meta["bad_examples"] == [f"{tmp_path / 'x.parquet'}:row 1: field 'body' is null",
                                    f"{tmp_path / 'x.parquet'}:row 3: invalid UTF-8 at byte 3"]
    assert cli.main(args + ["--strict", "--output", str(tmp_path / "strict")]) == ExitCode.BAD_INPUT
    assert f"{tmp_path / 'x.parquet'}:row 1: field 'body' is null (--strict)" in capsys.readouterr().err
    assert not IndexedDataset.exists(str(tmp_path / "strict")) and no_temporaries(tmp_path)


@pytest.mark.parametrize("column,message", [
    ("content", "has no column 'content' (columns: text, n): choose one with --text-column"),
    ("n", "column 'n' is int64, not a string column"),
])
def test_a_missing_or_non_string_text_column_is_refused_before_writing(tmp_path, tiny_tokenizer, capsys,
                                                                       column, message):
    _write_parquet(tmp_path / "x.parquet", ["a", "b"], n=[1, 2])
    rc = cli.main([str(tmp_path / "x.parquet"), "--text-column", column, "--tokenizer", tiny_tokenizer,
                   "--output", str(tmp_path / "o" / "ds"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {tmp_path / 'x.parquet'}" in err and message in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_a_saved_dataset_dict_names_its_splits(tmp_path, tiny_tokenizer, capsys):
    _save_to_disk_dir(tmp_path / "dd" / "train", [["a"]])
    _save_to_disk_dir(tmp_path / "dd" / "test", [["b"]])
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    rc = cli.main([str(tmp_path / "dd"), "--tokenizer", tiny_tokenizer, "--output", str(tmp_path / "ds")])
    assert rc == 2
    assert "is a saved DatasetDict with splits ['test', 'train']: give one split's directory" in capsys.readouterr().err


def test_parquet_streams_in_bounded_memory(tmp_path):
    """40 MB of text in 1 MB row groups: the reader holds about one row group, not the file."""
    import pyarrow as pa

    doc = "lorem ipsum dolor sit amet " * 40  # ~1 KB
    _write_parquet(tmp_path / "big.parquet", [f"{i} {doc}" for i in range(40_000)], row_group_size=1000)
    files, kinds = [str(tmp_path / "big.parquet")], ["parquet"]
    pieces = plan_pieces(files, kinds, "file", None)
    assert len(pieces[0].units) == 40
    peak, values = 0, 0
    for _, _, arr in iter_records(files, kinds, pieces, "file", "text", batch_bytes=1 << 20):
        values += len(arr)
        peak = max(peak, pa.total_allocated_bytes())
    assert values == 40_000
    assert peak < 12 << 20, f"{peak / 2**20:.1f} MiB allocated while streaming a 40 MB column"


def _hf_tokenizer_dir(d, config, post_bos=False):
    """A Hugging Face tokenizer directory: tokenizer.json (BPE with <s>, </s>) + tokenizer_config.json."""
    from tokenizers import processors

    from data.tokenizer import train_bpe_tokenizer

    d.mkdir(parents=True, exist_ok=True)
    tok = train_bpe_tokenizer(["alpha beta gamma delta"] * 20, 300)
    tok.add_special_tokens(["<s>", "</s>"])
    if post_bos:  # a post-processor that already puts BOS in front (as Llama's tokenizer.json does)
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


@pytest.mark.parametrize("post_bos", [False, True])
def test_hf_tokenizer_directory_frames_documents_with_its_bos_and_eos(tmp_path, post_bos):
    config = {"eos_token": {"content": "</s>", "special": True}, "bos_token": "<s>", "add_bos_token": True,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    tok = _hf_tokenizer_dir(tmp_path / "tok", config, post_bos)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    write_jsonl(tmp_path / "in.jsonl", ["alpha beta", "gamma"])
    assert cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--output",
                     str(tmp_path / "ds"), "--no-progress"]) == 0
    plain = [tok.encode(t, add_special_tokens=False).ids for t in ("alpha beta", "gamma")]
    assert _ids(tmp_path / "ds") == [[bos, *ids, eos] for ids in plain]  # one BOS, even when the post-processor adds it
    meta = json.loads((tmp_path / "ds.json").read_text())
    assert (meta["eod_id"], meta["eod_token"], meta["bos_id"]) == (eos, "</s>", bos)


def test_hf_tokenizer_directory_without_eos_is_refused(tmp_path, tiny_tokenizer, capsys):
    _hf_tokenizer_dir(tmp_path / "tok", {"bos_token": "<s>"})
    write_jsonl(tmp_path / "in.jsonl", ["alpha"])
    rc = cli.main([str(tmp_path / "in.jsonl"), "--tokenizer", str(tmp_path / "tok"), "--output", str(tmp_path / "ds")])
    assert rc == 2
    assert "tokenizer_config.json has no eos_token: it is needed to end every document" in capsys.readouterr().err
    assert not IndexedDataset.exists(str(tmp_path / "ds"))


def test_training_data_reads_an_hf_tokenizer_directory(tmp_path):
    """data.tokenizer may be the same directory: the run's end-of-document id is its eos_token."""
    from helpers import synthetic_config
    from data import build_data

    tok = _hf_tokenizer_dir(tmp_path / "tok", {"eos_token": "</s>"})
    cfg = synthetic_config(str(tmp_path / "d"), str(tmp_path / "tok"))
    bundle = build_data(cfg, seq_length=16, micro_batch_size=2, global_batch_size=4, total_tokens=4096,
                        seed=1, show_progress=False)
    assert bundle.eod_id == tok.token_to_id("</s>") and bundle.vocab_size == tok.get_vocab_size()
