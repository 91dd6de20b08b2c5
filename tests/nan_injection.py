"""train.py with a NaN injected into one pattern layer's backward (a test fixture, not a feature).

    NAN_LAYER=7 NAN_AFTER=2 python tests/nan_injection.py <train.py overrides>

From the NAN_AFTER-th training forward of the layer with global pattern index NAN_LAYER on (0:
from the first), the gradient that arrives at that layer's output is replaced by NaN, so the
layer's backward is the first to produce non-finite gradients. Works under torchrun: the stage
that builds the layer injects, the others run train.py unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


class NaNGradient(torch.autograd.Function):
    """The identity forward; a backward that returns NaN everywhere."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("nan"))


def inject(core: torch.nn.Module, layer: int, after: int = 0) -> None:
    """Make the backward of global pattern layer `layer` produce NaN (if this stage has it)."""
    decoder = core.decoder
    local = layer - decoder.layer_offset
    if not 0 <= local < len(decoder.layers):
        return
    calls = [0]

    def hook(_module, _args, output):
        if not torch.is_grad_enabled():
            return None
        calls[0] += 1
        if calls[0] <= after:
            return None
        if isinstance(output, tuple):  # a transformer layer: (hidden states, context)
            return (NaNGradient.apply(output[0]), *output[1:])
        return NaNGradient.apply(output)

    decoder.layers[local].register_forward_hook(hook)


def main() -> None:
    import model.build

    layer, after = int(os.environ["NAN_LAYER"]), int(os.environ.get("NAN_AFTER", "0"))
    build = model.build.build_model

    def build_and_inject(*args, **kwargs):
        built = build(*args, **kwargs)
        inject(built.module, layer, after)
        return built

    model.build.build_model = build_and_inject
    import training.trainer

    training.trainer.build_model = build_and_inject  # the name the trainer imported
    sys.argv = [str(REPO / "train.py"), *sys.argv[1:]]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
