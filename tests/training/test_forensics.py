"""training/forensics.py without a model: the bisect's search, the anomaly trigger, and the
config comparison a replay refuses on. (The replay of real steps: tests/system/test_replay.py.)"""

from __future__ import annotations

import itertools
import math

import pytest

from training.forensics import AnomalyWatch, config_differences, minimal_set

ITEMS = [(f"layers.{i}.mlp.linear_fc1", p) for i in range(9) for p in ("fprop", "dgrad", "wgrad")]


def counting(culprits: set, needs_all: bool = True):
    """A predicate that is anomalous when the kept set holds every culprit (needs_all: an
    interaction) or any of them; counts its calls."""
    calls = []

    def anomalous(kept):
        calls.append(list(kept))
        present = culprits & set(kept)
        return present == culprits if needs_all else bool(present)

    return anomalous, calls


@pytest.mark.parametrize("culprit", [ITEMS[0], ITEMS[13], ITEMS[-1]])
def test_one_culprit_is_found_in_logarithmic_trials(culprit):
    anomalous, calls = counting({culprit})
    assert minimal_set(ITEMS, anomalous) == [culprit]
    # binary splitting: at most 2 tests per halving of 27 items (5 halvings)
    assert len(calls) <= 2 * math.ceil(math.log2(len(ITEMS)))


def test_an_interaction_of_two_culprits_is_found_whole():
    """Neither culprit alone explains the anomaly: both are returned, and nothing else."""
    pair = {ITEMS[2], ITEMS[20]}
    anomalous, calls = counting(pair)
    found = minimal_set(ITEMS, anomalous)
    assert set(found) == pair
    assert len(calls) <= 4 * math.ceil(math.log2(len(ITEMS)))
    # minimal: dropping either member no longer reproduces it
    assert not any(anomalous([i for i in found if i != drop]) for drop in found)


def test_any_of_several_culprits_returns_one():
    anomalous, _ = counting({ITEMS[4], ITEMS[22]}, needs_all=False)
    found = minimal_set(ITEMS, anomalous)
    assert len(found) == 1 and found[0] in (ITEMS[4], ITEMS[22])


def test_every_pair_is_found_exactly():
    """The search is exact for every interaction of two among 8 items (no pair missed)."""
    items = ITEMS[:8]
    for pair in itertools.combinations(items, 2):
        anomalous, _ = counting(set(pair))
        assert set(minimal_set(items, anomalous)) == set(pair), pair


def test_zscore_trigger_waits_for_its_window_and_fires_on_a_spike():
    watch = AnomalyWatch(window=4, zscore=6.0)
    norms = [1.0, 1.1, 0.9, 1.05]
    assert [watch.check(2.0, n) for n in norms] == [None] * 4  # filling the window
    assert watch.check(2.0, 1.08) is None  # z = 0.4
    why = watch.check(2.0, 3.0)  # mean ~1.03, std ~0.085 over the last four: z ~ 23
    assert why is not None and "z-score" in why
    assert watch.check(2.0, float("nan")).startswith("non-finite")
    assert watch.check(float("inf"), 1.0).startswith("non-finite")


def test_zscore_window_survives_a_checkpoint():
    """Restored from trainer.pt's state, the watch triggers where one never stopped would."""
    a, b = AnomalyWatch(3, 4.0), AnomalyWatch(3, 4.0)
    for n in (1.0, 1.2, 0.8, 1.1):
        a.check(1.0, n)
    b.load_state_dict(a.state_dict())
    assert b.norms == a.norms == [1.2, 0.8, 1.1]
    assert (a.check(1.0, 5.0) is None) == (b.check(1.0, 5.0) is None) is False
    AnomalyWatch(3, 4.0).load_state_dict(None)  # a checkpoint written before the watch


def test_config_differences_name_the_keys_that_compute_differently():
    before = {"run": {"dir": "/a", "name": "x"}, "trainer": {"lr": 0.003, "log_every": 1,
                                                             "max_steps": 4},
              "precision": {"name": "nvfp4", "overrides": {"layers.2.*": "bf16"}},
              "data": {"cache_dir": "/c1"}, "logger": {"mode": "offline"}}
    after = {"run": {"dir": "/b", "name": "y"}, "trainer": {"lr": 0.001, "log_every": 5,
                                                            "max_steps": 4},
             "precision": {"name": "nvfp4", "overrides": {}},
             "data": {"cache_dir": "/c2"}, "logger": {"mode": "disabled"}}
    lines = config_differences(before, after)
    assert lines == ["precision.overrides.layers.2.*: 'bf16' -> '<absent>'",
                     "trainer.lr: 0.003 -> 0.001"]
    assert config_differences(before, before) == []
