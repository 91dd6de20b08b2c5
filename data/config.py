"""Typed data configuration (Hydra structured-config schema for the ``data`` group).

Only dataclass / list / dict / primitive / Optional fields, so OmegaConf can use these classes as
the schema of the ``data`` node. Dict and list fields default to empty on purpose: OmegaConf
*merges* dicts, so a non-empty default (say, the demo categories) would leak into every recipe.

Prefix syntax: a prefix is the path of a megatron-core indexed dataset without ``.bin``/``.idx``.
``demo:<name>`` names a dataset of the embedded demo corpus (``prose``, ``code``, ``math`` and the
held-out ``prose_val``, ``code_val``, ``math_val``); it is built on first use under ``cache_dir``.
A prefix with glob characters (``/data/web/web_shard*``, the shards of ``data.prepare --shard``)
stands for every dataset it matches, in natural order (``shard2`` before ``shard10``); at start-up
every match must have its ``.bin``, ``.idx`` and sidecar ``.json``, and no shard of a split may be
missing. Matches that hold no document (an empty shard) are left out.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from errors import ConfigError, ExitCode

DEMO_PREFIX = "demo:"
DEMO_CATEGORIES = ("prose", "code", "math")
DEMO_DATASETS = DEMO_CATEGORIES + tuple(f"{c}_val" for c in DEMO_CATEGORIES)


class DataConfigError(ConfigError):
    """A data config that cannot work; the message names the key and how to fix it (exit 2)."""


class MissingDataError(DataConfigError):
    """A configured dataset prefix (or tokenizer) is not on disk (exit 3)."""

    code = ExitCode.MISSING


@dataclass
class CategoryConfig:
    """One data category (e.g. ``code``): one or more indexed-dataset prefixes (or globs).

    ``weights``: relative weights of the prefixes inside the category; ``None`` = in proportion to
    their token counts (megatron-core's convention for an unweighted blend). A glob's weight is
    shared among its matches in proportion to their token counts.
    """

    prefixes: List[str] = field(default_factory=list)
    weights: Optional[List[float]] = None


@dataclass
class PhaseConfig:
    """A phase runs until ``end_fraction`` of the run's tokens; ``weights`` maps category -> weight
    (relative; normalised within the phase). Leave a category out to give it no samples."""

    name: str = "phase"
    end_fraction: float = 1.0
    weights: Dict[str, float] = field(default_factory=dict)


@dataclass
class DemoConfig:
    """Settings of the embedded demo corpus (only used by ``demo:`` prefixes / ``tokenizer: null``)."""

    vocab_size: int = 4096
    code_max_bytes: int = 2_000_000  # cap on standard-library code; keeps preparation < ~15 s
    math_documents: int = 1500  # generated arithmetic worksheets
    seed: int = 1234  # seed of the arithmetic generator
    val_fraction: float = 0.03  # the last documents holding ~3% of each category's bytes are held out


@dataclass
class DataConfig:
    name: str = "custom"
    # Demo corpus and megatron-core index caches live here (relative paths: to the working dir).
    cache_dir: str = "${oc.env:NVFP4_CACHE,.cache}/data"
    # A HF tokenizers ``tokenizer.json``, or a Hugging Face tokenizer directory (tokenizer.json +
    # tokenizer_config.json: its eos/bos tokens); None = the demo corpus tokenizer.
    tokenizer: Optional[str] = None
    categories: Dict[str, CategoryConfig] = field(default_factory=dict)
    # Held-out sets: group name -> prefixes. Blended in proportion to their sizes.
    validation: Dict[str, List[str]] = field(default_factory=dict)
    phases: List[PhaseConfig] = field(default_factory=list)
    # Tokens the phase fractions refer to; None = the trainer's max_steps * global_batch * seq.
    total_tokens: Optional[int] = None
    demo: DemoConfig = field(default_factory=DemoConfig)


# ----------------------------------------------------------------------------------------------
# conversion


def to_data_config(cfg: Any) -> DataConfig:
    """DataConfig | DictConfig | dict -> a resolved DataConfig instance (interpolations resolved,
    unknown keys rejected by OmegaConf's struct mode)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        schema = OmegaConf.structured(DataConfig)
        if isinstance(cfg, DataConfig):
            merged = OmegaConf.structured(cfg)
        else:
            merged = OmegaConf.merge(schema, cfg)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise DataConfigError(f"data config does not match the DataConfig schema: {err}") from err
    assert isinstance(obj, DataConfig)
    return obj


# ----------------------------------------------------------------------------------------------
# validation


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def validate_config(cfg: DataConfig, check_files: bool = False, demo_dir: Optional[str] = None) -> None:
    """Raise DataConfigError naming the first bad key. ``check_files``: also require every
    non-demo prefix (and the tokenizer) on disk; demo prefixes are checked when ``demo_dir`` is
    given."""
    if check_files:  # first: a missing tokenizer is the problem, not what disagrees with it
        _check_tokenizer_exists(cfg)
    if not cfg.categories:
        raise DataConfigError(
            "data.categories is empty: define at least one category with prefixes, "
            "or use a recipe (data=demo)"
        )
    for cat, cc in cfg.categories.items():
        key = f"data.categories.{cat}"
        if not cc.prefixes:
            raise DataConfigError(f"{key}.prefixes is empty: list at least one dataset prefix")
        for j, p in enumerate(cc.prefixes):
            _check_prefix_syntax(f"{key}.prefixes[{j}]", p, cfg)
        if cc.weights is not None:
            if len(cc.weights) != len(cc.prefixes):
                raise DataConfigError(
                    f"{key}.weights has {len(cc.weights)} entries but {key}.prefixes has "
                    f"{len(cc.prefixes)}: give one weight per prefix, or null for size-proportional"
                )
            for j, w in enumerate(cc.weights):
                if not _positive(w):
                    raise DataConfigError(
                        f"{key}.weights[{j}] = {w!r}: weights must be positive finite numbers "
                        f"(remove the prefix instead of giving it weight 0)"
                    )
    if not cfg.phases:
        raise DataConfigError("data.phases is empty: define at least one phase ending at end_fraction 1.0")
    prev = 0.0
    names = set()
    for i, ph in enumerate(cfg.phases):
        key = f"data.phases[{i}] ({ph.name!r})"
        if ph.name in names:
            raise DataConfigError(f"{key}: duplicate phase name {ph.name!r}; phase names must be unique")
        names.add(ph.name)
        ef = ph.end_fraction
        if not isinstance(ef, (int, float)) or not math.isfinite(ef) or not (0.0 < ef <= 1.0):
            raise DataConfigError(f"{key}.end_fraction = {ef!r}: must be in (0, 1]")
        if ef <= prev:
            raise DataConfigError(
                f"{key}.end_fraction = {ef} is not greater than the previous phase's {prev}: "
                f"end fractions must be strictly increasing"
            )
        prev = ef
        if not ph.weights:
            raise DataConfigError(f"{key}.weights is empty: give at least one category a weight")
        for cat, w in ph.weights.items():
            if cat not in cfg.categories:
                raise DataConfigError(
                    f"{key}.weights: unknown category {cat!r}; defined categories are "
                    f"{sorted(cfg.categories)} (add it under data.categories or remove it)"
                )
            if not _positive(w):
                raise DataConfigError(
                    f"{key}.weights.{cat} = {w!r}: weights must be positive finite numbers "
                    f"(leave the category out of the phase to give it no samples)"
                )
    if abs(cfg.phases[-1].end_fraction - 1.0) > 1e-12:
        raise DataConfigError(
            f"data.phases[{len(cfg.phases) - 1}] ({cfg.phases[-1].name!r}).end_fraction = "
            f"{cfg.phases[-1].end_fraction}: the last phase must end at 1.0"
        )
    if cfg.total_tokens is not None and (not isinstance(cfg.total_tokens, int) or cfg.total_tokens <= 0):
        raise DataConfigError(f"data.total_tokens = {cfg.total_tokens!r}: must be a positive integer or null")
    for group, prefixes in cfg.validation.items():
        if not prefixes:
            raise DataConfigError(f"data.validation.{group} is empty: list prefixes or remove the group")
        for j, p in enumerate(prefixes):
            _check_prefix_syntax(f"data.validation.{group}[{j}]", p, cfg)
    d = cfg.demo
    if d.vocab_size < 300 or not (0.0 < d.val_fraction < 0.5) or d.code_max_bytes <= 0 or d.math_documents < 10:
        raise DataConfigError(
            f"data.demo = {d}: need vocab_size >= 300, 0 < val_fraction < 0.5, "
            f"code_max_bytes > 0, math_documents >= 10"
        )
    if check_files:
        check_files_exist(cfg, demo_dir)


def _check_prefix_syntax(key: str, prefix: str, cfg: DataConfig) -> None:
    if not isinstance(prefix, str) or not prefix:
        raise DataConfigError(f"{key} = {prefix!r}: a prefix must be a non-empty path string")
    if prefix.startswith(DEMO_PREFIX):
        name = prefix[len(DEMO_PREFIX):]
        if name not in DEMO_DATASETS:
            raise DataConfigError(
                f"{key} = {prefix!r}: unknown demo dataset {name!r}; choose one of "
                f"{[DEMO_PREFIX + n for n in DEMO_DATASETS]}"
            )
        if cfg.tokenizer is not None:
            raise DataConfigError(
                f"{key} = {prefix!r} is tokenized with the demo tokenizer, but data.tokenizer = "
                f"{cfg.tokenizer!r}: set data.tokenizer=null to use the demo corpus"
            )
    elif prefix.endswith((".bin", ".idx")):
        raise DataConfigError(f"{key} = {prefix!r}: give the prefix without the .bin/.idx extension")


def uses_demo(cfg: DataConfig) -> bool:
    """True when the config needs the embedded demo corpus (demo prefixes or the demo tokenizer)."""
    if cfg.tokenizer is None:
        return True
    all_prefixes = [p for c in cfg.categories.values() for p in c.prefixes]
    all_prefixes += [p for ps in cfg.validation.values() for p in ps]
    return any(p.startswith(DEMO_PREFIX) for p in all_prefixes)


def resolve_prefix(prefix: str, demo_dir: Optional[str]) -> str:
    if prefix.startswith(DEMO_PREFIX):
        if demo_dir is None:
            raise DataConfigError(f"{prefix!r} needs the demo corpus, which was not prepared")
        return os.path.join(demo_dir, prefix[len(DEMO_PREFIX):])
    return os.path.expanduser(prefix)


def expand_prefix(key: str, prefix: str, demo_dir: Optional[str] = None) -> List[str]:
    """The dataset paths ``prefix`` stands for: itself (resolved), or a glob's matches in natural
    order. A glob is validated here (MissingDataError naming the key and the bad match): it matches
    something, every match is complete (.bin, .idx and sidecar), and no shard of a split that a
    match belongs to is missing. Matches without documents (empty shards) are dropped."""
    from data.shards import dataset_problem, glob_prefixes, is_glob, missing_shards, read_json

    if prefix.startswith(DEMO_PREFIX) or not is_glob(prefix):
        return [resolve_prefix(prefix, demo_dir)]
    matches = glob_prefixes(prefix)
    if not matches:
        raise MissingDataError(
            f"{key} = {prefix!r}: the glob matches no dataset (no {prefix}.bin/.idx/.json). Prepare "
            f"shards with `python -m data.prepare INPUT... --tokenizer TOKENIZER --output PREFIX --shard I/N`"
        )
    for m in matches:
        problem = dataset_problem(m)
        if problem is not None:
            raise MissingDataError(
                f"{key} = {prefix!r}: match {m} is {problem}; re-run the data.prepare that writes it "
                f"(an unfinished shard: run its --shard I/N again)"
                if problem.startswith("incomplete") else f"{key} = {prefix!r}: match {m}: {problem}"
            )
    missing = missing_shards(matches)
    if missing:
        raise MissingDataError(
            f"{key} = {prefix!r}: shard {missing[0]} of the same split is missing ({len(missing)} missing): "
            f"run its data.prepare --shard again, or list the shards you want without a glob"
        )
    return [m for m in matches if int((read_json(m + ".json") or {}).get("documents", 1)) > 0]


def check_files_exist(cfg: DataConfig, demo_dir: Optional[str] = None) -> None:
    """Raise MissingDataError naming the first missing dataset file or tokenizer."""
    _check_tokenizer_exists(cfg)
    entries = [(f"data.categories.{c}.prefixes[{j}]", p) for c, cc in cfg.categories.items() for j, p in enumerate(cc.prefixes)]
    entries += [(f"data.validation.{g}[{j}]", p) for g, ps in cfg.validation.items() for j, p in enumerate(ps)]
    for key, p in entries:
        if p.startswith(DEMO_PREFIX) and demo_dir is None:
            continue
        paths = expand_prefix(key, p, demo_dir)
        if not paths:
            raise MissingDataError(f"{key} = {p!r}: every match is an empty shard (no documents)")
        path = paths[0]
        missing = [path + ext for ext in (".bin", ".idx") if not os.path.isfile(path + ext)]
        if missing:
            raise MissingDataError(
                f"{key} = {p!r}: no indexed dataset there (missing {', '.join(missing)}). "
                f"Prepare it with `python -m data.prepare INPUT.jsonl... --tokenizer TOKENIZER.json "
                f"--output {path}`"
            )


def _check_tokenizer_exists(cfg: DataConfig) -> None:
    if cfg.tokenizer is None:
        return
    path = os.path.expanduser(cfg.tokenizer)
    if os.path.isdir(path):  # a Hugging Face tokenizer directory
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if not os.path.isfile(os.path.join(path, name)):
                raise MissingDataError(
                    f"data.tokenizer = {cfg.tokenizer!r}: a directory without {name}; a Hugging Face "
                    f"tokenizer directory needs tokenizer.json and tokenizer_config.json")
        return
    if not os.path.isfile(path):
        raise MissingDataError(
            f"data.tokenizer = {cfg.tokenizer!r}: file not found. Train one with "
            f"`python -m data.prepare INPUT... --output PREFIX --train-tokenizer 32768` "
            f"(saved as tokenizer.json next to PREFIX), or set data.tokenizer=null for the demo tokenizer"
        )
