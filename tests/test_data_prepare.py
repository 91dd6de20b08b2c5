"""python -m data.prepare: round trip, bad input, --strict, interruption, refuse-overwrite, workers."""

import gzip
import json
import os

import pytest

import data.prepare as prep
from data.indexed import dataset_exists, open_indexed

try:
    from tests.data_fixtures import tiny_tokenizer  # noqa: F401
except ImportError:
    from data_fixtures import tiny_tokenizer  # noqa: F401

TEXTS = [
    "Hello world.\nA second line.",
    "Ünïcödé — 中文 — emoji 🙂 and tabs\tand  double  spaces",
    "def f(x):\n    return x * 2\n",
    "  leading and trailing whitespace  \n\n",
]


def _jsonl(path, texts, extra_lines=()):
    with open(path, "wb") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 1}).encode() + b"\n")
        for line in extra_lines:
            f.write(line + b"\n")


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


def _no_tmp(d):
    return not [p for p in os.listdir(d) if ".tmp-" in p]


def test_round_trip_jsonl(tmp_path, tiny_tokenizer):
    _jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "out" / "ds"
    assert prep.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--no-progress"]) == 0
    assert _decode_all(str(out), tiny_tokenizer) == TEXTS
    meta = json.loads((tmp_path / "out" / "ds.json").read_text())
    assert meta["documents"] == len(TEXTS) and meta["bad_records"] == {}
    assert _no_tmp(tmp_path / "out")


def test_bad_lines_counted_and_reported(tmp_path, tiny_tokenizer, capsys):
    bad = [b"{not json", json.dumps({"body": "x"}).encode(), json.dumps({"text": 3}).encode(), b'{"text": "bad \xff"}']
    _jsonl(tmp_path / "in.jsonl", TEXTS[:2], bad)
    out = tmp_path / "ds"
    assert prep.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--no-progress"]) == 0
    meta = json.loads((tmp_path / "ds.json").read_text())
    assert meta["documents"] == 2
    assert sum(meta["bad_records"].values()) == 4
    assert set(meta["bad_records"]) == {"malformed JSON", "missing field 'text'", "field 'text' is int, not a string", "invalid UTF-8"}
    report = capsys.readouterr().out
    assert "bad records skipped" in report and "in.jsonl:3" in report


def test_strict_fails_naming_file_and_line(tmp_path, tiny_tokenizer, capsys):
    _jsonl(tmp_path / "in.jsonl", TEXTS, [b"{oops"])
    out = tmp_path / "ds"
    rc = prep.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--strict", "--no-progress"])
    assert rc == 1
    assert f"{tmp_path / 'in.jsonl'}:5: malformed JSON" in capsys.readouterr().err.replace("\n", "")
    assert not os.path.exists(str(out) + ".bin") and not os.path.exists(str(out) + ".idx")
    assert _no_tmp(tmp_path)


def test_interrupted_run_leaves_no_dataset(tmp_path, tiny_tokenizer, monkeypatch):
    _jsonl(tmp_path / "in.jsonl", TEXTS * 50)
    real, calls = prep.encode_batch, []

    def dying(batch):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt  # as if ^C arrived mid-run
        return real(batch)

    monkeypatch.setattr(prep, "encode_batch", dying)
    out = tmp_path / "ds"
    rc = prep.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
                    "--batch-bytes", "200", "--no-progress"])
    assert rc == 130 and len(calls) == 2
    assert not dataset_exists(str(out)) and _no_tmp(tmp_path)


def test_crash_between_renames_does_not_look_complete(tmp_path, tiny_tokenizer, monkeypatch):
    """Even a crash inside commit (after .bin is in place) leaves no .idx: not a dataset."""
    _jsonl(tmp_path / "in.jsonl", TEXTS)
    real_replace = os.replace

    def replace(src, dst):
        if str(dst).endswith(".idx"):
            raise OSError("disk vanished")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    out = tmp_path / "ds"
    with pytest.raises(OSError):
        prep.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out), "--no-progress"])
    assert not dataset_exists(str(out))


def test_refuses_overwrite_unless_asked(tmp_path, tiny_tokenizer, capsys):
    _jsonl(tmp_path / "in.jsonl", TEXTS)
    out = str(tmp_path / "ds")
    args = [str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", out, "--no-progress"]
    assert prep.main(args) == 0
    before = open(out + ".bin", "rb").read()
    _jsonl(tmp_path / "in.jsonl", TEXTS[:1])
    assert prep.main(args) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert open(out + ".bin", "rb").read() == before
    assert prep.main(args + ["--overwrite"]) == 0
    assert _decode_all(out, tiny_tokenizer) == TEXTS[:1]


def test_text_modes_gzip_and_train_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\npara two\n", encoding="utf-8")
    with gzip.open(tmp_path / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("gz doc\n")
    out = tmp_path / "o" / "ds"
    rc = prep.main([str(tmp_path / "*.txt*"), "--train-tokenizer", "300", "--text-doc", "paragraph",
                    "--output", str(out), "--no-progress"])
    assert rc == 0
    tok_path = str(tmp_path / "o" / "tokenizer.json")
    assert os.path.isfile(tok_path)
    assert _decode_all(str(out), tok_path) == ["para one\nstill one\n", "para two\n", "gz doc\n"]
    out2 = tmp_path / "o" / "lines"
    assert prep.main([str(tmp_path / "a.txt"), "--tokenizer", tok_path, "--text-doc", "line", "--output", str(out2), "--no-progress"]) == 0
    assert _decode_all(str(out2), tok_path) == ["para one\n", "still one\n", "para two\n"]


def test_missing_input_is_usage_error(tmp_path, tiny_tokenizer):
    assert prep.main([str(tmp_path / "nope*.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(tmp_path / "x")]) == 2


def test_workers_give_identical_output(tmp_path, tiny_tokenizer):
    texts = [f"document {i}: " + " ".join(["alpha", "beta", "gamma"][i % 3] for _ in range(i % 17 + 1)) for i in range(400)]
    _jsonl(tmp_path / "in.jsonl", texts, [b"{bad"])
    base = [str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--no-progress", "--batch-bytes", "2000"]
    assert prep.main(base + ["--output", str(tmp_path / "w1")]) == 0
    assert prep.main(base + ["--output", str(tmp_path / "w2"), "--workers", "2"]) == 0
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

    _jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "ds"
    host = socket.gethostname()
    dead = [f"ds.tmp-{_dead_pid()}@{host}-0123abcd{ext}" for ext in (".bin", ".idx")]
    alive = f"ds.tmp-{os.getpid()}@{host}-4567cdef.bin"
    elsewhere = f"ds.tmp-{_dead_pid()}@not-{host}-89abcdef.bin"
    for name in (*dead, alive, elsewhere):
        (tmp_path / name).write_bytes(b"half a dataset")
    assert prep.main([str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
                      "--no-progress"]) == 0
    left = sorted(p for p in os.listdir(tmp_path) if ".tmp-" in p)
    assert left == sorted([alive, elsewhere])
    assert f"removed {tmp_path / dead[0]}" in capsys.readouterr().err
    assert _decode_all(str(out), tiny_tokenizer) == TEXTS


@pytest.mark.slow
def test_sigkill_mid_way_then_a_rerun_leaves_no_temporaries(tmp_path, tiny_tokenizer):
    import signal
    import subprocess
    import sys
    import time

    texts = [f"document {i}: " + "lorem ipsum dolor sit amet " * (i % 40 + 1) for i in range(60000)]
    _jsonl(tmp_path / "in.jsonl", texts)
    out = tmp_path / "ds"
    args = [str(tmp_path / "in.jsonl"), "--tokenizer", tiny_tokenizer, "--output", str(out),
            "--no-progress", "--batch-bytes", "20000"]
    proc = subprocess.Popen([sys.executable, "-m", "data.prepare", *args],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = time.time() + 120
    while not [p for p in os.listdir(tmp_path) if ".tmp-" in p]:
        assert proc.poll() is None and time.time() < deadline, "no temporary appeared"
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not _no_tmp(tmp_path) and not dataset_exists(str(out))  # what the kill left
    assert prep.main(args) == 0
    assert _no_tmp(tmp_path) and dataset_exists(str(out))


def test_no_documents_says_every_record_was_dropped_as_invalid(tmp_path, tiny_tokenizer, capsys):
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\nna\xefve\n\xff\xfe\n")
    rc = prep.main([str(tmp_path / "latin1.txt"), "--tokenizer", tiny_tokenizer, "--text-doc", "line",
                    "--output", str(tmp_path / "ds"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "no documents in the input: all 3 records were dropped, 3 as invalid (3 invalid UTF-8)" in err
    assert "latin1.txt:1: invalid UTF-8 at byte 3" in err
    assert not dataset_exists(str(tmp_path / "ds")) and _no_tmp(tmp_path)
