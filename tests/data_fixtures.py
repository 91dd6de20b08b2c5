"""Shared fixtures and helpers for tests/test_data_*.py (import them into the test module).

The demo corpus is built once per test session (module-level cache: pytest would otherwise run a
session fixture once per importing module) in a temporary cache dir.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np
import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes" / "data"

_CACHE: Dict[str, object] = {}

# synthetic sources: source j writes token ids in [BAND*j + 1, BAND*(j+1)], EOD = 0
BAND = 60


@pytest.fixture(scope="session")
def demo_corpus(tmp_path_factory):
    """(cache_dir, DemoCorpus) of the default demo corpus, built once per session."""
    if "demo" not in _CACHE:
        from data.demo import ensure_demo_corpus

        cache = str(tmp_path_factory.mktemp("data-cache"))
        _CACHE["demo"] = (cache, ensure_demo_corpus(cache))
    return _CACHE["demo"]


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> str:
    """Path of a small (300-token) byte-level BPE tokenizer.json."""
    if "tok" not in _CACHE:
        from data.tokenizer import train_bpe_tokenizer

        d = tmp_path_factory.mktemp("tok")
        words = ["alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"] * 50
        tok = train_bpe_tokenizer(words, 300)
        path = str(d / "tokenizer.json")
        tok.save(path)
        _CACHE["tok"] = path
    return _CACHE["tok"]


def demo_config(cache_dir: str, **overrides):
    """recipes/data/demo.yaml as a DataConfig with ``cache_dir`` set."""
    from omegaconf import OmegaConf

    from data.config import to_data_config

    cfg = OmegaConf.load(RECIPES / "demo.yaml")
    cfg.cache_dir = cache_dir
    for k, v in overrides.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return to_data_config(cfg)


def write_source(prefix: str, index: int, num_docs: int, seed: int = 0, min_len: int = 5, max_len: int = 40) -> None:
    """An indexed dataset whose tokens all lie in source ``index``'s band (plus EOD 0 at doc ends)."""
    from data.indexed import mcore

    rng = np.random.default_rng(seed + 1000 * index)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    b = mcore().IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        n = int(rng.integers(min_len, max_len))
        ids = np.concatenate([rng.integers(BAND * index + 1, BAND * (index + 1) + 1, n - 1), [0]]).astype(np.uint16)
        b.add_document(ids, [len(ids)])
    b.finalize(prefix + ".idx")


def source_of_tokens(tokens) -> int:
    """Which synthetic source a sample's tokens came from."""
    t = np.asarray(tokens)
    t = t[t > 0]
    bands = np.unique((t - 1) // BAND)
    assert len(bands) == 1, f"sample mixes sources {bands}"
    return int(bands[0])


def synthetic_config(
    root: str,
    tokenizer: str,
    docs: Sequence[int] = (200, 120, 60),
    phases: Optional[List[dict]] = None,
    total_tokens: Optional[int] = None,
    val_docs: int = 30,
):
    """A DataConfig over synthetic sources c0, c1, ... (one prefix each) + one validation prefix."""
    from data.config import CategoryConfig, DataConfig, PhaseConfig

    cats = {}
    for j, n in enumerate(docs):
        prefix = os.path.join(root, f"c{j}")
        if not os.path.exists(prefix + ".idx"):
            write_source(prefix, j, n)
        cats[f"c{j}"] = CategoryConfig(prefixes=[prefix])
    val = os.path.join(root, "val")
    if not os.path.exists(val + ".idx"):
        write_source(val, 0, val_docs, seed=99)
    if phases is None:
        phases = [
            dict(name="a", end_fraction=0.5, weights={"c0": 0.5, "c1": 0.3, "c2": 0.2}),
            dict(name="b", end_fraction=0.8, weights={"c0": 0.2, "c1": 0.5, "c2": 0.3}),
            dict(name="c", end_fraction=1.0, weights={"c1": 0.25, "c2": 0.75}),
        ]
    return DataConfig(
        name="synthetic", cache_dir=os.path.join(root, "cache"), tokenizer=tokenizer, categories=cats,
        validation={"v": [val]}, phases=[PhaseConfig(**p) for p in phases], total_tokens=total_tokens,
    )
