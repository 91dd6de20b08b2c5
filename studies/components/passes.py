"""Passes over the whole model: each recipe (or one layer) on one batch against BF16, and SR
through optimizer steps from one saved state."""

from __future__ import annotations

import contextlib
import copy
import functools

import torch

from nvfp4_recipe.passes import PassFormats
from nvfp4_recipe.registry import gemm_config_for, pass_configs_for
from training.config import register_configs
from training.schedules import run_micro_batches

from . import REPO
from .capture import layer_index
from .gemms import seed_for


# The recipes of recipes/precision/ compared end to end on the captured batches.
VARIANTS = ["nvfp4", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_no_2d", "nvfp4_no_bf16_layers",
            "nvfp4_naive", "mxfp4", "mxfp8"]


@functools.lru_cache(maxsize=None)
def precision_config(name: str):
    """recipes/precision/<name>.yaml as train.py composes it (its `defaults` chain included)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(str(REPO / "recipes"), version_base=None):
        cfg = compose("train", overrides=[f"precision={name}"])
    return OmegaConf.to_object(cfg.precision)


def recipe_configs(name: str, model_cfg) -> dict[str, object]:
    """{linear name: its emulated-GEMM config (None = BF16)} under recipe `name`, from the
    project's precision policy (the first/last BF16 layers, overrides)."""
    # deferred: model.build imports megatron (~3 s); the report (summary) imports this module,
    # and --report-only runs without megatron
    from model.build import precision_policy

    pcfg = precision_config(name)
    policy = precision_policy(model_cfg, pcfg)
    return {n: _config_of(f, pcfg) for n, f in policy.linear_formats().items()}


def _config_of(fmt: str, pcfg):
    """One format's config, or a PassConfigs where a linear's passes differ ("mxfp8/nvfp4/nvfp4")."""
    formats = PassFormats(fmt)
    if len(set(formats.formats)) == 1:
        return gemm_config_for(formats.fprop, pcfg)
    return pass_configs_for(*formats.formats, pcfg)


@contextlib.contextmanager
def gemm_configs(modules: dict[str, torch.nn.Module], configs: dict[str, object]):
    """Run the linears under `configs` (missing names: BF16), quantizing at every call."""
    saved = {n: (m.gemm_config, m.is_first_microbatch) for n, m in modules.items()}
    try:
        for n, m in modules.items():
            m.gemm_config = configs.get(n)
            m.is_first_microbatch = None
            m.weight_cache.clear()
        yield
    finally:
        for n, m in modules.items():
            m.gemm_config, m.is_first_microbatch = saved[n]
            m.weight_cache.clear()


def loss_and_grad(trainer, batch: dict, seed: int) -> tuple[float, torch.Tensor]:
    """One micro-batch's loss and every parameter's gradient (FP32 main grads), SR drawn from
    `seed` (the trainer's global stream is restored afterwards)."""
    state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        trainer.model.train()
        trainer.model.zero_grad_buffer()
        loss = run_micro_batches(trainer.model, [batch], trainer.ctx, trainer.activation_shape)
        grad = torch.cat([p.main_grad.reshape(-1) for p in trainer.model.params]).clone()
        trainer.model.zero_grad_buffer()
    finally:
        torch.set_rng_state(state)
    return float(loss), grad


def model_level(trainer, modules, batch: dict, model_cfg, key: str) -> dict:
    """Loss change and gradient error against BF16 on one batch, for each recipe variant and for
    each layer quantized alone (NVFP4 full recipe): the sensitivity scan."""
    base_loss, base_grad = loss_and_grad(trainer, batch, seed_for(key, "bf16"))
    norm = float(torch.linalg.vector_norm(base_grad))
    out = {}

    def measure(tag, configs):
        with gemm_configs(modules, configs):
            loss, grad = loss_and_grad(trainer, batch, seed_for(key, tag))
        out[f"dloss/{tag}"] = loss - base_loss
        out[f"grad_err/{tag}"] = float(torch.linalg.vector_norm(grad - base_grad)) / norm

    for variant in VARIANTS:
        measure(variant, recipe_configs(variant, model_cfg))
    full = recipe_configs("nvfp4_no_bf16_layers", model_cfg)  # the recipe on every layer
    for i in sorted({layer_index(n) for n in modules}):
        measure(f"layer/{i}", {n: c for n, c in full.items() if layer_index(n) == i})
    out["loss/bf16"] = base_loss
    return out


def snapshot(trainer) -> dict:
    """The weights, FP32 master weights, Adam state and schedule (the CPU optimizer's)."""
    opt = trainer.optimizer
    return {"params": [b.param_data.clone() for b in trainer.model.buffers],
            "masters": [m.detach().clone() for *_, m in opt.pieces],
            "adam": copy.deepcopy(opt.adam.state_dict()),
            "scheduler": copy.deepcopy(trainer.scheduler.state_dict())}


def restore(trainer, snap: dict) -> None:
    opt = trainer.optimizer
    with torch.no_grad():
        for buffer, saved in zip(trainer.model.buffers, snap["params"]):
            buffer.param_data.copy_(saved)
        for (*_, m), saved in zip(opt.pieces, snap["masters"]):
            m.copy_(saved)
    opt.adam.load_state_dict(copy.deepcopy(snap["adam"]))
    trainer.scheduler.load_state_dict(copy.deepcopy(snap["scheduler"]))


def masters(trainer) -> torch.Tensor:
    return torch.cat([m.detach().reshape(-1) for *_, m in trainer.optimizer.pieces]).clone()


def set_masters(trainer, flat: torch.Tensor) -> None:
    """Load FP32 master weights (masters()' layout) and the BF16 weights made from them, as the
    optimizer's step does."""
    opt, offset = trainer.optimizer, 0
    with torch.no_grad():
        for i, a, b, master in opt.pieces:
            master.copy_(flat[offset:offset + master.numel()].view_as(master))
            offset += master.numel()
            opt.flat_slice(i, a, b, grads=False).copy_(master)


def sr_steps(trainer, modules, model_cfg, batches: list[list[dict]], seeds: list[int]) -> dict:
    """k optimizer steps from one state on the same k batches: BF16, the full recipe (SR, one run
    per seed) and the recipe without SR. Per run: the error of the k-step update of the FP32
    master weights against BF16's, and the validation loss (BF16 forward) after the k steps."""
    snap = snapshot(trainer)
    start = masters(trainer)

    def run(configs, seed):
        restore(trainer, snap)
        torch.manual_seed(seed)
        with gemm_configs(modules, configs):
            for mb in batches:
                for m in modules.values():
                    m.is_first_microbatch = True  # the trainer's protocol: quantize once a step
                trainer.train_step(mb)
        update = masters(trainer) - start
        val = trainer.validator.loss()  # BF16 forward: the weights' quality, not the format's
        return update, val

    bf16_update, bf16_val = run({}, 0)
    ref = float(torch.linalg.vector_norm(bf16_update))
    nearest_update, nearest_val = run(recipe_configs("nvfp4_no_sr", model_cfg), 0)
    sr_updates, sr_vals = [], []
    for s in seeds:
        u, v = run(recipe_configs("nvfp4", model_cfg), s)
        sr_updates.append(u)
        sr_vals.append(v)
    restore(trainer, snap)
    err = lambda u: float(torch.linalg.vector_norm(u - bf16_update)) / ref
    # The mean update of k SR runs (disjoint groups of seeds): what averaging SR's rounding over
    # k repetitions leaves; its error falls with k only as far as SR is unbiased.
    mean_of_k, k = {}, 1
    while k <= len(seeds):
        mean_of_k[str(k)] = [err(torch.stack(sr_updates[i:i + k]).mean(0))
                             for i in range(0, len(seeds) - k + 1, k)]
        k *= 2
    everything = torch.stack(sr_updates)
    total = everything.sum(0)

    def val_after(update):  # the validation loss of start + update (BF16 forward)
        restore(trainer, snap)
        set_masters(trainer, start + update)
        return trainer.validator.loss()

    mean_val = val_after(total / len(seeds))
    loo_vals = ([val_after((total - u) / (len(seeds) - 1)) for u in everything]
                if len(seeds) > 1 else [])
    restore(trainer, snap)
    return {
        "val_gap/sr_mean_update": mean_val - bf16_val,
        "val_gap/sr_mean_update_loo": [v - bf16_val for v in loo_vals],
        "steps": len(batches), "seeds": seeds, "bf16_val": bf16_val,
        "update_err/nearest": err(nearest_update),
        "update_err/sr_mean_all": err(total / len(seeds)),
        # leave-one-out means: a jackknife interval for the error of the mean of all runs
        "update_err/sr_mean_loo": [err((total - u) / (len(seeds) - 1)) for u in everything]
        if len(seeds) > 1 else [],
        "update_err/sr": [err(u) for u in sr_updates],
        "update_err/sr_mean_of_k": mean_of_k,
        "val_gap/nearest": nearest_val - bf16_val,
        "val_gap/sr": [v - bf16_val for v in sr_vals],
    }
