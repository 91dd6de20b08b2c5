"""BF16 weights and activations, FP32 main grads and master weights.

The objects are megatron's on GPUs and their CPU twins here; these tests pin the twins to the
semantics megatron's promise (and an independent AdamW reference), and the GPU wiring to the
configuration Megatron-LM uses.
"""

from __future__ import annotations

import pytest
import torch

from model.build import build_model
from model.config import ModelConfig
from nvfp4_recipe.policy import PrecisionConfig
from training import ddp_optimizer as mp
from training.config import TrainerConfig


def _model(precision: str = "nvfp4"):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256)
    return build_model(cfg, PrecisionConfig(name=precision, format=precision), vocab_size=256,
                       backend="emulated", params_dtype=mp.PARAMS_DTYPE).module


def test_every_gemm_receives_bf16_and_grads_accumulate_in_fp32(parallel_context):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from model.attention import SDPACoreAttention

    model, optimizer = mp.build_data_parallel_model(_model(), TrainerConfig(), parallel_context)
    seen = {}

    def record(name):
        def hook(_module, args, kwargs):
            first = args[0] if args else next(iter(kwargs.values()))
            seen[name] = first.dtype
        return hook

    for name, module in model.module.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, SDPACoreAttention)):
            module.register_forward_pre_hook(record(name), with_kwargs=True)
    tokens = torch.randint(0, 256, (2, 64))
    loss = model(tokens, None, None, labels=tokens)
    assert loss.dtype == torch.float32  # Float16Module: fp32 outputs on the last stage
    loss.mean().backward()
    assert len(seen) >= 12 and set(seen.values()) == {torch.bfloat16}, seen
    params = list(model.module.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert all(p.grad is None and p.main_grad.dtype == torch.float32 for p in params)
    assert any(p.main_grad.abs().sum() > 0 for p in params)
    masters = [p for g in optimizer.param_groups for p in g["params"]]
    assert {p.dtype for p in masters} == {torch.float32}
    assert sum(p.numel() for p in masters) == sum(p.numel() for p in params)


def test_twin_step_matches_adamw_on_fp32_master_weights(parallel_context):
    """Two micro-batches accumulated in FP32, clipped, AdamW on FP32 masters, BF16 copies back."""
    from training.lr_schedule import WSDScheduler

    torch.manual_seed(1)
    inner = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.LayerNorm(48),
                                torch.nn.Linear(48, 8)).to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_() for p in inner.parameters()]
    model = mp.BufferedDataParallel(inner)
    tr = TrainerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0, grad_clip=0.05)
    optimizer = mp.MixedPrecisionOptimizer(model, lr=tr.lr, weight_decay=tr.weight_decay,
                                           betas=(0.9, 0.95), eps=1e-8)
    WSDScheduler(optimizer, tr)
    xs = [torch.randn(4, 32, dtype=torch.bfloat16) for _ in range(2)]
    for x in xs:
        model(x).float().pow(2).mean().backward()
    optimizer.prepare_grads()
    norm = optimizer.clip_grad_norm(tr.grad_clip)
    optimizer.step_with_ready_grads()

    # Reference: the same BF16 forward/backward, grads summed in FP32, torch AdamW, megatron's
    # clip coefficient; weight decay only on the 2-D weights.
    grads = [torch.zeros_like(r) for r in reference]
    for x in xs:
        inner.zero_grad()
        bf16 = [p.detach().clone().requires_grad_() for p in reference]
        out = torch.func.functional_call(
            inner, {n: b.to(torch.bfloat16) for (n, _), b in zip(inner.named_parameters(), bf16)},
            (x,))
        g = torch.autograd.grad(out.float().pow(2).mean(),
                                [b for b in bf16])  # w.r.t. the bf16 values, in fp32
        for acc, gi in zip(grads, g):
            acc += gi
    expected_norm = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
    assert norm == pytest.approx(expected_norm, rel=1e-5)
    ref_opt = torch.optim.AdamW(
        [{"params": [r for r in reference if r.ndim == 2], "weight_decay": 0.1},
         {"params": [r for r in reference if r.ndim < 2], "weight_decay": 0.0}],
        lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for r, g in zip(reference, grads):
        r.grad = g * min(1.0, tr.grad_clip / (expected_norm + 1e-6))
    ref_opt.step()
    masters = [m for *_, m in optimizer.pieces]
    for r, m, p in zip(reference, masters, inner.parameters()):
        # Summation order of the BF16 backward differs (functional call vs module): ~1 ulp.
        torch.testing.assert_close(m.view(r.shape), r.detach(), rtol=2e-3, atol=2e-5)
        assert torch.equal(p.detach(), m.detach().view(r.shape).to(torch.bfloat16))


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_shard_layout_covers_each_element_exactly_once(shards):
    numels = [7, 1, 12, 5]
    owners = [[0] * n for n in numels]
    for r in range(shards):
        layout = mp.ShardLayout.build(numels, shards, r)
        assert layout.padded_total % shards == 0 and layout.padded_total - layout.total < shards
        for i in range(len(numels)):
            owned = layout.owned(i)
            if owned:
                for k in range(*owned):
                    owners[i][k] += 1
    assert all(count == 1 for per_param in owners for count in per_param)


def test_no_weight_decay_rule_is_megatrons():
    assert mp.is_no_weight_decay("decoder.layers.0.mixer.A_log", torch.zeros(4))
    assert mp.is_no_weight_decay("x.linear_qkv.bias", torch.zeros(4, 4))
    assert not mp.is_no_weight_decay("decoder.layers.0.mixer.in_proj.weight", torch.zeros(4, 4))


def test_optimizer_bytes_halve_with_the_distributed_optimizer():
    """8 parameters' worth of master + moments at DP=1; half of it per rank at DP=2."""
    class Groups:
        def __init__(self, sizes):
            self.param_groups = [{"params": [torch.zeros(n) for n in sizes]}]

    assert mp.optimizer_state_bytes(Groups([8])) == 8 * 12
    assert mp.optimizer_state_bytes(Groups([4])) * 2 == mp.optimizer_state_bytes(Groups([8]))


def test_gpu_wiring_is_megatron_lm_bf16(monkeypatch):
    """On CUDA: megatron's DDP (FP32 grad reduce, overlapped) and get_megatron_optimizer (bf16,
    FP32 master weights, distributed when asked), and the schedule hooks Megatron-LM sets.

    Both megatron objects need CUDA, so they are replaced by recorders; each recorded call is
    bound to the installed megatron's real signature, so a renamed or missing argument fails
    here as it would on a GPU, and the hooks must be attributes the real classes have."""
    import inspect

    import megatron.core.distributed as mcd
    import megatron.core.optimizer as mco

    from model.build import transformer_config

    real_ddp, real_get_optimizer = mcd.DistributedDataParallel, mco.get_megatron_optimizer
    calls = {}

    class RecordedDDP:
        def __init__(self, *args, **kwargs):
            calls["ddp"] = inspect.signature(real_ddp).bind(*args, **kwargs).arguments
            self.no_sync, self.start_grad_sync = object(), object()

    class RecordedOptimizer:
        def __init__(self, *args, **kwargs):
            calls["opt"] = inspect.signature(real_get_optimizer).bind(*args, **kwargs).arguments
            self.scale_loss = object()

    monkeypatch.setattr(mcd, "DistributedDataParallel", RecordedDDP)
    monkeypatch.setattr(mco, "get_megatron_optimizer", RecordedOptimizer)
    config = transformer_config(ModelConfig(vocab_size=256), initialize=False)
    module = torch.nn.Linear(2, 2)
    model, optimizer = mp._megatron_ddp_and_optimizer(
        module, config, TrainerConfig(distributed_optimizer=True, grad_clip=0.5))

    ddp_call, opt_call = calls["ddp"], calls["opt"]
    assert ddp_call["config"] is config and ddp_call["module"] is module
    ddp = ddp_call["ddp_config"]
    assert isinstance(ddp, mcd.DistributedDataParallelConfig)
    assert ddp.grad_reduce_in_fp32 and ddp.overlap_grad_reduce and ddp.use_distributed_optimizer
    assert opt_call["model_chunks"] == [model]
    opt_config = opt_call["config"]
    assert isinstance(opt_config, mco.OptimizerConfig)
    assert opt_config.bf16 and opt_config.params_dtype == torch.bfloat16
    assert opt_config.use_distributed_optimizer and opt_config.clip_grad == 0.5
    assert opt_config.optimizer == "adam"
    # The hooks the schedule calls, taken from attributes megatron's classes really have.
    assert callable(real_ddp.no_sync) and callable(real_ddp.start_grad_sync)
    assert callable(mco.MegatronOptimizer.scale_loss)
    assert config.no_sync_func is model.no_sync and config.grad_sync_func is model.start_grad_sync
    assert config.grad_scale_func is optimizer.scale_loss
    assert mp.uses_megatron_ddp(torch.device("cuda", 0))
    assert not mp.uses_megatron_ddp(torch.device("cpu"))


def test_optimizer_layouts_that_cannot_load_each_other_are_refused(tmp_path):
    """megatron's two optimizers and the CPU twin write different keys: a resume across them is
    refused with the reason, before anything is read (the CPU twin reads its own either way)."""
    import json

    from training.checkpoint import MANIFEST, load_checkpoint

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert mp.optimizer_checkpoint_format(cpu, True) == mp.optimizer_checkpoint_format(cpu, False)
    assert mp.optimizer_checkpoint_format(gpu, True) != mp.optimizer_checkpoint_format(gpu, False)
    (tmp_path / MANIFEST).write_text(json.dumps({"optimizer_format": "megatron-distributed"}))
    with pytest.raises(ValueError, match="'megatron-distributed' layout.*'cpu-twin'"):
        load_checkpoint(tmp_path, None, None, None, "cpu-twin")


def test_a_group_of_one_leaves_the_environment_to_child_processes(parallel_context):
    """A rendezvous port in os.environ would be inherited by every process started later (the
    test suite's trainers all tried to listen on the in-process group's port)."""
    import os

    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT"} & set(os.environ)


def test_expert_parameters_get_their_own_buffer_and_every_piece_one_master(parallel_context):
    """As megatron's DDP (distributed_data_parallel.py:106-126, core 0.16.1): the routed experts'
    weights (allreduce=False) in a second flat buffer, after the dense one; the router, the
    shared expert and everything else dense. Every element has one FP32 master, and a step
    writes each master back into its own buffer."""
    from hf_helpers import TINY_MOE

    torch.manual_seed(0)
    core = build_model(ModelConfig(vocab_size=256, pattern="ME*E", moe=TINY_MOE),
                       PrecisionConfig(name="bf16", format="bf16"), vocab_size=256, backend="emulated", params_dtype=mp.PARAMS_DTYPE).module
    routed = [p for n, p in core.named_parameters() if ".mlp.experts.local_experts." in n]
    # at EP=1 megatron leaves every weight to the data-parallel all-reduce; at EP > 1 it marks
    # the routed experts' (tensor_parallel/layers.py:886), as here
    assert routed and all(getattr(p, "allreduce", True) for p in routed)
    for p in routed:
        p.allreduce = False
    model, optimizer = mp.build_data_parallel_model(core, TrainerConfig(), parallel_context)
    dense, experts = model.buffers
    names = {id(p): n for n, p in model.module.named_parameters()}
    expert_names = [names[id(p)] for p in experts.params]
    assert expert_names and all(".mlp.experts.local_experts." in n for n in expert_names)
    assert not any(".mlp.experts.local_experts." in names[id(p)] for p in dense.params)
    assert (dense.expert, experts.expert) == (False, True)
    assert model.params == dense.params + experts.params
    assert sum(b - a for _, a, b, _ in optimizer.pieces) == sum(p.numel() for p in model.params)
    for buffer in model.buffers:
        buffer.grad_data.normal_()
    before = [b.param_data.clone() for b in model.buffers]
    optimizer.step()
    for (i, a, b, master), expert in zip(optimizer.pieces, optimizer.is_expert):
        p = model.params[i]
        assert p.data.view(-1)[a:b].equal(master.detach().to(mp.PARAMS_DTYPE))
        assert p.data.data_ptr() >= model.buffers[int(expert)].param_data.data_ptr()
    assert all(not b.param_data.equal(old) for b, old in zip(model.buffers, before))
    # One process: the norm sums both buffers' squares once.
    expected = torch.cat([b.grad_data for b in model.buffers]).double().norm().item()
    assert optimizer.get_grad_norm() == pytest.approx(expected, rel=1e-6)
