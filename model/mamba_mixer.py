"""Mamba-2 mixer with megatron-core's parameter layout, runnable on CPU.

Drop-in for ``megatron.core.ssm.mamba_mixer.MambaMixer`` inside megatron's ``MambaLayer``::

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from model.mamba_mixer import MambaMixer, MambaMixerSubmodules

    mixer_spec = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )

megatron's own mixer cannot be used here: its module imports ``triton`` and the ``mamba_ssm``
kernels at import time and its constructor raises without them. This one:

* keeps megatron's parameter names, shapes, TP sharding and distributed-checkpoint layout
  (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``), so
  checkpoints are interchangeable with megatron's mixer;
* on CPU (or when the kernels are missing) runs a pure-PyTorch path: causal depthwise conv1d,
  the chunked SSD scan of :mod:`model.ssd` in float32, gated RMSNorm ``norm(y * silu(z))``;
* on CUDA uses each kernel that loads (lazily), independently: mamba_ssm's Triton SSD scan
  ``mamba_chunk_scan_combined`` and gated ``rmsnorm_fn`` when they load (they need no
  ``causal_conv1d``: mamba v2.3.2.post1 ``ops/triton/ssd_combined.py:21-28``; and no compiled
  mamba_ssm extension either: ``compat.mamba_ssm_triton_kernels`` loads them without the
  package's ``__init__`` when that fails), and ``causal_conv1d_fn`` when ``causal_conv1d``
  imports; the PyTorch path for the rest. ``mamba_kernels_how()`` says which scan runs.

Not supported: inference (``inference_context``), packed sequences, context parallelism > 1,
``D_has_hdim``, ``rmsnorm=False``, ``norm_before_gate=True``, biases in the projections.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import List, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

import compat
from model.recompute import checkpoint_implementation, recompute
from model.ssd import ssd_chunk_scan

__all__ = ["MambaMixer", "MambaMixerSubmodules", "GatedRMSNorm", "mamba_kernels",
           "mamba_kernels_available", "mamba_kernels_how", "mamba_ssm_package_imports"]


@dataclass
class MambaMixerSubmodules:
    """Module specs of the input and output projections (same fields as megatron's dataclass,
    which cannot be imported without triton)."""

    in_proj: Union[ModuleSpec, type] = None
    out_proj: Union[ModuleSpec, type] = None


# --------------------------------------------------------------------------------------------
# GPU kernels (lazy)
# --------------------------------------------------------------------------------------------

_KERNELS = None  # cache: name -> callable, for each kernel that loads
_MAMBA_SSM = (False, "")  # (the mamba_ssm package imports, how its kernels loaded or why not)

# Which package each kernel comes from (the import paths megatron's mixer uses too,
# mc 0.16.1 ssm/mamba_mixer.py:52-71).
KERNEL_PACKAGES = {
    "causal_conv1d_fn": "causal_conv1d",
    "mamba_chunk_scan_combined": "mamba_ssm",
    "rmsnorm_fn": "mamba_ssm",
}


def _load_kernels() -> dict:
    """Load each package's kernels on their own: a GPU with mamba_ssm but no causal_conv1d
    still gets the Triton SSD scan and gated norm (and PyTorch's conv1d), and a mamba_ssm built
    without its CUDA extension still gives its Triton kernels (compat item 8)."""
    global _KERNELS, _MAMBA_SSM
    if _KERNELS is None:
        _KERNELS = {}
        try:  # imported only here, never at module import time
            from causal_conv1d import causal_conv1d_fn

            _KERNELS["causal_conv1d_fn"] = causal_conv1d_fn
        except Exception:  # ImportError, or a broken CUDA build
            pass
        kernels, package, how = compat.mamba_ssm_triton_kernels()
        _KERNELS.update(kernels)
        _MAMBA_SSM = (package, how)
    return _KERNELS


def fused_conv1d_probe() -> tuple[Optional[bool], Optional[str]]:
    """(whether mamba_ssm's fused kernel took causal_conv1d's wrappers, None where its release
    calls the compiled module itself; the installed causal-conv1d version): the values of
    backend.fused_conv1d_usable. Imports the mamba_ssm package: asked only where it imports."""
    from importlib import metadata

    try:
        version = metadata.version("causal-conv1d")
    except metadata.PackageNotFoundError:
        version = None
    try:
        from mamba_ssm.ops.triton import ssd_combined
    except Exception:  # ImportError, or a broken CUDA build
        return False, version
    if hasattr(ssd_combined, "causal_conv1d_fwd_function"):  # mamba-ssm >= 2.2.5
        return ssd_combined.causal_conv1d_fwd_function is not None, version
    return (None if getattr(ssd_combined, "causal_conv1d_cuda", None) is not None else False,
            version)


def mamba_ssm_package_imports() -> bool:
    """Whether the mamba_ssm package itself imports (megatron's mixer on the TE spec needs it)."""
    _load_kernels()
    return _MAMBA_SSM[0]


def mamba_kernels_how(cuda: bool) -> str:
    """Which SSD scan and gated norm the portable mixer runs on a run whose device is a GPU
    (`cuda`), and why: for the start-up line and launch/gpu_check.sh."""
    if not cuda:
        return "PyTorch SSD scan and gated norm (CPU run)"
    kernels = _load_kernels()
    if "mamba_chunk_scan_combined" in kernels:
        return f"mamba_ssm Triton SSD scan and gated norm ({_MAMBA_SSM[1]})"
    return f"PyTorch SSD scan and gated norm ({_MAMBA_SSM[1]})"


def mamba_kernels(cuda: bool) -> dict:
    """The mamba_ssm / causal_conv1d kernels the mixer would use on a run whose device is a GPU
    (`cuda`; none on a CPU run)."""
    return dict(_load_kernels()) if cuda else {}


def mamba_kernels_available(cuda: bool) -> bool:
    """True on a CUDA run where mamba_ssm + causal_conv1d import."""
    return len(mamba_kernels(cuda)) == len(KERNEL_PACKAGES)


# --------------------------------------------------------------------------------------------
# Gated RMSNorm
# --------------------------------------------------------------------------------------------


def gated_rmsnorm(y, z, weight, eps: float, group_size: int):
    """``rmsnorm_grouped(y * silu(z)) * weight`` (mamba_ssm's norm_before_gate=False) in float32
    (float64 for float64 inputs).

    The RMS is taken over contiguous groups of ``group_size`` channels of the last dim.
    """
    dtype = y.dtype
    with torch.autocast(device_type=y.device.type, enabled=False):
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        x = y.to(cdt)
        if z is not None:
            x = x * F.silu(z.to(cdt))
        shp = x.shape
        xg = x.reshape(*shp[:-1], shp[-1] // group_size, group_size)
        xg = xg * torch.rsqrt(xg.pow(2).mean(dim=-1, keepdim=True) + eps)
        out = xg.reshape(shp) * weight.to(cdt)
    return out.to(dtype)


class GatedRMSNorm(nn.Module):
    """Grouped gated RMSNorm with the parameter layout of mamba_ssm's ``RMSNormGated``
    (a single ``weight``, no bias); sharded along dim 0 across TP like megatron's
    ``ExtendedRMSNorm``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-5,
        group_size: Optional[int] = None,
        norm_before_gate: bool = False,
        device=None,
        dtype=None,
        tp_group=None,
    ):
        super().__init__()
        if norm_before_gate:
            raise NotImplementedError("only norm_before_gate=False (megatron's setting)")
        self.eps = eps
        self.group_size = group_size if group_size is not None else hidden_size
        assert hidden_size % self.group_size == 0, (hidden_size, self.group_size)
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.tp_group = tp_group

    def forward(self, y, z=None, use_kernels: bool = False):
        """use_kernels: mamba_ssm's Triton ``rmsnorm_fn`` (it must have imported)."""
        if use_kernels:
            rmsnorm_fn = _load_kernels()["rmsnorm_fn"]
            return rmsnorm_fn(
                y,
                self.weight,
                None,
                z=z,
                eps=self.eps,
                group_size=self.group_size,
                norm_before_gate=False,
            )
        return gated_rmsnorm(y, z, self.weight, self.eps, self.group_size)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Weight sharded along axis 0 across TP."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        tp_group = self.tp_group
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"weight": 0},
            sharded_offsets,
            tp_group=tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, group_size={self.group_size}"


# --------------------------------------------------------------------------------------------
# The mixer
# --------------------------------------------------------------------------------------------


def _tp_shard(full: torch.Tensor, parts: list[int], rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a dim-0 concatenation of `parts`, each split evenly over TP ranks
    (the local layout [x_l, B_l, C_l] of megatron's Mamba parameters)."""
    if size == 1:
        return full
    return torch.cat([p.chunk(size, dim=0)[rank] for p in full.split(parts, dim=0)]).clone()


def _tp_consistent_init(init_method, parts: list[int], tp_size: int):
    """Wrap in_proj's init so every TP size starts from the same logical [z, x, B, C, dt] weight.

    megatron's CPU initialisation draws the full weight and gives rank r the r-th contiguous
    block of rows, which this mixer reads as [z_r, x_r, B_r, C_r, dt_r]. Drawing in the TP=1
    layout and reordering the rows to the concatenation of those per-rank layouts makes the
    contiguous split hand each rank exactly its shard of the TP=1 weight.
    """

    def init(weight: torch.Tensor) -> None:
        init_method(weight)
        if tp_size > 1 and weight.shape[0] == sum(parts) and weight.device.type != "meta":
            pieces = weight.split(parts, dim=0)
            reordered = torch.cat(
                [torch.cat([p.chunk(tp_size, dim=0)[r] for p in pieces]) for r in range(tp_size)]
            )
            weight.copy_(reordered)

    return init


def _param_rng_context():
    """megatron initialises conv1d / dt / A under the model-parallel CUDA RNG fork (distinct
    values per TP rank). Use it when it exists: a CUDA run seeds it (compat.seed_model_parallel_rng);
    a CPU run has no such stream, and draws from the default RNG."""
    try:
        from megatron.core.tensor_parallel.random import (
            _MODEL_PARALLEL_RNG_TRACKER_NAME,
            get_cuda_rng_tracker,
        )

        tracker = get_cuda_rng_tracker()
        if _MODEL_PARALLEL_RNG_TRACKER_NAME in tracker.get_states():
            return tracker.fork()
    except Exception:
        pass
    return contextlib.nullcontext()


class MambaMixer(MegatronModule):
    """Mamba-2 mixer (SSD) — see the module docstring.

    Args mirror megatron-core 0.16's ``MambaMixer``. Sizes come from the config:
    ``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups``, ``mamba_num_heads`` (if None,
    ``nheads = expand * d_model // head_dim``).

    Extra (not in megatron): ``use_kernels`` — None (default): on CUDA inputs use each of the
    mamba_ssm / causal_conv1d kernels that imports; False: always the PyTorch path; True: require
    all of them on CUDA inputs. The gated norm's eps is ``config.layernorm_epsilon`` (megatron
    hard-codes 1e-5: mc 0.16.1 ssm/mamba_mixer.py:357).
    """

    def __init__(
        self,
        config,
        submodules: MambaMixerSubmodules,
        d_model: int,
        d_conv: int = 4,
        conv_init: Optional[float] = None,
        expand: int = 2,
        A_init_range=(1, 16),
        D_has_hdim: bool = False,
        rmsnorm: bool = True,
        norm_before_gate: bool = False,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init: str = "random",
        dt_scale: float = 1.0,
        dt_init_floor: float = 1e-4,
        bias: bool = False,
        conv_bias: bool = True,
        chunk_size: int = 128,
        layer_number: Optional[int] = None,
        use_mem_eff_path=None,  # deprecated in megatron; ignored
        d_state=None,  # deprecated in megatron; the config decides
        headdim=None,  # deprecated in megatron; the config decides
        ngroups=None,  # deprecated in megatron; the config decides
        pg_collection: Optional[ProcessGroupCollection] = None,
        pp_layer_offset: int = 0,
        use_kernels: Optional[bool] = None,
        name: Optional[str] = None,  # megatron >= 0.18 passes the module's name (unused here)
    ):
        super().__init__(config)
        if D_has_hdim:
            raise NotImplementedError("D_has_hdim=True is not supported")
        if not rmsnorm:
            raise NotImplementedError("rmsnorm=False is not supported")
        if norm_before_gate:
            raise NotImplementedError("norm_before_gate=True is not supported (megatron asserts it too)")
        if bias:
            raise NotImplementedError("bias=True is not supported (megatron asserts it too)")

        self.config = config
        self.d_model = d_model
        self.d_conv = d_conv
        self.conv_init = conv_init
        self.expand = expand
        self.d_inner = int(expand * d_model)
        self.D_has_hdim = D_has_hdim
        self.rmsnorm = rmsnorm
        self.norm_before_gate = norm_before_gate
        self.chunk_size = chunk_size
        self.layer_number = layer_number
        self.pp_layer_offset = pp_layer_offset
        self.use_kernels = use_kernels
        self.activation = "silu"

        self._set_process_groups(pg_collection)
        self._set_sizes(config)

        # Parameters are created on the CUDA device unless use_cpu_initialization (then on the
        # ambient default device, so `with torch.device("meta"):` works), as megatron's layers
        # do (mc 0.16.1 tensor_parallel/layers.py:849-880, ColumnParallelLinear). CPU runs always
        # build with it (model/build.py: use_cpu_initialization).
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        params_dtype = config.params_dtype

        # The order below is the order of the random draws: it decides the initial weights.
        self.in_proj = self._build_in_proj(submodules.in_proj, bias)
        self.conv1d = self._build_conv1d(d_conv, conv_bias, device, params_dtype)
        self._create_ssm_parameters(A_init_range, dt_min, dt_max, dt_init_floor, device,
                                    params_dtype)
        self.norm = self._build_norm(device, params_dtype)
        self.out_proj = self._build_out_proj(submodules.out_proj, bias)

    def _set_process_groups(self, pg_collection: Optional[ProcessGroupCollection]) -> None:
        """The TP group from megatron's MambaLayer (it passes pg_collection); built directly,
        the mixer takes megatron's global (mpu) groups."""
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("context parallelism is not supported by this Mamba mixer")

    def _set_sizes(self, config) -> None:
        """Heads, groups and state sizes from the config, in total and on this TP rank."""
        self.d_state = config.mamba_state_dim
        self.headdim = config.mamba_head_dim
        self.ngroups = config.mamba_num_groups
        assert self.d_state is not None and self.d_state > 0
        assert self.headdim is not None and self.headdim > 0
        assert self.ngroups is not None and self.ngroups > 0
        if config.mamba_num_heads is not None:
            self.nheads = config.mamba_num_heads
            assert self.nheads > 0
            self.d_inner = self.nheads * self.headdim
        else:
            assert self.d_inner % self.headdim == 0, "d_inner must be divisible by headdim"
            self.nheads = self.d_inner // self.headdim

        tp_size = self.tp_group.size()
        assert self.nheads % tp_size == 0, "nheads must be divisible by tp_size"
        assert self.ngroups % tp_size == 0, "ngroups must be divisible by tp_size"
        assert self.nheads % self.ngroups == 0, "nheads must be divisible by ngroups"
        self.nheads_local_tp = self.nheads // tp_size
        self.d_inner_local_tp = self.d_inner // tp_size
        self.ngroups_local_tp = self.ngroups // tp_size

    def _build_in_proj(self, spec, bias: bool):
        """z, x, B, C, dt: column parallel, local layout [z_l, x_l, B_l, C_l, dt_l]."""
        return build_module(
            spec,
            self.d_model,
            self.d_inner * 2 + 2 * self.ngroups * self.d_state + self.nheads,
            config=self.config,
            init_method=_tp_consistent_init(
                self.config.init_method,
                [self.d_inner, self.d_inner, self.ngroups * self.d_state,
                 self.ngroups * self.d_state, self.nheads],
                self.tp_group.size(),
            ),
            gather_output=False,
            bias=bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=self.tp_group,
        )

    def _build_conv1d(self, d_conv: int, conv_bias: bool, device, dtype) -> nn.Conv1d:
        """The depthwise causal conv over x, B, C: weight [conv_dim, 1, d_conv], bias [conv_dim]
        (the forward pads causally itself).

        Each per-channel / per-head parameter (here and in _create_ssm_parameters) is drawn at its
        full (TP=1) size and this rank keeps its shard, so a TP=2 model starts from exactly the
        TP=1 weights (megatron's use_cpu_initialization does the same for the linears). Megatron's
        GPU path draws per-rank values under the model-parallel RNG fork instead.
        """
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        conv_dim = self.d_inner_local_tp + 2 * self.ngroups_local_tp * self.d_state  # x B C
        conv_parts = [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state]
        with _param_rng_context():
            conv1d = nn.Conv1d(
                in_channels=conv_dim,
                out_channels=conv_dim,
                bias=conv_bias,
                kernel_size=d_conv,
                groups=conv_dim,
                padding=d_conv - 1,
                device="meta",
                dtype=dtype,
            )
            full_conv = nn.Conv1d(sum(conv_parts), sum(conv_parts), kernel_size=d_conv,
                                  groups=sum(conv_parts), bias=conv_bias, device=device,
                                  dtype=dtype)
            if self.config.perform_initialization:
                if self.conv_init is not None:
                    nn.init.uniform_(full_conv.weight, -self.conv_init, self.conv_init)
                else:
                    nn.init.kaiming_uniform_(full_conv.weight, a=math.sqrt(5))
            conv1d.weight = nn.Parameter(
                _tp_shard(full_conv.weight.data, conv_parts, tp_rank, tp_size))
            setattr(conv1d.weight, "tensor_model_parallel", True)
            if conv_bias:
                conv1d.bias = nn.Parameter(
                    _tp_shard(full_conv.bias.data, conv_parts, tp_rank, tp_size))
                setattr(conv1d.bias, "tensor_model_parallel", True)
        return conv1d

    def _create_ssm_parameters(self, A_init_range, dt_min: float, dt_max: float,
                               dt_init_floor: float, device, dtype) -> None:
        """dt_bias, A_log and D: per head, sharded across TP ranks."""
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        with _param_rng_context():
            # dt_bias: softplus(dt_bias) log-uniform in [dt_min, dt_max], floored
            dt = torch.exp(
                torch.rand(self.nheads, device=device, dtype=dtype)
                * (math.log(dt_max) - math.log(dt_min))
                + math.log(dt_min)
            ).clamp(min=dt_init_floor)
            inv_dt = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            self.dt_bias = nn.Parameter(_tp_shard(inv_dt, [self.nheads], tp_rank, tp_size))
            setattr(self.dt_bias, "tensor_model_parallel", True)

            assert A_init_range[0] > 0 and A_init_range[1] >= A_init_range[0]
            # megatron leaves A uninitialised when perform_initialization=False (log of garbage);
            # we always draw it — it is overwritten by a checkpoint load anyway.
            A = torch.empty(self.nheads, dtype=torch.float32, device=device)
            A.uniform_(*A_init_range)
            self.A_log = nn.Parameter(_tp_shard(torch.log(A), [self.nheads], tp_rank, tp_size))
            setattr(self.A_log, "tensor_model_parallel", True)

        self.D = nn.Parameter(torch.ones(self.nheads_local_tp, device=device))  # fp32
        setattr(self.D, "tensor_model_parallel", True)

    def _build_norm(self, device, dtype) -> GatedRMSNorm:
        """The gated RMSNorm over y * silu(z), per group, sharded across TP ranks."""
        norm = GatedRMSNorm(
            self.d_inner_local_tp,
            eps=self.config.layernorm_epsilon,
            group_size=self.d_inner_local_tp // self.ngroups_local_tp,
            norm_before_gate=False,
            device=device,
            dtype=dtype,
            tp_group=self.tp_group,
        )
        setattr(norm.weight, "tensor_model_parallel", True)
        return norm

    def _build_out_proj(self, spec, bias: bool):
        """d_inner -> d_model, row parallel (its input is already split across TP ranks)."""
        return build_module(
            spec,
            self.d_inner,
            self.d_model,
            config=self.config,
            init_method=self.config.output_layer_init_method,
            bias=bias,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=self.tp_group,
        )

    # ---------------------------------------------------------------------------------------

    def _kernels_for(self, t: torch.Tensor) -> dict:
        """The kernels this call runs (name -> callable); the PyTorch path does the rest."""
        if self.use_kernels is False or not t.is_cuda:
            return {}
        kernels = _load_kernels()
        missing = sorted({pkg for name, pkg in KERNEL_PACKAGES.items() if name not in kernels})
        if self.use_kernels and missing:
            raise RuntimeError(f"use_kernels=True but {' and '.join(missing)} not importable")
        return kernels

    def forward(
        self,
        hidden_states: torch.Tensor,
        inference_context=None,
        *,
        inference_params=None,
        packed_seq_params=None,
        **kwargs,
    ):
        """hidden_states [s, b, h] -> (out [s, b, h], out_bias) (out_proj's skip_bias_add pair)."""
        if inference_context is not None or inference_params is not None:
            raise NotImplementedError("MambaMixer (model.mamba_mixer): inference is not supported")
        if packed_seq_params is not None:
            raise NotImplementedError(
                "MambaMixer (model.mamba_mixer): packed sequences are not supported"
            )
        zxBCdt, _ = self.in_proj(hidden_states)  # [s, b, in_proj_local]
        if (self.config.recompute_granularity == "selective" and self.training
                and torch.is_grad_enabled()):
            # Selective recompute: conv1d, the scan and the gated norm are cheap next to the
            # projections, and the PyTorch scan's chunk intermediates are the layer's largest
            # activations; no random draws happen here (model/recompute.py).
            implementation = checkpoint_implementation(cuda=zxBCdt.is_cuda, te_layers=False)
            y = recompute(self.ssm, zxBCdt, implementation=implementation)
        else:
            y = self.ssm(zxBCdt)  # [s, b, d_inner_local]
        out, out_bias = self.out_proj(y)
        return out, out_bias

    def ssm(self, zxBCdt: torch.Tensor) -> torch.Tensor:
        """[s, b, in_proj_local] (local z, x, B, C, dt) -> gated, normed y [s, b, d_inner_local]."""
        kernels = self._kernels_for(zxBCdt)
        s, b, _ = zxBCdt.shape
        dstate, ng, nh, hd = self.d_state, self.ngroups_local_tp, self.nheads_local_tp, self.headdim
        z, xBC, dt = torch.split(
            zxBCdt, [self.d_inner_local_tp, self.d_inner_local_tp + 2 * ng * dstate, nh], dim=-1
        )

        # Causal depthwise conv over (x, B, C) + SiLU.  [s, b, c] -> [b, c, s]
        xBC = xBC.permute(1, 2, 0)
        w = self.conv1d.weight  # [c, 1, k]
        if "causal_conv1d_fn" in kernels:
            xBC = kernels["causal_conv1d_fn"](
                x=xBC.contiguous(),
                weight=w.squeeze(1),
                bias=self.conv1d.bias,
                activation=self.activation,
            )
        else:
            in_dtype = xBC.dtype
            xBC = F.conv1d(
                F.pad(xBC.to(w.dtype), (self.d_conv - 1, 0)),
                w,
                self.conv1d.bias,
                groups=w.shape[0],
            )
            xBC = F.silu(xBC).to(in_dtype)
        xBC = xBC.permute(0, 2, 1)  # [b, s, c]
        x, B, C = torch.split(xBC, [self.d_inner_local_tp, ng * dstate, ng * dstate], dim=-1)
        x = x.reshape(b, s, nh, hd)
        B = B.reshape(b, s, ng, dstate)
        C = C.reshape(b, s, ng, dstate)
        dt = dt.transpose(0, 1)  # [b, s, nh]
        A_log = self.A_log if self.A_log.dtype == torch.float64 else self.A_log.float()
        A = -torch.exp(A_log)  # fp32 (fp64 if the module was cast to double)

        if "mamba_chunk_scan_combined" in kernels:
            y = kernels["mamba_chunk_scan_combined"](
                x.contiguous(),
                dt.contiguous(),
                A,
                B.contiguous(),
                C.contiguous(),
                chunk_size=self.chunk_size,
                D=self.D,
                z=None,
                dt_bias=self.dt_bias.float(),
                dt_softplus=True,
            )
        else:
            y = ssd_chunk_scan(x, dt, A, B, C, self.chunk_size, D=self.D,
                               dt_bias=self.dt_bias, dt_softplus=True)

        y = y.reshape(b, s, self.d_inner_local_tp).transpose(0, 1)  # [s, b, d_inner_local]
        y = self.norm(y.contiguous(), z.contiguous(), use_kernels="rmsnorm_fn" in kernels)
        return y

    # ---------------------------------------------------------------------------------------

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Sharded state dict with megatron's mixer layout: A_log, D, dt_bias, conv1d and
        norm.weight sharded on dim 0; in_proj.weight split into z/x/B/C/dt and conv1d
        weight/bias into x/B/C, each part TP-sharded on dim 0 (so checkpoints reshard across
        TP sizes)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_cp_group = metadata["dp_cp_group"]

        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded_state_dict = make_sharded_tensors_for_checkpoint(
            own,
            prefix,
            tensor_parallel_layers_axis_map={"A_log": 0, "dt_bias": 0, "D": 0},
            sharded_offsets=sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=dp_cp_group,
        )
        for name, module in self.named_children():
            if name == "conv1d":
                module_sd = make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True),
                    f"{prefix}{name}.",
                    {"weight": 0, "bias": 0},
                    sharded_offsets,
                    tp_group=self.tp_group,
                    dp_cp_group=dp_cp_group,
                )
            else:
                module_sd = sharded_state_dict_default(
                    module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            sharded_state_dict.update(module_sd)

        ng_ds = self.ngroups_local_tp * self.d_state
        in_proj_key = f"{prefix}in_proj.weight"
        in_proj_sections = [
            self.d_inner_local_tp,
            self.d_inner_local_tp,
            ng_ds,
            ng_ds,
            self.nheads_local_tp,
        ]
        assert sharded_state_dict[in_proj_key].data.size(0) == sum(in_proj_sections)
        sharded_state_dict[in_proj_key] = _split_tensor_factory(
            sharded_state_dict[in_proj_key], in_proj_sections, ["z", "x", "B", "C", "dt"], 0
        )
        for key in ("conv1d.weight", "conv1d.bias"):
            full_key = f"{prefix}{key}"
            if full_key not in sharded_state_dict:
                continue
            sharded_state_dict[full_key] = _split_tensor_factory(
                sharded_state_dict[full_key],
                [self.d_inner_local_tp, ng_ds, ng_ds],
                ["x", "B", "C"],
                0,
            )
        return sharded_state_dict


def _split_tensor_factory(
    orig_sh_ten: ShardedTensor, split_sections: List[int], split_names: List[str], split_dim: int
) -> ShardedTensorFactory:
    """A factory that saves a ShardedTensor as independent parts ``<key>.<name>`` (each keeping
    the original TP sharding along ``split_dim``) and concatenates them back on load."""
    assert isinstance(orig_sh_ten, ShardedTensor), type(orig_sh_ten)
    assert isinstance(split_sections, (list, tuple)) and len(split_sections) == len(split_names)
    template = orig_sh_ten.without_data()
    if sum(split_sections) != template.local_shape[split_dim]:
        raise ValueError(
            f"split sections {split_sections} do not cover dim {split_dim} of "
            f"local shape {template.local_shape}"
        )

    @torch.no_grad()
    def build_fn(key, t, replica_id, flattened_range):
        base = replace(
            template,
            key=key,
            data=t,
            dtype=t.dtype,
            replica_id=replica_id,
            flattened_range=flattened_range,
        )
        parts = []
        start = 0
        for size, name in zip(split_sections, split_names):
            for sh_ten in base.narrow(split_dim, start, size):
                sh_ten.key = f"{sh_ten.key}.{name}"
                parts.append(sh_ten)
            start += size
        return parts

    @torch.no_grad()
    def merge_fn(sub_state_dict):
        return torch.cat(sub_state_dict, dim=split_dim)

    return ShardedTensorFactory(
        orig_sh_ten.key, orig_sh_ten.data, build_fn, merge_fn, orig_sh_ten.replica_id
    )
