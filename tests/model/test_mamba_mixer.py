"""Tests of the CPU Mamba-2 mixer (model/mamba_mixer.py) and its chunked SSD scan (model/ssd.py)
(at TP=2 over two processes: tests/system/test_mamba_mixer_tp2.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mamba_reference import TINY, build_mixer, mixer_config, naive_mixer_forward, naive_ssm

from model.ssd import ssd_chunk_scan


@pytest.fixture(autouse=True)
def seeded():
    """Each test draws its random inputs and initial weights from the same seed, whatever ran
    before it."""
    torch.manual_seed(1234)


# ---------------------------------------------------------------------------------------------
# Inputs (the independent references: tests/mamba_reference.py)
# ---------------------------------------------------------------------------------------------


def _rand_scan_inputs(b, l, H, P, G, N, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, l, H, P, generator=g, dtype=dtype)
    dt = torch.rand(b, l, H, generator=g, dtype=dtype) * 0.3 + 0.01
    A = -(torch.rand(H, generator=g, dtype=dtype) * 4 + 0.5)
    B = torch.randn(b, l, G, N, generator=g, dtype=dtype)
    C = torch.randn(b, l, G, N, generator=g, dtype=dtype)
    D = torch.randn(H, generator=g, dtype=dtype)
    h0 = torch.randn(b, H, P, N, generator=g, dtype=dtype)
    return x, dt, A, B, C, D, h0


# ---------------------------------------------------------------------------------------------
# The scan
# ---------------------------------------------------------------------------------------------

FP64_TOL = 1e-10


@pytest.mark.parametrize(
    "seqlen,chunk",
    [(1, 4), (7, 4), (16, 4), (37, 8), (37, 16), (37, 64), (50, 1)],
)
def test_scan_matches_naive_recurrence_fp64(seqlen, chunk):
    """Chunked SSD == step-by-step recurrence (fp64, tol 1e-10), incl. state carried across chunks,
    lengths not divisible by the chunk, ngroups > 1, and the final state."""
    x, dt, A, B, C, D, _ = _rand_scan_inputs(2, seqlen, 6, 5, 3, 4)
    y_ref, h_ref = naive_ssm(x, dt, A, B, C, D)
    y, h = ssd_chunk_scan(x, dt, A, B, C, chunk, D=D, return_final_states=True)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, y_ref, atol=FP64_TOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=FP64_TOL, rtol=0)


def test_scan_initial_states_and_dt_softplus_bias():
    """initial_states, dt_bias + softplus, and the (H,) D are applied like the recurrence."""
    x, dt_raw, A, B, C, D, h0 = _rand_scan_inputs(2, 29, 4, 3, 2, 5, seed=1)
    dt_bias = torch.randn(4, dtype=torch.float64)
    dt = F.softplus(dt_raw + dt_bias)
    y_ref, h_ref = naive_ssm(x, dt, A, B, C, D, h0)
    y, h = ssd_chunk_scan(
        x, dt_raw, A, B, C, 8, D=D, dt_bias=dt_bias, dt_softplus=True,
        initial_states=h0, return_final_states=True,
    )
    torch.testing.assert_close(y, y_ref, atol=FP64_TOL, rtol=0)
    torch.testing.assert_close(h, h_ref, atol=FP64_TOL, rtol=0)


def test_scan_split_sequence_equals_whole():
    """Running two halves with the state handed over == one pass."""
    x, dt, A, B, C, D, _ = _rand_scan_inputs(1, 40, 4, 3, 2, 5, seed=2)
    y, h = ssd_chunk_scan(x, dt, A, B, C, 16, D=D, return_final_states=True)
    y1, h1 = ssd_chunk_scan(x[:, :23], dt[:, :23], A, B[:, :23], C[:, :23], 16, D=D,
                            return_final_states=True)
    y2, h2 = ssd_chunk_scan(x[:, 23:], dt[:, 23:], A, B[:, 23:], C[:, 23:], 16, D=D,
                            initial_states=h1, return_final_states=True)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, atol=FP64_TOL, rtol=0)
    torch.testing.assert_close(h2, h, atol=FP64_TOL, rtol=0)


def test_scan_low_precision_inputs_and_grads():
    """bf16 inputs under autocast: internals in fp32, output in bf16, finite grads; fp32 result
    close to the fp64 reference."""
    x, dt, A, B, C, D, _ = _rand_scan_inputs(2, 300, 4, 8, 2, 16, seed=3)
    y_ref, _ = naive_ssm(x, dt, A, B, C, D)
    y32 = ssd_chunk_scan(x.float(), dt.float(), A.float(), B.float(), C.float(), 128, D=D.float())
    torch.testing.assert_close(y32.double(), y_ref, atol=1e-4, rtol=1e-4)

    xb = x.bfloat16().requires_grad_()
    dtb = dt.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yb = ssd_chunk_scan(xb, dtb, A.float(), B.bfloat16(), C.bfloat16(), 128, D=D.float())
    assert yb.dtype == torch.bfloat16
    assert torch.isfinite(yb).all()
    yb.float().square().sum().backward()
    assert torch.isfinite(xb.grad).all() and torch.isfinite(dtb.grad).all()
    assert xb.grad.abs().sum() > 0 and dtb.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# The mixer
# ---------------------------------------------------------------------------------------------

def test_mixer_shapes_and_layout(parallel_context):
    cfg = mixer_config(**TINY)
    m = build_mixer(cfg)
    d_in, gn, H = 8 * 16, 2 * 16, 8
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "in_proj.weight": (2 * d_in + 2 * gn + H, 64),
        "conv1d.weight": (d_in + 2 * gn, 1, 4),
        "conv1d.bias": (d_in + 2 * gn,),
        "dt_bias": (H,),
        "A_log": (H,),
        "D": (H,),
        "norm.weight": (d_in,),
        "out_proj.weight": (64, d_in),
    }
    # init ranges (megatron's)
    A = torch.exp(m.A_log)
    assert ((A >= 1) & (A <= 16)).all() and m.A_log.dtype == torch.float32
    dt = F.softplus(m.dt_bias)
    assert ((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all()
    assert torch.equal(m.D, torch.ones(H)) and torch.equal(m.norm.weight, torch.ones(d_in))
    assert m.norm.group_size == d_in // 2
    for n in ("conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
        assert getattr(m.get_parameter(n), "tensor_model_parallel", False), n


@pytest.mark.parametrize("seqlen", [37, 64])
def test_mixer_forward_matches_naive_reference(parallel_context, seqlen):
    """fp64 mixer forward (chunk 16, padded last chunk when s=37) == naive reference, tol 1e-10;
    out_bias is None (bias=False, skip_bias_add=True)."""
    cfg = mixer_config(**TINY)
    m = build_mixer(cfg, chunk_size=16).double()
    with torch.no_grad():  # non-trivial norm / D so they are exercised
        m.norm.weight.uniform_(0.5, 1.5)
        m.D.uniform_(-1, 1)
    h = torch.randn(seqlen, 3, 64, dtype=torch.float64)
    out, bias = m(h)
    assert bias is None and out.shape == (seqlen, 3, 64) and out.dtype == torch.float64
    ref = naive_mixer_forward(m, h)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)

    # causality: perturbing step t leaves outputs before t unchanged
    h2 = h.clone()
    h2[20:] += 1.0
    out2, _ = m(h2)
    torch.testing.assert_close(out2[:20], out[:20], atol=1e-12, rtol=0)
    assert (out2[20:] - out[20:]).abs().max() > 1e-3


def test_mixer_fp32_and_grads(parallel_context):
    """fp32 forward close to the fp64 reference; every parameter gets a finite nonzero grad."""
    cfg = mixer_config(**TINY)
    m = build_mixer(cfg, chunk_size=16)
    h = torch.randn(45, 2, 64, requires_grad=True)
    out, _ = m(h)
    m64 = build_mixer(cfg, chunk_size=16).double()
    m64.load_state_dict(m.state_dict())
    ref = naive_mixer_forward(m64, h.detach().double())
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)

    (out * torch.randn_like(out)).sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    for n, p in m.named_parameters():
        assert p.grad is not None, n
        assert torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


def test_mixer_bf16_autocast(parallel_context):
    cfg = mixer_config(**TINY)
    m = build_mixer(cfg, chunk_size=16)
    h = torch.randn(40, 2, 64)
    ref, _ = m(h)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = m(h)
    assert torch.isfinite(out).all()
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_mixer_rejects_inference_and_packing(parallel_context):
    m = build_mixer(mixer_config(**TINY))
    h = torch.randn(5, 1, 64)
    with pytest.raises(NotImplementedError, match="inference"):
        m(h, inference_context=object())
    with pytest.raises(NotImplementedError, match="packed"):
        m(h, packed_seq_params=object())


def test_mixer_12b_param_count_on_meta(parallel_context):
    """Nemotron-H 12B Mamba-2 mixer shape, built on the meta device."""
    cfg = mixer_config(hidden=5120, heads=128, head_dim=80, state=128, groups=8)
    with torch.device("meta"):
        m = build_mixer(cfg)
    assert all(p.device.type == "meta" for p in m.parameters())
    expected = (
        115_998_720  # in_proj 5120 x (2*10240 + 2*8*128 + 128)
        + (10240 + 2048) * 4 + 12288  # conv1d weight + bias
        + 52_428_800  # out_proj 10240 x 5120
        + 3 * 128  # A_log, D, dt_bias
        + 10240  # gated norm
    )
    assert sum(p.numel() for p in m.parameters()) == expected
    assert m.in_proj.weight.shape == (22656, 5120)
    assert m.norm.group_size == 1280


def test_mixer_sharded_state_dict_tp1(parallel_context):
    """Keys and global shapes as megatron's MambaMixer.sharded_state_dict produces them
    (in_proj.weight split z/x/B/C/dt, conv1d split x/B/C); factories round-trip."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedTensor,
        ShardedTensorFactory,
        apply_factories,
    )

    cfg = mixer_config(**TINY)
    m = build_mixer(cfg)
    prefix = "decoder.layers.0.mixer."
    sd = m.sharded_state_dict(prefix=prefix)
    assert isinstance(sd[f"{prefix}in_proj.weight"], ShardedTensorFactory)
    assert isinstance(sd[f"{prefix}conv1d.weight"], ShardedTensorFactory)
    assert isinstance(sd[f"{prefix}conv1d.bias"], ShardedTensorFactory)

    # factory round trip: parts concatenated back == parameter
    for key, param in (("in_proj.weight", m.in_proj.weight), ("conv1d.weight", m.conv1d.weight),
                       ("conv1d.bias", m.conv1d.bias)):
        fac = sd[f"{prefix}{key}"]
        parts = fac.build()
        merged = fac.merge_fn([p.data for p in parts])
        assert torch.equal(merged, param.detach())

    apply_factories(sd)
    flat = {}

    def walk(d):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif isinstance(v, list):
                for e in v:
                    flat[e.key] = e
            else:
                flat[k] = v

    walk(sd)
    tensors = {k: tuple(v.global_shape) for k, v in flat.items() if isinstance(v, ShardedTensor)}
    d_in, gn, H, hid = 128, 32, 8, 64
    assert tensors == {
        f"{prefix}A_log": (H,),
        f"{prefix}D": (H,),
        f"{prefix}dt_bias": (H,),
        f"{prefix}conv1d.weight.x": (d_in, 1, 4),
        f"{prefix}conv1d.weight.B": (gn, 1, 4),
        f"{prefix}conv1d.weight.C": (gn, 1, 4),
        f"{prefix}conv1d.bias.x": (d_in,),
        f"{prefix}conv1d.bias.B": (gn,),
        f"{prefix}conv1d.bias.C": (gn,),
        f"{prefix}in_proj.weight.z": (d_in, hid),
        f"{prefix}in_proj.weight.x": (d_in, hid),
        f"{prefix}in_proj.weight.B": (gn, hid),
        f"{prefix}in_proj.weight.C": (gn, hid),
        f"{prefix}in_proj.weight.dt": (H, hid),
        f"{prefix}norm.weight": (d_in,),
        f"{prefix}out_proj.weight": (hid, d_in),
    }
    # TP-sharded axis recorded for the per-head / per-channel tensors (axis 0)
    for k in ("A_log", "D", "dt_bias", "norm.weight", "in_proj.weight.z", "conv1d.bias.x"):
        st = flat[f"{prefix}{k}"]
        assert st.axis_fragmentations[0] == 1  # TP=1
    # remaining (non-tensor) entries are only the linears' extra states
    others = set(flat) - set(tensors)
    assert others <= {f"{prefix}in_proj._extra_state", f"{prefix}out_proj._extra_state"}, others


def test_mixer_inside_megatron_mamba_layer(parallel_context):
    """Drop-in: megatron's MambaLayer builds it from a ModuleSpec (with pg_collection) and runs
    forward/backward; sharded_state_dict keys come out under `mixer.`."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from model.mamba_mixer import MambaMixer, MambaMixerSubmodules

    cfg = mixer_config(**TINY, normalization="RMSNorm", hidden_dropout=0.0)
    spec = ModuleSpec(
        module=MambaLayer,
        submodules=MambaLayerSubmodules(
            norm=WrappedTorchNorm,
            mixer=ModuleSpec(
                module=MambaMixer,
                submodules=MambaMixerSubmodules(
                    in_proj=ColumnParallelLinear, out_proj=RowParallelLinear
                ),
            ),
            mamba_bda=get_bias_dropout_add,
        ),
    )
    pg = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
    layer = build_module(spec, cfg, layer_number=1, pg_collection=pg)
    assert isinstance(layer.mixer, MambaMixer)
    h = torch.randn(33, 2, 64, requires_grad=True)
    out = layer(h)
    assert out.shape == h.shape
    out.square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layer.parameters())
    keys = set(layer.sharded_state_dict(prefix="decoder.layers.0.").keys())
    assert "decoder.layers.0.mixer.in_proj.weight" in keys
    assert "decoder.layers.0.mixer.A_log" in keys and "decoder.layers.0.norm.weight" in keys


def test_kernel_path_plumbing_with_fake_kernels(parallel_context, monkeypatch):
    """The CUDA path's calls (causal_conv1d_fn, mamba_chunk_scan_combined, rmsnorm_fn), run with
    CPU stand-ins that check the kernels' documented argument layouts, == the PyTorch path.

    The stand-ins compute in float64 from the kernels' definitions (tap loop, step-by-step
    recurrence, grouped gated RMS norm), sharing no code with the mixer's own conv, chunked scan
    or norm, so a fault in either side shows."""
    import model.mamba_mixer as mm

    calls = []

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None,
                         return_final_states=False, final_states_out=None, activation=None):
        b, d, l = x.shape  # (batch, dim, seqlen)
        assert weight.shape == (d, weight.shape[1]) and bias.shape == (d,)
        assert x.is_contiguous() and activation in ("silu", "swish")
        calls.append("conv")
        k = weight.shape[1]
        out = bias.double()[None, :, None].repeat(b, 1, l)
        for j in range(k):  # out[t] = bias + sum_j w[:, j] * x[t - (k-1) + j], zero before 0
            shift = k - 1 - j
            if shift < l:
                out[..., shift:] += weight[:, j, None].double() * x[..., :l - shift].double()
        return (out * torch.sigmoid(out)).to(x.dtype)

    def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None,
                                  initial_states=None, seq_idx=None, cu_seqlens=None,
                                  dt_softplus=False, dt_limit=(0.0, float("inf")),
                                  return_final_states=False, return_varlen_states=False):
        b, l, h, p = x.shape
        assert dt.shape == (b, l, h) and A.shape == (h,) and B.shape[:2] == (b, l)
        assert C.shape == B.shape and D.shape == (h,) and dt_bias.shape == (h,)
        assert z is None and dt_softplus and A.dtype == torch.float32 and chunk_size == 16
        calls.append("scan")
        dt = torch.log1p(torch.exp(dt.double() + dt_bias.double()))  # softplus
        y, _ = naive_ssm(x.double(), dt, A.double(), B.double(), C.double(), D.double())
        return y.to(x.dtype)

    def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        assert bias is None and norm_before_gate is False and z.shape == x.shape
        calls.append("norm")
        gated = x.double() * z.double() * torch.sigmoid(z.double())
        groups = gated.reshape(*x.shape[:-1], -1, group_size)
        groups = groups / torch.sqrt(groups.pow(2).mean(-1, keepdim=True) + eps)
        return (groups.reshape(x.shape) * weight.double()).to(x.dtype)

    m = build_mixer(mixer_config(**TINY), chunk_size=16)
    h = torch.randn(37, 2, 64)
    ref, _ = m(h)
    kernels = dict(causal_conv1d_fn=causal_conv1d_fn,
                   mamba_chunk_scan_combined=mamba_chunk_scan_combined, rmsnorm_fn=rmsnorm_fn)
    monkeypatch.setattr(mm, "_KERNELS", kernels)
    # Each subset a machine can have: mamba_ssm without causal_conv1d, causal_conv1d alone, both.
    for present, expected in ((("mamba_chunk_scan_combined", "rmsnorm_fn"), ["scan", "norm"]),
                              (("causal_conv1d_fn",), ["conv"]),
                              (tuple(kernels), ["conv", "scan", "norm"])):
        calls.clear()
        subset = {name: kernels[name] for name in present}
        monkeypatch.setattr(mm.MambaMixer, "_kernels_for", lambda self, t, _k=subset: _k)
        out, _ = m(h)
        assert calls == expected, present
        # float32 mixer vs float64 stand-ins: float32 rounding over 37 steps of O(1) outputs.
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


def _fake_module(name, **attrs):
    import types

    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def test_kernels_import_per_package(monkeypatch):
    """mamba_ssm's scan and norm load without causal_conv1d, and causal_conv1d without mamba_ssm
    (they used to load only together, so one missing package disabled both)."""
    import sys

    import model.mamba_mixer as mm

    def scan(*a, **k):
        pass

    def norm(*a, **k):
        pass

    def conv(*a, **k):
        pass

    mamba_ssm = {"mamba_ssm": _fake_module("mamba_ssm"),
                 "mamba_ssm.ops": _fake_module("mamba_ssm.ops"),
                 "mamba_ssm.ops.triton": _fake_module("mamba_ssm.ops.triton"),
                 "mamba_ssm.ops.triton.ssd_combined": _fake_module(
                     "mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=scan),
                 "mamba_ssm.ops.triton.layernorm_gated": _fake_module(
                     "mamba_ssm.ops.triton.layernorm_gated", rmsnorm_fn=norm)}
    for name, module in mamba_ssm.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # import raises
    monkeypatch.setattr(mm, "_KERNELS", None)
    assert mm._load_kernels() == {"mamba_chunk_scan_combined": scan, "rmsnorm_fn": norm}

    for name in mamba_ssm:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "causal_conv1d", _fake_module("causal_conv1d",
                                                                   causal_conv1d_fn=conv))
    monkeypatch.setattr(mm, "_KERNELS", None)
    assert mm._load_kernels() == {"causal_conv1d_fn": conv}


def test_use_kernels_true_names_the_missing_package(parallel_context, monkeypatch):
    import types

    import model.mamba_mixer as mm

    monkeypatch.setattr(mm, "_KERNELS", {"mamba_chunk_scan_combined": None, "rmsnorm_fn": None})
    cuda_input = types.SimpleNamespace(is_cuda=True)
    with pytest.raises(RuntimeError, match="use_kernels=True but causal_conv1d not importable"):
        build_mixer(mixer_config(**TINY), use_kernels=True)._kernels_for(cuda_input)
    assert set(build_mixer(mixer_config(**TINY))._kernels_for(cuda_input)) == {
        "mamba_chunk_scan_combined", "rmsnorm_fn"}
    assert build_mixer(mixer_config(**TINY))._kernels_for(torch.zeros(1)) == {}  # CPU: PyTorch path


def test_gated_norm_eps_is_the_configs_layernorm_epsilon(parallel_context):
    """megatron hard-codes 1e-5 (mc 0.16.1 ssm/mamba_mixer.py:357); ours follows the config."""
    from model.mamba_mixer import gated_rmsnorm

    m = build_mixer(mixer_config(**TINY, layernorm_epsilon=1e-3))
    assert m.norm.eps == 1e-3
    y, z = torch.randn(5, 2, 128), torch.randn(5, 2, 128)  # d_inner 128 in 2 groups of 64
    torch.testing.assert_close(m.norm(y, z), gated_rmsnorm(y, z, m.norm.weight, 1e-3, 64))
