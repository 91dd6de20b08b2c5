"""Which linears the study looks at, and the capture of their GEMM operands during training."""

from __future__ import annotations

import torch


# Linear module names (model/specs.py LINEAR_NAMES) -> the kinds the tables group by.
KIND_OF = {
    "mixer.in_proj": "mamba in_proj", "mixer.out_proj": "mamba out_proj",
    "self_attention.linear_qkv": "attention qkv", "self_attention.linear_proj": "attention proj",
    "mlp.linear_fc1": "mlp fc1", "mlp.linear_fc2": "mlp fc2",
}
KINDS = list(KIND_OF.values())


def precision_linears(core: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{`layers.<i>.<linear>`: module} of every linear whose GEMM follows a precision decision
    (the names precision.overrides and the policy use)."""
    # deferred: megatron (~3 s); the report's modules (plots, summary) import this one, and
    # --report-only runs without megatron
    from nvfp4_recipe.megatron.parallel_linear import _PrecisionLinearMixin

    out = {}
    for name, module in core.named_modules():
        if isinstance(module, _PrecisionLinearMixin):
            out[name[name.index("layers."):]] = module
    return out


def layer_index(name: str) -> int:
    return int(name.split(".")[1])


def kind_of(name: str) -> str:
    return KIND_OF[name.split(".", 2)[2]]


class Capture:
    """Records, while `active`, the GEMM input x, the weight and the output gradient dY of every
    precision linear: wraps each module's `_precision_gemm` (the local GEMM megatron's parallel
    linear calls), so the tensors are exactly the GEMM's operands, in its [s, b, h] layout."""

    def __init__(self, modules: dict[str, torch.nn.Module]):
        self.modules = modules
        self.active = False
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        for name, module in modules.items():
            module._precision_gemm = self._wrap(name, module._precision_gemm)

    def _wrap(self, name, gemm):
        from nvfp4_recipe.megatron.parallel_linear import COMPUTE_DTYPE  # deferred: as above

        def wrapped(x, weight, bias):
            out = gemm(x, weight, bias)
            if self.active and torch.is_grad_enabled():
                rec = self.tensors[name] = {"x": x.detach().to(COMPUTE_DTYPE).clone(),
                                            "w": weight.detach().to(COMPUTE_DTYPE).clone()}
                if out.requires_grad:
                    out.register_hook(lambda g: rec.__setitem__(
                        "dy", g.detach().to(COMPUTE_DTYPE).clone()))
            return out

        return wrapped

    def take(self) -> dict[str, dict[str, torch.Tensor]]:
        got, self.tensors = self.tensors, {}
        missing = [n for n, r in got.items() if "dy" not in r]
        if missing or len(got) != len(self.modules):
            raise RuntimeError(f"capture incomplete: {len(got)} of {len(self.modules)} linears, "
                               f"no dY for {missing}")
        return got

    def remove(self) -> None:
        for module in self.modules.values():
            del module._precision_gemm  # back to the class's method
