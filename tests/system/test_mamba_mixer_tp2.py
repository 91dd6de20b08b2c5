"""The Mamba-2 mixer (model/mamba_mixer.py) at TP=2 over two gloo processes: its forward equals the
naive full-size forward, and its sharded state dict carries the global layout (the mixer and the
scan in one process: tests/model/test_mamba_mixer.py)."""

from __future__ import annotations

import os
import sys

import torch

# The spawned TP workers import this module again: the repository and tests/ must be on their path.
_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ROOT = os.path.dirname(_TESTS)
if _ROOT not in sys.path:  # the application runs from its checkout
    sys.path.insert(0, _ROOT)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from helpers import free_port  # noqa: E402
from mamba_reference import TINY, build_mixer, mixer_config, naive_mixer_forward  # noqa: E402


def _full_params(seed=0):
    """Global ("megatron-global": [z; x; B; C; dt] rows) parameters for the TINY shape."""
    g = torch.Generator().manual_seed(seed)
    H, P, N, G, hid = TINY["heads"], TINY["head_dim"], TINY["state"], TINY["groups"], TINY["hidden"]
    d_in = H * P
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(
        z=r(d_in, hid) * 0.1, x=r(d_in, hid) * 0.1, B=r(G * N, hid) * 0.1, C=r(G * N, hid) * 0.1,
        dt=r(H, hid) * 0.1,
        conv_w=dict(x=r(d_in, 1, 4) * 0.3, B=r(G * N, 1, 4) * 0.3, C=r(G * N, 1, 4) * 0.3),
        conv_b=dict(x=r(d_in) * 0.1, B=r(G * N) * 0.1, C=r(G * N) * 0.1),
        dt_bias=torch.log(torch.expm1(torch.rand(H, generator=g, dtype=torch.float64) * 0.1 + 0.001)),
        A_log=torch.log(torch.rand(H, generator=g, dtype=torch.float64) * 15 + 1),
        D=r(H), norm=torch.rand(d_in, generator=g, dtype=torch.float64) + 0.5,
        out=r(hid, d_in) * 0.1,
    )


def _tp_worker(rank, world, port):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from types import SimpleNamespace

    from training.distributed import init_distributed, shutdown

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    init_distributed(world, 1, "gloo")
    torch.manual_seed(0)
    try:
        cfg = mixer_config(**TINY)
        m = build_mixer(cfg, chunk_size=16).double()
        fp = _full_params()

        def sl(t, parts):  # rank's slice of a dim-0 tensor split in `parts` equal shards
            n = t.shape[0] // parts
            return t[rank * n:(rank + 1) * n]

        with torch.no_grad():
            m.in_proj.weight.copy_(torch.cat([sl(fp[k], world) for k in ("z", "x", "B", "C", "dt")]))
            m.conv1d.weight.copy_(torch.cat([sl(fp["conv_w"][k], world) for k in ("x", "B", "C")]))
            m.conv1d.bias.copy_(torch.cat([sl(fp["conv_b"][k], world) for k in ("x", "B", "C")]))
            m.dt_bias.copy_(sl(fp["dt_bias"], world))
            m.A_log.copy_(sl(fp["A_log"], world))
            m.D.copy_(sl(fp["D"], world))
            m.norm.weight.copy_(sl(fp["norm"], world))
            n = fp["out"].shape[1] // world
            m.out_proj.weight.copy_(fp["out"][:, rank * n:(rank + 1) * n])
        assert m.nheads_local_tp == TINY["heads"] // world
        assert m.norm.group_size == TINY["heads"] * TINY["head_dim"] // TINY["groups"]

        # forward == naive full-size reference
        full = SimpleNamespace(
            nheads=TINY["heads"], headdim=TINY["head_dim"], d_state=TINY["state"],
            ngroups=TINY["groups"],
            in_proj=SimpleNamespace(weight=torch.cat([fp[k] for k in ("z", "x", "B", "C", "dt")])),
            conv1d=SimpleNamespace(
                weight=torch.cat([fp["conv_w"][k] for k in ("x", "B", "C")]),
                bias=torch.cat([fp["conv_b"][k] for k in ("x", "B", "C")]),
            ),
            dt_bias=fp["dt_bias"], A_log=fp["A_log"], D=fp["D"],
            norm=SimpleNamespace(weight=fp["norm"]), out_proj=SimpleNamespace(weight=fp["out"]),
        )
        h = torch.randn(29, 2, TINY["hidden"], dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        out, _ = m(h)
        torch.testing.assert_close(out, naive_mixer_forward(full, h), atol=1e-10, rtol=0)

        # sharded state dict: global shapes / offsets, and each shard's data is the global slice
        sd = m.sharded_state_dict(prefix="mixer.")
        apply_factories(sd)
        flat = {}
        for k, v in sd.items():
            for e in (v if isinstance(v, list) else [v]):
                if isinstance(e, ShardedTensor):
                    flat[e.key] = e
        globals_ = {
            "mixer.in_proj.weight.z": fp["z"], "mixer.in_proj.weight.x": fp["x"],
            "mixer.in_proj.weight.B": fp["B"], "mixer.in_proj.weight.C": fp["C"],
            "mixer.in_proj.weight.dt": fp["dt"],
            **{f"mixer.conv1d.weight.{k}": v for k, v in fp["conv_w"].items()},
            **{f"mixer.conv1d.bias.{k}": v for k, v in fp["conv_b"].items()},
            "mixer.dt_bias": fp["dt_bias"], "mixer.A_log": fp["A_log"], "mixer.D": fp["D"],
            "mixer.norm.weight": fp["norm"], "mixer.out_proj.weight": fp["out"],
        }
        assert set(flat) == set(globals_), set(flat) ^ set(globals_)
        for k, g in globals_.items():
            st = flat[k]
            assert tuple(st.global_shape) == tuple(g.shape), (k, st.global_shape, g.shape)
            idx = tuple(slice(o, o + s) for o, s in zip(st.global_offset, st.local_shape))
            torch.testing.assert_close(st.data, g[idx], atol=0, rtol=0, msg=k)
    finally:
        shutdown()


def test_mixer_tp2_matches_full_reference_and_shards():
    """TP=2 (2 gloo processes): forward == the naive full-size forward; the sharded state dict's
    z/x/B/C/dt and x/B/C parts carry the global layout (global shape, offsets, data)."""
    import torch.multiprocessing as mp

    mp.spawn(_tp_worker, args=(2, free_port()), nprocs=2, join=True)
