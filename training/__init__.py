"""The training loop and its parts (config, optimizer, checkpoints, metrics, distributed)."""

import warnings

# megatron-core warns at import on every machine without TE/Apex (every CPU run); on CPU that is
# the expected set-up, not news.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
