"""megatron's Mamba mixer for the TE spec, with the gated norm's eps taken from the config.

Imported only by `specs.te_layer_spec`: megatron's mixer module needs triton at import time and
mamba_ssm to be built (mc 0.16.1 ssm/mamba_mixer.py:59-71, 173-176).
"""

from __future__ import annotations

from megatron.core.ssm.mamba_mixer import MambaMixer


class MambaMixerWithConfigEps(MambaMixer):
    """megatron's MambaMixer whose gated RMSNorm uses config.layernorm_epsilon.

    megatron builds that norm with a literal eps=1e-5 (mc 0.16.1 ssm/mamba_mixer.py:357,
    core_v0.18.0 :379) and takes no argument for it. The norm (mamba_ssm's RMSNormGated) reads
    `self.eps` at every call (mamba v2.2.4 ops/triton/layernorm_gated.py:423, 436), and megatron
    calls it on both paths (mc 0.16.1 ssm/mamba_mixer.py:682, 896), so setting it after
    construction reaches every forward.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.rmsnorm:
            self.norm.eps = config.layernorm_epsilon
