"""An MoE layer at expert parallel 2 over two gloo processes (parallel.expert_model_parallel_size,
megatron's all-to-all token dispatcher on CPU, over gloo): each rank holds half the experts, routes its own
tokens, and its output, its input gradient and its experts' weight gradients equal the rule
computed with every expert on every rank's tokens, as expert parallel 1 does
(tests/model/test_moe.py::test_the_moe_layer_routes_as_the_rule)."""

from __future__ import annotations

import os
import sys

import torch

# The spawned workers import this module again: the repository and tests/ must be on their path.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(_TESTS)
for _p in (_ROOT, _TESTS, os.path.join(_TESTS, "model")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from helpers import free_port  # noqa: E402


def _inputs(rank: int) -> torch.Tensor:
    """Rank `rank`'s micro-batch of hidden states [s, b, h] (every worker can rebuild any)."""
    return torch.randn(16, 2, 64, generator=torch.Generator().manual_seed(100 + rank))


def _full_weights(moe) -> dict[str, torch.Tensor]:
    """Every expert's weights (global index), the router's and the shared expert's, from a
    seed: the same on both ranks."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g) * 0.1  # noqa: E731
    weights = {"router": r(moe.num_experts, 64),
               "shared_fc1": r(moe.shared_expert_ffn_hidden_size, 64),
               "shared_fc2": r(64, moe.shared_expert_ffn_hidden_size)}
    for e in range(moe.num_experts):
        weights[f"{e}.fc1"] = r(moe.ffn_hidden_size, 64)
        weights[f"{e}.fc2"] = r(64, moe.ffn_hidden_size)
    return weights


def _reference(weights, x, moe, grads: bool):
    """The rule (test_moe.reference_moe) on plain tensors, with autograd to the expert weights."""
    import torch.nn.functional as F

    def lin(a, w):
        return F.linear(a.bfloat16(), w.bfloat16()).float()

    tokens = x.reshape(-1, x.shape[-1])
    scores = torch.sigmoid(tokens @ weights["router"].t())
    chosen = torch.topk(scores, moe.topk, dim=-1).indices
    probs = scores.gather(1, chosen)
    probs = probs / probs.sum(-1, keepdim=True) * moe.topk_scaling_factor
    out = torch.zeros_like(tokens)
    for e in range(moe.num_experts):
        rows, slot = torch.nonzero(chosen == e, as_tuple=True)
        hidden = torch.relu(lin(tokens[rows], weights[f"{e}.fc1"])) ** 2
        out = out.index_add(0, rows, lin(hidden * probs[rows, slot, None], weights[f"{e}.fc2"]))
    out = out + lin(torch.relu(lin(tokens, weights["shared_fc1"])) ** 2, weights["shared_fc2"])
    return out.reshape(x.shape)


def _ep_worker(rank, world, port):
    import dataclasses

    from compat import cpu_sequence_parallel_buffers
    from model.build import build_model
    from nvfp4_recipe.policy import PrecisionConfig
    from test_moe import MOE, TINY
    from training.distributed import init_distributed, shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_distributed(1, 1, "gloo", expert_parallel=world)
    try:
        moe = dataclasses.replace(MOE, expert_bias=False)
        model = dataclasses.replace(TINY, moe=moe)
        built = build_model(model, PrecisionConfig(), vocab_size=256, backend="emulated")
        layer = built.module.decoder.layers[1].mlp
        local = moe.num_experts // world
        assert len(layer.experts.local_experts) == local
        # The policy's names are global: this rank holds experts rank*local .. rank*local+local-1.
        held = {h.name for h in built.linears if h.name.startswith("layers.1.mlp.experts.")}
        assert held == {f"layers.1.mlp.experts.local_experts.{rank * local + j}.linear_fc{k}"
                        for j in range(local) for k in (1, 2)}
        weights = _full_weights(moe)
        with torch.no_grad():
            layer.router.weight.copy_(weights["router"])
            layer.shared_experts.linear_fc1.weight.copy_(weights["shared_fc1"])
            layer.shared_experts.linear_fc2.weight.copy_(weights["shared_fc2"])
            for j, expert in enumerate(layer.experts.local_experts):
                expert.linear_fc1.weight.copy_(weights[f"{rank * local + j}.fc1"])
                expert.linear_fc2.weight.copy_(weights[f"{rank * local + j}.fc2"])

        x = _inputs(rank).requires_grad_(True)
        # as the trainer's CPU schedule runs an expert-parallel model (training/schedules.py)
        with cpu_sequence_parallel_buffers(True, cuda=False):
            out, _ = layer(x)
            probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(200 + rank))
            (out * probe).sum().backward()

        # The rule with every expert, on this rank's tokens and on both ranks' for the gradients
        # of the weights this rank holds (each expert saw both ranks' tokens).
        ref_w = {k: v.clone().requires_grad_(True) for k, v in weights.items()}
        total = 0
        for r in range(world):
            xr = _inputs(r).requires_grad_(True)
            ref = _reference(ref_w, xr, moe, grads=True)
            pr = torch.randn(ref.shape, generator=torch.Generator().manual_seed(200 + r))
            total = total + (ref * pr).sum()
            if r == rank:
                ref_out, ref_x = ref, xr
        total.backward()
        scale = ref_out.abs().max()
        # BF16 GEMMs on both sides in the same order per token; the sums over experts and ranks
        # differ in order: a few BF16 ulps of the output's scale.
        torch.testing.assert_close(out, ref_out.detach(), atol=2e-2 * scale.item(), rtol=0)
        g_scale = ref_x.grad.abs().max().item()
        torch.testing.assert_close(x.grad, ref_x.grad, atol=3e-2 * g_scale, rtol=0)
        for j, expert in enumerate(layer.experts.local_experts):
            e = rank * local + j
            for fc in ("fc1", "fc2"):
                ours = getattr(expert, f"linear_{fc}").weight.grad
                theirs = ref_w[f"{e}.{fc}"].grad
                torch.testing.assert_close(ours, theirs, rtol=0,
                                           atol=3e-2 * theirs.abs().max().item())
    finally:
        shutdown()


def test_expert_parallel_2_equals_every_expert_on_one_rank():
    """EP=2 (2 gloo processes, data parallel 2): each rank's MoE output, input gradient and its
    experts' weight gradients equal the rule with all four experts over both ranks' tokens."""
    import torch.multiprocessing as mp

    mp.spawn(_ep_worker, args=(2, free_port()), nprocs=2, join=True)
