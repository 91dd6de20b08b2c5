"""The streaming blend: proportions, phase switches, resume, DP slicing, epochs, validation."""

import io
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from data import build_data

from helpers import demo_config, source_of_tokens, synthetic_config

SEQ = 16


def _bundle(cfg, total_tokens=SEQ * 960, mbs=2, gbs=8, seed=1, dp_rank=0, dp_size=1):
    return build_data(cfg, seq_length=SEQ, micro_batch_size=mbs, global_batch_size=gbs, total_tokens=total_tokens,
                      seed=seed, dp_rank=dp_rank, dp_size=dp_size, show_progress=False)


@pytest.fixture
def syn(tmp_path, tiny_tokenizer):
    return synthetic_config(str(tmp_path), tiny_tokenizer)


def _run(bundle, steps):
    """All samples of `steps` global batches, in global order (tokens tensor per sample)."""
    out = []
    for _ in range(steps):
        for mb in bundle.train.next_global_batch():
            out.extend(mb["tokens"])
    return out


def test_batch_shapes_and_labels(syn):
    b = _bundle(syn)
    mbs = b.train.next_global_batch()
    assert len(mbs) == 8 // 2
    for mb in mbs:
        assert mb["tokens"].shape == mb["labels"].shape == mb["loss_mask"].shape == (2, SEQ)
        assert mb["tokens"].dtype == torch.long and mb["labels"].dtype == torch.long
        assert mb["loss_mask"].dtype == torch.float32
        assert torch.equal(mb["tokens"][:, 1:], mb["labels"][:, :-1])  # labels are next tokens


def test_proportions_within_bound_and_phase_switch(syn):
    total = SEQ * 960 + 5
    b = _bundle(syn, total_tokens=total)
    sch = b.train.schedule
    # phase ends: floor(0.5*15365)=7682 -> ceil(/16)=481 ; floor(0.8*15365)=12292 -> 769
    assert [(p.start, p.end) for p in sch.phases] == [(0, 481), (481, 769), (769, 961)]
    n_batches = 124  # 992 samples: past the end of the schedule, into the "extended" last phase
    samples = _run(b, n_batches)
    srcs = [source_of_tokens(t) for t in samples]
    for p, ph in enumerate(sch.phases):
        w = sch.realized_weights(p)
        assert w == [Fraction(w_) for w_ in w]
        counts = np.zeros(3, dtype=int)
        end = ph.end if p < 2 else len(srcs)
        for n, i in enumerate(range(ph.start, end), 1):
            counts[srcs[i]] += 1
            for s in range(3):
                assert math.floor(w[s] * n) <= counts[s] <= math.ceil(w[s] * n), (p, n, s)
    # the configured weights are realized exactly (decimal weights -> exact rationals)
    assert sch.realized_weights(0) == [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]
    assert sch.realized_weights(2) == [0, Fraction(1, 4), Fraction(3, 4)]
    assert 0 not in srcs[769:]  # c0 has no weight in the last phase
    # the phase metric flips on exactly the batch holding sample 481
    b2 = _bundle(syn, total_tokens=total)
    phases = []
    for _ in range(70):
        b2.train.next_global_batch()
        phases.append(b2.train.metrics()["data/phase"])
    assert phases[59] == 0 and phases[60] == 1  # batch 60 = samples 480..487 ends in phase 1
    assert sch.phase_of(480) == 0 and sch.phase_of(481) == 1


def test_counts_reproducible_and_metrics_global(syn):
    a, b = _bundle(syn, seed=5), _bundle(syn, seed=5)
    ta, tb = _run(a, 30), _run(b, 30)
    assert all(torch.equal(x, y) for x, y in zip(ta, tb))
    c = _bundle(syn, seed=6)
    tc = _run(c, 30)
    assert [source_of_tokens(t) for t in tc] == [source_of_tokens(t) for t in ta]  # same blend
    assert not all(torch.equal(x, y) for x, y in zip(ta, tc))  # different shuffles
    m = a.train.metrics()
    srcs = [source_of_tokens(t) for t in ta]
    for j in range(3):
        assert m[f"data/tokens/c{j}"] == srcs.count(j) * SEQ
    assert sum(m[f"data/tokens/c{j}"] for j in range(3)) == 30 * 8 * SEQ


def test_resume_mid_phase_continues_identically(syn):
    a = _bundle(syn)
    _run(a, 7)
    buf = io.BytesIO()
    torch.save({"data": a.train.state_dict()}, buf)  # as in a checkpoint
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["data"]
    assert state["sample_index"] == 56 and a.train.phase == 0
    expected = _run(a, 40)  # crosses into phase 1 and 2
    b = _bundle(syn)
    b.train.load_state_dict(state)
    got = _run(b, 40)
    assert len(got) == len(expected) and all(torch.equal(x, y) for x, y in zip(got, expected))
    assert b.train.state_dict() == a.train.state_dict()


def test_dp_ranks_partition_the_dp1_sequence(syn):
    one = _bundle(syn, mbs=2, gbs=8)
    r0 = _bundle(syn, mbs=2, gbs=8, dp_rank=0, dp_size=2)
    r1 = _bundle(syn, mbs=2, gbs=8, dp_rank=1, dp_size=2)
    for _ in range(25):
        full = torch.cat([mb["tokens"] for mb in one.train.next_global_batch()])
        m0, m1 = r0.train.next_global_batch(), r1.train.next_global_batch()
        assert len(m0) == len(m1) == 2
        inter = torch.cat([t for j in range(2) for t in (m0[j]["tokens"], m1[j]["tokens"])])
        assert torch.equal(inter, full)
    assert r0.train.metrics() == r1.train.metrics() == one.train.metrics()  # global metrics


def test_epochs_reshuffle_and_memory_stays_per_source(tmp_path, tiny_tokenizer):
    from collections import Counter

    from data.indexed import open_indexed

    cfg = synthetic_config(str(tmp_path), tiny_tokenizer, docs=(8, 40, 40),
                           phases=[dict(name="only", end_fraction=1.0, weights={"c0": 0.5, "c1": 0.5})])
    b = _bundle(cfg)
    n = b.train.sources[0].samples_per_epoch
    assert 0 < n < 20
    idx = [i for i in range(2 * 3 * n + 10) if b.train.source_of(i) == 0][: 3 * n]
    epochs = [[b.train.sample(i)["tokens"].tolist() for i in idx[e * n:(e + 1) * n]] for e in range(3)]
    ds = open_indexed(b.train.sources[0].prefix)
    have = Counter(x for d in range(len(ds)) for x in ds[d].tolist())
    for ep in epochs:  # each epoch is one pass: no token used more often than the source holds it
        used = Counter(x for t in ep for x in t)
        assert sum(used.values()) == n * SEQ and all(used[k] <= have[k] for k in used)
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert len(b.train._epoch_datasets) <= 2  # one live epoch per source, never the whole run
    b.train.sample_index = 2 * 3 * n
    assert b.train.state_dict()["source_epochs"][0] == 3 and b.train.metrics()["data/epochs/c0"] == 3.0


def test_schedule_change_on_resume_keeps_source_positions(tmp_path, tiny_tokenizer):
    cfg = synthetic_config(str(tmp_path), tiny_tokenizer)
    a = _bundle(cfg)
    _run(a, 10)
    state = a.train.state_dict()
    cfg.phases[0].weights = {"c0": 0.1, "c1": 0.1, "c2": 0.8}
    b = _bundle(cfg)
    b.train.load_state_dict(state)
    assert b.train.state_dict()["source_counts"] == state["source_counts"]


def test_validation_batches_deterministic_and_dp_sharded(syn):
    one = _bundle(syn, mbs=2, gbs=8)
    v1 = one.validation_batches(3)
    assert len(v1) == 3 and all(mb["tokens"].shape == (2, SEQ) for mb in v1)
    again = one.validation_batches(3)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(v1, again))
    one.train.next_global_batch()  # training does not move validation
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(v1, one.validation_batches(3)))
    r0 = _bundle(syn, mbs=2, gbs=8, dp_rank=0, dp_size=2).validation_batches(3)
    r1 = _bundle(syn, mbs=2, gbs=8, dp_rank=1, dp_size=2).validation_batches(3)
    full = torch.cat([mb["tokens"] for mb in _bundle(syn, mbs=4, gbs=8).validation_batches(3)])
    assert torch.equal(torch.cat([t for j in range(3) for t in (r0[j]["tokens"], r1[j]["tokens"])]), full)


def test_describe_schedule_renders(syn):
    from rich.console import Console

    b = _bundle(syn)
    con = Console(record=True, width=120)
    con.print(b.train.describe_schedule())
    text = con.export_text()
    for word in ("a", "b", "c", "c0", "c1", "c2", "50.0%", "75.0%", "epochs"):
        assert word in text


def test_demo_end_to_end(demo_corpus):
    cache, _ = demo_corpus
    b = build_data(demo_config(cache), seq_length=64, micro_batch_size=2, global_batch_size=8,
                   total_tokens=200 * 8 * 64, seed=0, dp_rank=0, dp_size=1, show_progress=False)
    assert b.vocab_size == 4096 and b.tokenizer.token_to_id("<|endoftext|>") == b.eod_id == 0
    mbs = b.train.next_global_batch()
    assert len(mbs) == 4 and int(mbs[0]["tokens"].max()) < b.vocab_size
    text = b.tokenizer.decode(mbs[0]["tokens"][0].tolist())
    assert len(text) > 20
    m = b.train.metrics()
    assert set(m) >= {"data/phase", "data/tokens/prose", "data/tokens/code", "data/tokens/math"}
    assert len(b.validation_batches(2)) == 2


def test_missing_data_error_from_build(tmp_path, tiny_tokenizer):
    from data import MissingDataError

    cfg = synthetic_config(str(tmp_path), tiny_tokenizer)
    cfg.categories["c1"].prefixes = [str(tmp_path / "nowhere")]
    with pytest.raises(MissingDataError, match=r"data\.categories\.c1\.prefixes\[0\].*nowhere\.bin.*data\.prepare"):
        _bundle(cfg)


def test_dataset_from_another_tokenizer_is_refused(tmp_path, tiny_tokenizer):
    import json

    from data import DataConfigError

    cfg = synthetic_config(str(tmp_path), tiny_tokenizer)
    (tmp_path / "c2.json").write_text(json.dumps({"tokenizer": "/old/tokenizer.json", "tokenizer_sha256": "0" * 64}))
    with pytest.raises(DataConfigError, match=r"data\.categories\.c2\.prefixes\[0\].*different tokenizer"):
        _bundle(cfg)


def test_non_zero_rank_waits_for_rank_zero(demo_corpus):
    """Rank != 0 enters the barrier before touching the demo cache; rank 0 after preparing it."""
    import data.build as build  # where build_data looks ensure_demo_corpus up

    cache, _ = demo_corpus
    events = []
    real = build.ensure_demo_corpus

    def ensure(*a, **k):
        events.append("ensure")
        return real(*a, **k)

    import unittest.mock as um

    with um.patch.object(build, "ensure_demo_corpus", ensure):
        for rank in (0, 1):
            events.append(f"rank{rank}")
            build_data(demo_config(cache), seq_length=64, micro_batch_size=2, global_batch_size=8,
                       total_tokens=8 * 64 * 10, seed=0, dp_rank=rank, dp_size=2, show_progress=False,
                       barrier=lambda: events.append("barrier"))
    assert events == ["rank0", "ensure", "barrier", "rank1", "barrier", "ensure"]
