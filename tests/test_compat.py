"""Each item of compat.py, checked against the installed megatron-core.

These fail when upstream changes what a work-around relies on, so it is revisited.
"""

import inspect

import pytest
import torch

import compat


def test_hybrid_model_class_and_its_keywords():
    cls = compat.hybrid_model_class()
    assert cls.__name__ in ("MambaModel", "HybridModel")
    kwargs = compat.hybrid_model_kwargs(stack_spec="SPEC", pattern="M-*")
    params = inspect.signature(cls.__init__).parameters
    assert set(kwargs) <= set(params)
    assert sorted(kwargs.values()) == ["M-*", "SPEC"]


def test_base_stack_class_is_megatrons_hybrid_stack():
    cls = compat.base_stack_class()
    assert cls.__name__ in ("MambaStack", "HybridStack")
    assert hasattr(cls, "sharded_state_dict")  # what our stack inherits for checkpoints


def test_megatron_stack_still_hardwires_te_final_norm():
    """Why model/stack.py builds its own final norm: upstream's needs Transformer Engine
    (MambaStack in mc 0.16.1 ssm/mamba_block.py:166; HybridStack in core_v0.19.0
    models/hybrid/hybrid_block.py:215)."""
    stack = compat.base_stack_class()
    source = inspect.getsource(stack.__init__)
    assert "TENorm(" in source, "upstream no longer hard-codes TENorm: HybridStack may simplify"
    if stack.__name__ == "MambaStack" and "layer_type_list" not in source:
        # 0.16: the stack slices the pattern for pipeline stages itself (model/stack.py)
        assert hasattr(stack, "_select_layers_for_pipeline_parallel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_megatron_cuda_seed_still_needs_cuda():
    """Why compat.seed_model_parallel_rng exists."""
    from megatron.core import tensor_parallel

    with pytest.raises((RuntimeError, AssertionError, AttributeError)):
        tensor_parallel.model_parallel_cuda_manual_seed(1)


def test_megatron_local_attention_still_uses_the_cuda_buffer():
    """Why model/attention.py owns core attention on CPU."""
    from megatron.core.transformer import dot_product_attention

    source = inspect.getsource(dot_product_attention.DotProductAttention.forward)
    assert "get_global_memory_buffer" in source


def test_dist_checkpoint_save_still_needs_the_cpu_patch():
    """compat item 5: the two CUDA calls it covers are still in megatron's save path."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async, state_dict_saver

    assert "torch.cuda.synchronize()" in inspect.getsource(filesystem_async)
    assert "device=torch.cuda.current_device()" in inspect.getsource(state_dict_saver)


def test_cpu_dist_checkpoint_patch_is_scoped_to_cpu_runs():
    before = torch.cuda.synchronize, torch.cuda.current_device
    with compat.cpu_dist_checkpoint_save(cuda=False):  # a CPU run, also on a host with a GPU
        assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.synchronize() is None
    assert (torch.cuda.synchronize, torch.cuda.current_device) == before
    with compat.cpu_dist_checkpoint_save(cuda=True):  # a CUDA run: megatron's own calls
        assert (torch.cuda.synchronize, torch.cuda.current_device) == before


@pytest.mark.parametrize("release,expected", [("2.8", "fp8_autocast"), ("2.9", "autocast")])
def test_te_autocast_by_te_release(monkeypatch, release, expected):
    """compat item 3: TE 2.8 has only fp8_autocast(fp8_recipe=) (v2.8 fp8.py:646); 2.9 adds
    autocast(recipe=) (v2.9 quantization.py:790). TE is faked: it is absent on CPU."""
    import sys
    import types

    te = types.ModuleType("transformer_engine.pytorch")
    te.fp8_autocast = lambda enabled, fp8_recipe: ("fp8_autocast", fp8_recipe)
    if release == "2.9":
        te.autocast = lambda enabled, recipe: ("autocast", recipe)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te)
    assert compat.te_autocast("RECIPE") == (expected, "RECIPE")


def test_sequence_parallel_mappings_still_allocate_on_the_cuda_device():
    """compat item 6: why the sequence-parallel patch exists."""
    from megatron.core.tensor_parallel import layers, mappings

    assert "device=torch.cuda.current_device()" in inspect.getsource(
        mappings._gather_along_first_dim)
    assert "device=torch.cuda.current_device()" in inspect.getsource(
        mappings._reduce_scatter_along_first_dim)
    assert "get_global_memory_buffer" in inspect.getsource(
        layers.LinearWithGradAccumulationAndAsyncCommunication.forward)


def test_cpu_sequence_parallel_patch_is_scoped_and_only_with_sequence_parallelism():
    before = torch.cuda.current_device
    with compat.cpu_sequence_parallel_buffers(False, cuda=False):
        assert torch.cuda.current_device is before
    with compat.cpu_sequence_parallel_buffers(True, cuda=True):  # a CUDA run: nothing patched
        assert torch.cuda.current_device is before
    # A CPU run, also a gloo run on a host with a GPU (the patch used to be skipped
    # whenever some GPU was present, and megatron's buffers then landed on CUDA).
    with compat.cpu_sequence_parallel_buffers(True, cuda=False):
        assert torch.cuda.current_device() == "cpu"
        assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.cuda.current_device is before


def test_cpu_seeding_installs_megatrons_no_op_rng_tracker():
    """compat item 4: the sequence-parallel embedding forks the tracker around its dropout
    (language_model_embedding.py:145, mc 0.16.1); on a CPU run that fork must be a null context,
    whether or not the host has a GPU."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    compat.seed_model_parallel_rng(3, cuda=False)
    with get_cuda_rng_tracker().fork():
        drawn = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(drawn, torch.rand(2))  # the default stream, untouched


def test_fully_parallel_wrappers_wrap_the_given_strategies():
    """compat item 7: built the same way on 0.16.1 and 0.19 (0.19's constructors add
    backend/version and drop the strategy base classes)."""
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    from training.safe_load import SafeTorchDistLoadStrategy

    base_save, base_load = get_default_save_sharded_strategy(), SafeTorchDistLoadStrategy()
    save = compat.fully_parallel_save(base_save, None)
    load = compat.fully_parallel_load(base_load, None)
    assert save.base_strategy is base_save and load.base_strategy is base_load
    assert load.exchange_algo == "broadcast"
    # the safe strategy's metadata readers are the ones the wrapper answers with
    assert "SafeFileSystemReader" in inspect.getsource(type(base_load).load_sharded_metadata)


def test_fully_parallel_load_still_exchanges_on_cuda():
    """Why compat.cpu_fully_parallel_load exists: megatron's exchange moves tensors to CUDA and
    the wrapper synchronizes CUDA (exchange_utils.py:499, fully_parallel.py:272,281 in 0.16.1)."""
    from megatron.core.dist_checkpointing import exchange_utils
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    assert ".cuda()" in inspect.getsource(exchange_utils.exchange_loaded_tensors_broadcast)
    assert "torch.cuda.synchronize()" in inspect.getsource(
        fully_parallel.FullyParallelLoadStrategyWrapper.load)
    assert fully_parallel.exchange_by_distribution is exchange_utils.exchange_by_distribution


def test_cpu_fully_parallel_load_patch_is_scoped_to_cpu_runs():
    from megatron.core.dist_checkpointing.strategies import fully_parallel

    before = fully_parallel.exchange_by_distribution, torch.cuda.synchronize
    with compat.cpu_fully_parallel_load(cuda=True):
        assert (fully_parallel.exchange_by_distribution, torch.cuda.synchronize) == before
    with compat.cpu_fully_parallel_load(cuda=False):
        assert fully_parallel.exchange_by_distribution is compat._cpu_exchange_by_distribution
        assert torch.cuda.synchronize() is None
    assert (fully_parallel.exchange_by_distribution, torch.cuda.synchronize) == before


def test_the_cpu_exchange_skips_shards_only_their_reader_needs(parallel_context):
    """One rank: every shard is needed by its reader only, so nothing is broadcast and what was
    read comes back as it is (the two-rank exchange runs in test_data_parallel.py)."""
    loaded = {("a", (0,), None): torch.ones(3)}
    distribution = ({("a", (0,), None): 0}, None, {}, {("a", (0,), None): [0]})
    out = compat._cpu_exchange_by_distribution(loaded, {}, distribution, None)
    assert out.keys() == loaded.keys() and torch.equal(out[("a", (0,), None)], torch.ones(3))


def _stand_in_mamba(root, init: str) -> None:
    """A mamba_ssm laid out like 2.3.2.post1: `init` is its package __init__; the Triton SSD and
    gated-norm modules import only a sibling utils module."""
    files = {
        "mamba_ssm/__init__.py": init,
        "mamba_ssm/ops/__init__.py": "",
        "mamba_ssm/ops/triton/__init__.py": "",
        "mamba_ssm/ops/triton/ssd_combined.py": (
            "from mamba_ssm.utils.marker import VALUE\n"
            "def mamba_chunk_scan_combined(*args, **kwargs):\n    return ('scan', VALUE)\n"),
        "mamba_ssm/ops/triton/layernorm_gated.py": (
            "def rmsnorm_fn(*args, **kwargs):\n    return 'norm'\n"),
        "mamba_ssm/utils/__init__.py": "",
        "mamba_ssm/utils/marker.py": "VALUE = 42\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


@pytest.fixture
def stand_in_mamba(tmp_path, monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_mamba_triton_kernels_load_without_a_failing_package_init(stand_in_mamba):
    """compat item 8: the wheel built without its CUDA extension (its __init__ imports
    selective_scan_cuda): the kernels load, and nobody else sees the stand-in package."""
    import sys

    _stand_in_mamba(stand_in_mamba, "import selective_scan_cuda\n")
    with pytest.raises(ModuleNotFoundError, match="selective_scan_cuda"):
        import mamba_ssm.ops.triton.ssd_combined  # noqa: F401  (the normal import fails)
    kernels, package, how = compat.mamba_ssm_triton_kernels()
    assert set(kernels) == set(compat.MAMBA_TRITON_KERNELS) and not package
    assert kernels["mamba_chunk_scan_combined"]() == ("scan", 42) and kernels["rmsnorm_fn"]() == "norm"
    assert "without mamba_ssm/__init__.py" in how and "selective_scan_cuda" in how
    assert not [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]


def test_mamba_triton_kernels_import_normally_or_say_why_not(stand_in_mamba):
    _stand_in_mamba(stand_in_mamba, "")
    kernels, package, how = compat.mamba_ssm_triton_kernels()
    assert set(kernels) == set(compat.MAMBA_TRITON_KERNELS) and package and how == "mamba_ssm imported"
    (stand_in_mamba / "mamba_ssm/utils/marker.py").write_text("import a_missing_dependency\n")
    (stand_in_mamba / "mamba_ssm/__init__.py").write_text("import selective_scan_cuda\n")
    for name in [n for n in list(__import__("sys").modules) if n.startswith("mamba_ssm")]:
        del __import__("sys").modules[name]
    kernels, package, how = compat.mamba_ssm_triton_kernels()
    assert kernels == {} and not package
    assert "selective_scan_cuda" in how and "a_missing_dependency" in how


def test_the_portable_mixer_takes_the_kernels_compat_loads(stand_in_mamba, monkeypatch):
    """On a CUDA run the mixer uses them (and says so); on a CPU run, never."""
    from model import mamba_mixer

    _stand_in_mamba(stand_in_mamba, "import selective_scan_cuda\n")
    monkeypatch.setattr(mamba_mixer, "_KERNELS", None)
    monkeypatch.setattr(mamba_mixer, "_MAMBA_SSM", (False, ""))
    assert mamba_mixer.mamba_kernels(cuda=False) == {}
    assert {"mamba_chunk_scan_combined", "rmsnorm_fn"} <= set(mamba_mixer.mamba_kernels(cuda=True))
    assert not mamba_mixer.mamba_ssm_package_imports()
    assert mamba_mixer.mamba_kernels_how(cuda=True).startswith(
        "mamba_ssm Triton SSD scan and gated norm (Triton kernels loaded without mamba_ssm/__init__.py")
    assert mamba_mixer.mamba_kernels_how(cuda=False) == "PyTorch SSD scan and gated norm (CPU run)"


def test_quiet_cpu_fallback_warnings_hides_only_megatrons_fallback_notice():
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compat.quiet_cpu_fallback_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch "
                      "optimizers.", UserWarning)
        warnings.warn("something else", UserWarning)
    assert [str(w.message) for w in seen] == ["something else"]


def test_the_all_to_all_dispatcher_builds_without_cuda_and_leaves_no_placeholder():
    """compat item 11: megatron makes its device-to-host stream at the first construction
    (why the patch exists), which a torch without CUDA cannot; for a CPU run none is made, and
    the class attribute is None again afterwards; a GPU run is left to megatron."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    source = inspect.getsource(MoEAlltoAllTokenDispatcher.__init__)
    assert "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()" in source
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None
    with compat.cpu_alltoall_dispatcher_construction(cuda=True):
        assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None
    with compat.cpu_alltoall_dispatcher_construction(cuda=False):
        assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream == compat.NO_CUDA_STREAM
        with compat.cpu_alltoall_dispatcher_construction(cuda=False):  # the outer one restores
            pass
        assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream == compat.NO_CUDA_STREAM
    assert MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None


def test_a_deeper_moe_model_after_a_shallower_one_logs_its_aux_losses():
    """compat item 12: megatron's tracker rows are sized by the first model that logs (why the
    reset exists); after the reset a model of more layers records into rows of its own."""
    from megatron.core.transformer.moe.moe_utils import (get_moe_layer_wise_logging_tracker,
                                                         save_to_aux_losses_tracker)

    compat.reset_moe_metrics_tracker()
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0), 2, num_layers=4)
    with pytest.raises(IndexError):
        save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(1.0), 9, num_layers=9)
    compat.reset_moe_metrics_tracker()
    save_to_aux_losses_tracker("load_balancing_loss", torch.tensor(2.0), 9, num_layers=9)
    values = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    assert values.tolist() == [0.0] * 8 + [2.0]
    compat.reset_moe_metrics_tracker()
    assert get_moe_layer_wise_logging_tracker() == {}
