"""A planted outlier channel: one named linear sees a large constant on one input channel (a test
fixture, not a feature).

In process:

    handle = plant_outlier(core, "layers.2.mixer.in_proj", channel=0, value=1e4)
    ...
    handle.remove()

As a wrapper around train.py, or around any module's command line (`OUTLIER_MODULE`, run as
`python -m <module>` would run it, e.g. tools.replay):

    OUTLIER_LINEAR=layers.2.mixer.in_proj OUTLIER_VALUE=1e4 python tests/outlier_injection.py \
        <train.py overrides>
    OUTLIER_LINEAR=layers.2.mixer.in_proj OUTLIER_MODULE=tools.replay \
        python tests/outlier_injection.py <the module's arguments>

Environment: OUTLIER_LINEAR (the policy's name, `layers.<pattern index>.<module name>`, as
`model.build.BuiltModel.linears` names it), OUTLIER_CHANNEL (default 0), OUTLIER_VALUE (default
1e4), OUTLIER_AFTER (default 0: the outlier is there from the first forward; N: from the forward
after the linear's N-th training forward, so a run can go clean for a while first),
OUTLIER_RANK (default: every rank; N: only the process of global rank N, e.g. one data-parallel
rank, so that only statistics reduced over the ranks can see it).

The constant is added to `channel` of the linear's input's last dimension (its K, the reduction
dimension of Fprop): a channel that dwarfs the others in its 1x16 / 1x32 block pushes their
values under the block scale's smallest step, the underflow the precision telemetry measures.
The hook is a forward pre-hook on the megatron module itself, so it acts on whatever backend
built it (the emulated linears, TE's). Under torchrun the stage that holds the linear plants it;
the others run unchanged. With tensor parallelism `channel` indexes the rank's shard of the input.
The wrapper plants in every model `model.build.build_model` builds in the process (a replay's
model too).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def find_linear(core: torch.nn.Module, linear_name: str) -> torch.nn.Module | None:
    """The module the policy calls `linear_name` (`layers.<pattern index>.<module name>`) in this
    pipeline stage's decoder, or None where another stage holds it. ValueError for a name that is
    not of that form or names no module of its layer."""
    parts = linear_name.split(".", 2)
    if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"{linear_name!r}: name a linear as layers.<pattern index>.<module name>")
    decoder = core.decoder
    local = int(parts[1]) - decoder.layer_offset
    if not 0 <= local < len(decoder.layers):
        return None
    try:
        return decoder.layers[local].get_submodule(parts[2])
    except AttributeError:
        raise ValueError(f"{linear_name!r}: layer {parts[1]} has no module {parts[2]!r}") from None


def plant_outlier(core: torch.nn.Module, linear_name: str, channel: int = 0, value: float = 1e4,
                  after: int = 0):
    """Add `value` to input channel `channel` of the linear `linear_name` at every forward (from
    the forward after its `after`-th training forward). Returns the hook's handle (`.remove()`),
    or None where this stage does not hold the linear."""
    module = find_linear(core, linear_name)
    if module is None:
        return None
    training_calls = [0]

    def hook(_module, args, kwargs):
        x = args[0] if args else kwargs["input"]
        if torch.is_grad_enabled():
            training_calls[0] += 1
            if training_calls[0] <= after:
                return None
        elif training_calls[0] < after:
            return None
        if not -x.shape[-1] <= channel < x.shape[-1]:
            raise IndexError(f"outlier channel {channel} outside {linear_name}'s input of "
                             f"{x.shape[-1]} channels")
        planted = x.clone()
        planted[..., channel] += value
        if args:
            return (planted, *args[1:]), kwargs
        return args, {**kwargs, "input": planted}

    return module.register_forward_pre_hook(hook, with_kwargs=True)


def _settings() -> dict | None:
    """plant_outlier's arguments from the environment; None where this rank plants nothing."""
    rank = os.environ.get("OUTLIER_RANK")
    if rank is not None and int(os.environ.get("RANK", "0")) != int(rank):
        return None
    return {"linear_name": os.environ["OUTLIER_LINEAR"],
            "channel": int(os.environ.get("OUTLIER_CHANNEL", "0")),
            "value": float(os.environ.get("OUTLIER_VALUE", "1e4")),
            "after": int(os.environ.get("OUTLIER_AFTER", "0"))}


def install(settings: dict | None) -> None:
    """Every model `model.build.build_model` builds from now on, in this process, gets the
    outlier: the function is replaced in model.build and in every module imported so far that
    took the name from it (later imports take the replacement)."""
    import model.build

    build = model.build.build_model

    def build_and_plant(*args, **kwargs):
        built = build(*args, **kwargs)
        if settings is not None:
            plant_outlier(built.module, **settings)
        return built

    for module in list(sys.modules.values()):
        if getattr(module, "build_model", None) is build:
            module.build_model = build_and_plant


def main() -> None:
    install(_settings())
    target = os.environ.get("OUTLIER_MODULE")
    if target:
        sys.argv = [target, *sys.argv[1:]]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
