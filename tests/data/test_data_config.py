"""DataConfig: recipes compose against the schema; validation names the bad key."""

import pytest
from omegaconf import OmegaConf

from data.config import (
    CategoryConfig,
    DataConfig,
    DataConfigError,
    MissingDataError,
    PhaseConfig,
    check_files_exist,
    to_data_config,
    validate_config,
)

from helpers import RECIPES


def _cfg(**kw):
    base = dict(
        categories={"a": CategoryConfig(prefixes=["/x/a"]), "b": CategoryConfig(prefixes=["/x/b1", "/x/b2"], weights=[1, 3])},
        phases=[PhaseConfig("p1", 0.6, {"a": 0.7, "b": 0.3}), PhaseConfig("p2", 1.0, {"b": 1.0})],
        tokenizer="/x/tokenizer.json",
    )
    base.update(kw)
    return DataConfig(**base)


@pytest.mark.parametrize("recipe", ["demo", "phased_10t"])
def test_recipes_match_schema(recipe, monkeypatch):
    monkeypatch.setenv("DATA_ROOT", "/mnt/corpus")
    raw = OmegaConf.load(RECIPES / f"{recipe}.yaml")
    merged = OmegaConf.merge(OmegaConf.structured(DataConfig), raw)  # unknown keys raise here
    cfg = to_data_config(merged)
    validate_config(cfg)
    assert cfg.phases[-1].end_fraction == 1.0
    if recipe == "phased_10t":
        assert cfg.total_tokens == 10**13
        assert [p.end_fraction for p in cfg.phases] == [0.7, 0.9, 1.0]
        assert cfg.categories["code"].prefixes == ["/mnt/corpus/code/code"]
        assert cfg.tokenizer == "/mnt/corpus/tokenizer.json"
        assert "ILLUSTRATIVE" in (RECIPES / "phased_10t.yaml").read_text()
    else:
        assert cfg.tokenizer is None and len(cfg.phases) == 3


def test_unknown_key_rejected():
    with pytest.raises(DataConfigError, match="not_a_real_field"):
        to_data_config({"not_a_real_field": 1})


def test_valid_config_passes():
    validate_config(_cfg())


@pytest.mark.parametrize("bad,match", [
    (dict(phases=[PhaseConfig("p1", 1.0, {"a": -1.0})]), r"data\.phases\[0\] \('p1'\)\.weights\.a = -1\.0"),
    (dict(phases=[PhaseConfig("p1", 1.0, {"a": 0})]), r"weights\.a = 0.*positive"),
    (dict(categories={"a": CategoryConfig(prefixes=["/x/a", "/x/b"], weights=[1.0, 0.0])}), r"data\.categories\.a\.weights\[1\] = 0\.0"),
    (dict(categories={"a": CategoryConfig(prefixes=["/x/a"], weights=[1.0, 2.0])}), r"data\.categories\.a\.weights has 2 entries"),
    (dict(phases=[PhaseConfig("p1", 0.6, {"a": 1}), PhaseConfig("p2", 0.6, {"b": 1}), PhaseConfig("p3", 1.0, {"b": 1})]),
     r"data\.phases\[1\] \('p2'\)\.end_fraction = 0\.6 is not greater than the previous phase's 0\.6"),
    (dict(phases=[PhaseConfig("p1", 0.8, {"a": 1}), PhaseConfig("p2", 0.5, {"b": 1})]), r"not greater"),
    (dict(phases=[PhaseConfig("p1", 0.5, {"a": 1}), PhaseConfig("p2", 0.9, {"b": 1})]), r"\('p2'\)\.end_fraction = 0\.9: the last phase must end at 1\.0"),
    (dict(phases=[PhaseConfig("p1", 1.0, {"a": 1, "wiki": 2})]), r"data\.phases\[0\] \('p1'\)\.weights: unknown category 'wiki'"),
    (dict(phases=[]), r"data\.phases is empty"),
    (dict(categories={}), r"data\.categories is empty"),
    (dict(categories={"a": CategoryConfig(prefixes=["demo:poetry"])}, tokenizer=None), r"unknown demo dataset 'poetry'"),
    (dict(categories={"a": CategoryConfig(prefixes=["demo:prose"])}), r"demo tokenizer.*data\.tokenizer=null"),
    (dict(categories={"a": CategoryConfig(prefixes=["/x/a.bin"])}), r"without the \.bin/\.idx"),
    (dict(total_tokens=0), r"^data\.total_tokens=0 must be >= 1 \(or null\)$"),
    (dict(phases=[PhaseConfig("p1", 1.5, {"a": 1})]), r"^data\.phases\[0\] \('p1'\)\.end_fraction=1\.5 must be in \(0, 1\]$"),
])
def test_validation_errors_name_the_key(bad, match):
    if "categories" in bad and "phases" not in bad and bad["categories"]:
        bad = {**bad, "phases": [PhaseConfig("p1", 1.0, {"a": 1.0})]}
    with pytest.raises(DataConfigError, match=match):
        validate_config(_cfg(**bad))


def test_the_schema_refuses_a_bad_entry_when_built_from_yaml():
    """OmegaConf.to_object builds the dataclasses, so their __post_init__ runs: the composed
    config is refused before anything else looks at it, naming the key."""
    raw = {"categories": {"a": {"prefixes": ["/x/a"]}},
           "phases": [{"name": "p1", "end_fraction": 1.0, "weights": {"a": -2.0}}]}
    with pytest.raises(DataConfigError, match=r"^data\.phases\[0\] \('p1'\)\.weights\.a = -2\.0"):
        to_data_config(raw)
    with pytest.raises(DataConfigError, match=r"^data\.demo\.val_fraction=0\.5 must be in \(0, 0\.5\)$"):
        to_data_config({"demo": {"val_fraction": 0.5}})
    assert to_data_config({}).categories == {}  # the schema's default: empty, refused only by
    with pytest.raises(DataConfigError, match=r"^data\.categories is empty"):  # check_runnable
        validate_config(to_data_config({}))


def test_a_missing_tokenizer_is_reported_before_the_demo_prefixes_that_disagree_with_it(tmp_path):
    cfg = _cfg(tokenizer=str(tmp_path / "nope.json"),
               categories={"a": CategoryConfig(prefixes=["demo:prose"])},
               phases=[PhaseConfig("p1", 1.0, {"a": 1.0})])
    with pytest.raises(MissingDataError, match=r"nope\.json.*not found"):
        validate_config(cfg, check_files=True)
    (tmp_path / "nope.json").write_text("{}")
    with pytest.raises(DataConfigError, match=r"demo tokenizer.*data\.tokenizer=null"):
        validate_config(cfg, check_files=True)


def test_missing_prefix_names_path_and_fix(tmp_path):
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"")
    cfg = _cfg(tokenizer=str(tok), categories={
        "a": CategoryConfig(prefixes=[str(tmp_path / "a")]),
        "b": CategoryConfig(prefixes=[str(tmp_path / "a"), str(tmp_path / "b2")]),
    })
    with pytest.raises(MissingDataError) as e:
        check_files_exist(cfg)
    msg = str(e.value)
    assert "data.categories.b.prefixes[1]" in msg and str(tmp_path / "b2.bin") in msg
    assert "python -m data.prepare" in msg


def test_a_missing_file_is_a_config_error_with_exit_3():
    from errors import ConfigError, ExitCode

    assert MissingDataError("x").code == ExitCode.MISSING and DataConfigError("x").code == ExitCode.CONFIG
    assert issubclass(MissingDataError, ConfigError)  # `except DataConfigError` still sees both


def test_missing_tokenizer_named(tmp_path):
    cfg = _cfg(tokenizer=str(tmp_path / "nope.json"))
    with pytest.raises(MissingDataError, match=r"data\.tokenizer = .*nope\.json.*not found"):
        validate_config(cfg, check_files=True)


def test_cache_dir_env_interpolation(monkeypatch):
    monkeypatch.setenv("NVFP4_CACHE", "/scratch/c")
    assert to_data_config(_cfg()).cache_dir == "/scratch/c/data"
    monkeypatch.delenv("NVFP4_CACHE")
    assert to_data_config(_cfg()).cache_dir == ".cache/data"


def test_hydra_composes_recipes_with_schema(tmp_path):
    """The lead's pattern: ConfigStore schema for the `data` node + `data: demo` in defaults."""
    import shutil
    from dataclasses import dataclass, field

    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import ConfigCompositionException

    shutil.copytree(RECIPES, tmp_path / "data")
    (tmp_path / "root.yaml").write_text("defaults:\n  - data_test_schema\n  - data: demo\n  - _self_\n")

    @dataclass
    class Root:
        data: DataConfig = field(default_factory=DataConfig)

    ConfigStore.instance().store(name="data_test_schema", node=Root)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        for recipe in ("demo", "phased_10t"):
            cfg = compose("root", overrides=[f"data={recipe}"])
            validate_config(to_data_config(cfg.data))
        with pytest.raises(ConfigCompositionException):
            compose("root", overrides=["data.not_a_real_field=1"])
