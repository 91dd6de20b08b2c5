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

Checks, pure ones first: each schema checks its own fields when it is built (``__post_init__``,
which ``OmegaConf.to_object`` runs; a numeric field's range is declared on the field,
``field_ranges``), ``DataConfig`` its categories' and phases' entries under their keys;
``check_runnable`` that there is something to train on (the schema's default is empty);
``check_files_exist`` the files. ``validate_config`` runs the last two, files first.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from errors import ConfigError, ExitCode
from field_ranges import at_least, check_fields, is_number, within

from data.shards import dataset_problem, glob_prefixes, is_glob, missing_shards, read_json

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
    end_fraction: float = field(default=1.0, metadata=within(0, 1, low_open=True))
    weights: Dict[str, float] = field(default_factory=dict)


@dataclass
class DemoConfig:
    """Settings of the embedded demo corpus (only used by ``demo:`` prefixes / ``tokenizer: null``)."""

    # Above the tokenizer's 256 byte tokens and its special tokens.
    vocab_size: int = field(default=4096, metadata=at_least(300))
    # Cap on standard-library code; keeps preparation < ~15 s.
    code_max_bytes: int = field(default=2_000_000, metadata=at_least(1))
    # Generated arithmetic worksheets (enough for a held-out part).
    math_documents: int = field(default=1500, metadata=at_least(10))
    seed: int = field(default=1234, metadata=at_least(0))  # seed of the arithmetic generator
    # The last documents holding ~3% of each category's bytes are held out.
    val_fraction: float = field(default=0.03, metadata=within(0, 0.5, low_open=True,
                                                                high_open=True))

    def __post_init__(self) -> None:
        check_fields(self, "data.demo", DataConfigError)


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
    total_tokens: Optional[int] = field(default=None, metadata=at_least(1))
    demo: DemoConfig = field(default_factory=DemoConfig)

    def __post_init__(self) -> None:
        """Every field and every entry of categories, phases and validation (empty ones are
        refused by `check_runnable`: the schema's default has none)."""
        check_fields(self, "data", DataConfigError)
        for cat, cc in self.categories.items():
            key = f"data.categories.{cat}"
            check_fields(cc, key, DataConfigError)
            if not cc.prefixes:
                raise DataConfigError(f"{key}.prefixes is empty: list at least one dataset prefix")
            for j, p in enumerate(cc.prefixes):
                _check_prefix_syntax(f"{key}.prefixes[{j}]", p)
            if cc.weights is not None:
                if len(cc.weights) != len(cc.prefixes):
                    raise DataConfigError(
                        f"{key}.weights has {len(cc.weights)} entries but {key}.prefixes has "
                        f"{len(cc.prefixes)}: give one weight per prefix, or null for "
                        "size-proportional"
                    )
                for j, w in enumerate(cc.weights):
                    if not _positive(w):
                        raise DataConfigError(
                            f"{key}.weights[{j}] = {w!r}: weights must be positive finite numbers "
                            f"(remove the prefix instead of giving it weight 0)"
                        )
        if self.phases and not self.categories:
            raise _no_categories()
        prev = 0.0
        names = set()
        for i, ph in enumerate(self.phases):
            key = f"data.phases[{i}] ({ph.name!r})"
            if ph.name in names:
                raise DataConfigError(f"{key}: duplicate phase name {ph.name!r}; phase names must "
                                      "be unique")
            names.add(ph.name)
            check_fields(ph, key, DataConfigError)
            if ph.end_fraction <= prev:
                raise DataConfigError(
                    f"{key}.end_fraction = {ph.end_fraction} is not greater than the previous "
                    f"phase's {prev}: end fractions must be strictly increasing"
                )
            prev = ph.end_fraction
            if not ph.weights:
                raise DataConfigError(f"{key}.weights is empty: give at least one category a "
                                      "weight")
            for cat, w in ph.weights.items():
                if cat not in self.categories:
                    raise DataConfigError(
                        f"{key}.weights: unknown category {cat!r}; defined categories are "
                        f"{sorted(self.categories)} (add it under data.categories or remove it)"
                    )
                if not _positive(w):
                    raise DataConfigError(
                        f"{key}.weights.{cat} = {w!r}: weights must be positive finite numbers "
                        f"(leave the category out of the phase to give it no samples)"
                    )
        if self.phases and abs(self.phases[-1].end_fraction - 1.0) > 1e-12:
            raise DataConfigError(
                f"data.phases[{len(self.phases) - 1}] ({self.phases[-1].name!r}).end_fraction = "
                f"{self.phases[-1].end_fraction}: the last phase must end at 1.0"
            )
        for group, prefixes in self.validation.items():
            if not prefixes:
                raise DataConfigError(f"data.validation.{group} is empty: list prefixes or remove "
                                      "the group")
            for j, p in enumerate(prefixes):
                _check_prefix_syntax(f"data.validation.{group}[{j}]", p)


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
    return is_number(x) and x > 0


def _no_categories() -> DataConfigError:
    return DataConfigError("data.categories is empty: define at least one category with "
                           "prefixes, or use a recipe (data=demo)")


def check_runnable(cfg: DataConfig) -> None:
    """Something to train on, at least one category and one phase (the schema's default has
    none), and demo prefixes only with the demo tokenizer. Run after the files are checked: a
    missing tokenizer is reported as missing, not as disagreeing with the demo prefixes."""
    if not cfg.categories:
        raise _no_categories()
    if not cfg.phases:
        raise DataConfigError("data.phases is empty: define at least one phase ending at "
                              "end_fraction 1.0")
    if cfg.tokenizer is not None:
        for key, prefix in _prefix_entries(cfg):
            if prefix.startswith(DEMO_PREFIX):
                raise DataConfigError(
                    f"{key} = {prefix!r} is tokenized with the demo tokenizer, but data.tokenizer "
                    f"= {cfg.tokenizer!r}: set data.tokenizer=null to use the demo corpus"
                )


def validate_config(cfg: DataConfig, check_files: bool = False, demo_dir: Optional[str] = None) -> None:
    """The data group's checks after its schema's own, for data's commands: with
    ``check_files`` every non-demo prefix and the tokenizer on disk (demo prefixes too when
    ``demo_dir`` is given; MissingDataError, exit 3), then `check_runnable` (DataConfigError)."""
    if check_files:
        check_files_exist(cfg, demo_dir)
    check_runnable(cfg)


def _prefix_entries(cfg: DataConfig) -> list[tuple[str, str]]:
    """(key, prefix) of every category and validation prefix."""
    entries = [(f"data.categories.{c}.prefixes[{j}]", p)
               for c, cc in cfg.categories.items() for j, p in enumerate(cc.prefixes)]
    return entries + [(f"data.validation.{g}[{j}]", p)
                      for g, ps in cfg.validation.items() for j, p in enumerate(ps)]


def _check_prefix_syntax(key: str, prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix:
        raise DataConfigError(f"{key} = {prefix!r}: a prefix must be a non-empty path string")
    if prefix.startswith(DEMO_PREFIX):
        name = prefix[len(DEMO_PREFIX):]
        if name not in DEMO_DATASETS:
            raise DataConfigError(
                f"{key} = {prefix!r}: unknown demo dataset {name!r}; choose one of "
                f"{[DEMO_PREFIX + n for n in DEMO_DATASETS]}"
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
    for key, p in _prefix_entries(cfg):
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
