"""Which optimizer layout a checkpoint is written in, where it can be resumed, and a resume across
the two layer-spec families (a checkpoint written on one kind of hardware resumed on another;
train.py doing it: tests/system/test_checkpoint_resume.py)."""

from __future__ import annotations

import json

import pytest
import torch

from training import checkpoint as ckpt
from training import ddp_optimizer as mp

SAME = {"tensor": 1, "pipeline": 1, "data": 8, "spec": "te"}


def test_the_layout_follows_the_optimizer_and_the_key():
    assert ckpt.optimizer_layout("dp_reshardable", True) == "dp_reshardable"
    assert ckpt.optimizer_layout("fully_reshardable", True) == "fully_reshardable"
    # without the distributed optimizer the state is per parameter already
    assert ckpt.optimizer_layout("dp_reshardable", False) == "fully_reshardable"
    with pytest.raises(ValueError, match="trainer.checkpoint_layout='bucket'"):
        ckpt.optimizer_layout("bucket", True)


def test_where_each_layout_can_be_resumed():
    fully = {**SAME, "layout": "fully_reshardable"}
    for now in ({**SAME, "tensor": 2}, {**SAME, "pipeline": 4}, {**SAME, "data": 184},
                {**SAME, "spec": "portable"}):
        assert ckpt.layout_problem(fully, now, megatron_optimizer=True) is None
    dp = {**SAME, "layout": "dp_reshardable"}
    assert ckpt.layout_problem(dp, SAME, megatron_optimizer=True) is None
    # another data-parallel size: the twin's flat buffer does not depend on it; megatron's
    # buckets do not either while max(40M, 1M x DP) stays 40M
    assert ckpt.layout_problem(dp, {**SAME, "data": 2}, megatron_optimizer=False) is None
    assert ckpt.layout_problem(dp, {**SAME, "data": 40}, megatron_optimizer=True) is None
    assert ckpt.layout_problem(dp, {**SAME, "data": 184}, megatron_optimizer=False) is None
    problem = ckpt.layout_problem(dp, {**SAME, "data": 184}, megatron_optimizer=True)
    assert "data 8 -> 184" in problem and "40000000 -> 184000000" in problem
    problem = ckpt.layout_problem(dp, {**SAME, "tensor": 2, "spec": "portable"},
                                  megatron_optimizer=True)
    assert "tensor 1 -> 2" in problem and "spec te -> portable" in problem
    assert "trainer.checkpoint_layout=fully_reshardable" in problem
    assert "model.init_from=" in problem
    # experts: fully_reshardable keys each expert by its global index (any EP loads it); the
    # dp_reshardable expert buffer holds one EP rank's experts, and a manifest from before
    # expert parallelism reads as EP 1, expert tensor parallel = tensor
    for now in ({**SAME, "expert": 2}, {**SAME, "expert": 2, "expert_tensor": 1}):
        assert ckpt.layout_problem({**fully, "expert": 4}, now, megatron_optimizer=True) is None
    assert ckpt.layout_problem(dp, {**SAME, "expert": 1, "expert_tensor": 1},
                               megatron_optimizer=False) is None
    problem = ckpt.layout_problem({**dp, "expert": 2}, SAME, megatron_optimizer=False)
    assert "(expert 2 -> 1)" in problem
    problem = ckpt.layout_problem({**dp, "tensor": 2, "expert_tensor": 1},
                                  {**SAME, "tensor": 2}, megatron_optimizer=False)
    assert "(expert_tensor 1 -> 2)" in problem
    assert ckpt.saved_layout_grid({"tensor": 2, "pipeline": 1}) == {
        "tensor": 2, "pipeline": 1, "expert": 1, "expert_tensor": 2}


@pytest.fixture(scope="module")
def sharded_model(parallel_context):
    """A small model with the distributed optimizer (one shard at DP=1), one Adam step taken."""
    return _build(parallel_context, step=True)


def _build(ctx, step: bool):
    from model.build import build_model
    from model.config import ModelConfig
    from nvfp4_recipe.policy import PrecisionConfig
    from training.config import TrainerConfig

    torch.manual_seed(0)
    core = build_model(ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128,
                                   pattern="M*-"), PrecisionConfig(name="bf16", format="bf16"),
                       vocab_size=256, backend="emulated", params_dtype=mp.PARAMS_DTYPE).module
    _, optimizer = mp.build_data_parallel_model(core, TrainerConfig(distributed_optimizer=True),
                                                ctx)
    if step:
        for buffer in optimizer.model.buffers:
            buffer.grad_data.normal_()
        optimizer.step()
    return core, optimizer


def _state(core, optimizer) -> dict:
    out = {f"model.{k}": v.clone() for k, v in core.state_dict().items()
           if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")}
    for n, (*_, master) in enumerate(optimizer.pieces):
        out[f"master.{n}"] = master.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):  # none before the first step or load
            if key in optimizer.adam.state[master]:
                out[f"{key}.{n}"] = optimizer.adam.state[master][key].clone()
    return out


def _stored_keys(path) -> set[str]:
    from training.safe_load import SafeFileSystemReader

    return set(SafeFileSystemReader(path / "dist").read_metadata().state_dict_metadata)


@pytest.mark.parametrize("layout", ["dp_reshardable", "fully_reshardable"])
def test_each_layout_restores_weights_and_both_moments(tmp_path, parallel_context, sharded_model,
                                                       layout, caplog):
    core, optimizer = sharded_model
    path = ckpt.save_checkpoint(tmp_path, 3, parallel_context, model=core, optimizer=optimizer,
                                optimizer_format="cpu-twin", trainer_state={"step": 3},
                                keep_last=0, optimizer_layout=layout)
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert (manifest["optimizer_layout"], manifest["spec"], manifest["data_parallel"]) == (
        layout, "portable", 1)
    stored = _stored_keys(path)
    per_parameter = {k for k in stored if k.startswith("optimizer.state.")}
    flat = {k for k in stored if k.startswith("optimizer.dp_reshardable.")}
    if layout == "dp_reshardable":  # one flat span per state, no tensor per parameter
        assert not per_parameter and flat == {
            f"optimizer.dp_reshardable.tp0of1.pp0of1.{k}" for k in mp.OPTIMIZER_STATE_KEYS}
    else:
        assert not flat and "optimizer.state.exp_avg.decoder.layers.0.norm.weight" in per_parameter
    fresh_core, fresh_optimizer = _build(parallel_context, step=False)
    with caplog.at_level("INFO", logger="nvfp4_pretrain"):
        out = ckpt.load_checkpoint(path, parallel_context, fresh_core, fresh_optimizer, "cpu-twin")
    assert out["optimizer_layout"] == layout
    assert f"optimizer state in the {layout} layout, written at data parallel 1" in caplog.text
    expected, got = _state(core, optimizer), _state(fresh_core, fresh_optimizer)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_a_dp_reshardable_checkpoint_of_the_other_spec_is_refused_before_anything_is_read(
        tmp_path, parallel_context, sharded_model):
    """Its flat buffers list the parameters in the writer's order, which the specs do not share
    (TE's pre-norm is a parameter of the first linear): refused, naming the way forward."""
    core, optimizer = sharded_model
    path = ckpt.save_checkpoint(tmp_path, 2, parallel_context, model=core, optimizer=optimizer,
                                optimizer_format="cpu-twin", trainer_state={"step": 2},
                                keep_last=0, optimizer_layout="dp_reshardable", spec="te")
    fresh_core, fresh_optimizer = _build(parallel_context, step=False)
    before = _state(fresh_core, fresh_optimizer)
    with pytest.raises(ckpt.CheckpointMismatch, match="spec te -> portable") as caught:
        ckpt.load_checkpoint(path, parallel_context, fresh_core, fresh_optimizer, "cpu-twin")
    assert "\n" not in str(caught.value)
    after = _state(fresh_core, fresh_optimizer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _saving_as_te(monkeypatch):
    """save_checkpoint writing what a TE-spec run writes: every key renamed through
    model/hf.py:spec_key (weights and per-parameter optimizer state) and "te" in the manifest.
    The TE spec cannot be built on CPU; this is its checkpoint's naming, on the same numbers."""
    real_state, real_save = ckpt._sharded_state, ckpt.save_checkpoint

    def te_named(model, optimizer, is_loading, layout):
        return ckpt._in_spec(real_state(model, optimizer, is_loading, layout), "te")

    monkeypatch.setattr(ckpt, "_sharded_state", te_named)
    monkeypatch.setattr(ckpt, "save_checkpoint",
                        lambda *a, **kw: real_save(*a, **{**kw, "spec": "te"}))


def test_a_te_named_checkpoint_resumes_on_the_portable_spec_and_back(
        tmp_path, parallel_context, sharded_model, monkeypatch, caplog):
    core, optimizer = sharded_model
    with monkeypatch.context() as patch:
        _saving_as_te(patch)
        path = ckpt.save_checkpoint(tmp_path / "te", 4, parallel_context, model=core,
                                    optimizer=optimizer, optimizer_format="cpu-twin",
                                    trainer_state={"step": 4}, keep_last=0,
                                    optimizer_layout="fully_reshardable")
    stored = _stored_keys(path)
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in stored
    assert "optimizer.state.exp_avg.mlp.linear_fc1.layer_norm_weight" not in stored
    assert "optimizer.state.exp_avg.decoder.layers.2.mlp.linear_fc1.layer_norm_weight" in stored
    assert not {"decoder.layers.0.norm.weight", "decoder.layers.1.input_layernorm.weight",
                "decoder.layers.2.pre_mlp_layernorm.weight"} & stored
    # TE -> portable: the portable model asks for its own names, translated to the checkpoint's
    fresh_core, fresh_optimizer = _build(parallel_context, step=False)
    with caplog.at_level("INFO", logger="nvfp4_pretrain"):
        out = ckpt.load_checkpoint(path, parallel_context, fresh_core, fresh_optimizer, "cpu-twin",
                                   spec="portable")
    assert out["spec"] == "te"
    assert "keys of the te spec translated to the portable spec's" in caplog.text
    expected = _state(core, optimizer)
    got = _state(fresh_core, fresh_optimizer)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

    # portable -> TE: a model whose requests carry TE's names (as a TE-spec model's do) reads a
    # portable checkpoint through the same mapping
    portable = ckpt.save_checkpoint(tmp_path / "portable", 4, parallel_context, model=core,
                                    optimizer=optimizer, optimizer_format="cpu-twin",
                                    trainer_state={"step": 4}, keep_last=0,
                                    optimizer_layout="fully_reshardable")
    te_core, te_optimizer = _build(parallel_context, step=False)
    real_state = ckpt._sharded_state
    monkeypatch.setattr(ckpt, "_sharded_state",
                        lambda *a: ckpt._in_spec(real_state(*a), "te"))
    out = ckpt.load_checkpoint(portable, parallel_context, te_core, te_optimizer, "cpu-twin",
                               spec="te")
    assert out["spec"] == "portable"
    got = _state(te_core, te_optimizer)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_cpu_twin_and_megatron_optimizer_state_cannot_cross_and_the_refusal_says_what_can(
        tmp_path):
    (tmp_path / ckpt.MANIFEST).write_text(json.dumps({"optimizer_format": "megatron"}))
    with pytest.raises(ValueError) as caught:
        ckpt.load_checkpoint(tmp_path, None, None, None, "cpu-twin")
    message = str(caught.value)
    assert "CPU twin" in message and "cannot be resumed across" in message
    assert f"model.init_from={tmp_path.parents[1]}" in message  # the run.dir of checkpoints/step_N




def _run_dir_with_checkpoint(root, ctx, core, optimizer, model_cfg):
    import dataclasses

    from omegaconf import OmegaConf

    root.mkdir()
    (root / "config.yaml").write_text(OmegaConf.to_yaml({"model": dataclasses.asdict(model_cfg)}))
    ckpt.save_checkpoint(root / "checkpoints", 2, ctx, model=core, optimizer=optimizer,
                         optimizer_format="cpu-twin", trainer_state={"step": 2}, keep_last=0,
                         optimizer_layout="dp_reshardable")


def test_init_from_a_run_directory_takes_its_weights_alone(tmp_path, parallel_context,
                                                           sharded_model):
    """The way forward where optimizer state cannot cross: the weights of the run's newest
    checkpoint, at any layout; a model of another shape is refused naming the field."""
    import dataclasses

    from model.config import ModelConfig
    from model.hf import check_init_from
    from training.init_from import check_run_init, is_run_dir, load_run_weights
    from training.run_reader import RunDirError

    core, optimizer = sharded_model
    model_cfg = ModelConfig(vocab_size=256, hidden_size=64, ffn_hidden_size=128, pattern="M*-")
    run = tmp_path / "run"
    _run_dir_with_checkpoint(run, parallel_context, core, optimizer, model_cfg)
    cfg = dataclasses.replace(model_cfg, init_from=str(run))
    assert is_run_dir(run) and check_init_from(cfg) == {}  # not read as a Hugging Face dir
    assert check_run_init(cfg) == run / "checkpoints" / "step_0000002"
    torch.manual_seed(7)
    fresh_core, _ = _build(parallel_context, step=False)
    load_run_weights(fresh_core, cfg)
    want, got = core.state_dict(), fresh_core.state_dict()
    for key, value in want.items():
        if isinstance(value, torch.Tensor) and not key.endswith("_extra_state"):
            assert torch.equal(value, got[key]), key
    with pytest.raises(RunDirError, match=r"model.hidden_size=96 but the run has 64") as caught:
        check_run_init(dataclasses.replace(cfg, hidden_size=96))
    assert "\n" not in str(caught.value)
