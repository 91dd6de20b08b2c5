"""Pretrain a hybrid Mamba-Transformer on megatron-core, in BF16, FP8, MXFP4 or NVFP4.

    python train.py                                   # the CPU demo
    python train.py precision=nvfp4 precision.rht=false trainer.max_steps=50
    torchrun --nproc-per-node 2 train.py parallel.tensor=2
    python train.py model=nemotron_h_12b precision=nvfp4 run.dry_run=true

Compose the config (recipes/, validated by training/config.py), build, train, close.
Exit codes: errors.ExitCode (errors.py) and the README.
"""

import sys

import hydra

from compat import quiet_cpu_fallback_warnings
from training.config import register_configs

# Here, not in main(): megatron's checkpoint writer processes re-import this module.
quiet_cpu_fallback_warnings()


@hydra.main(config_path="recipes", config_name="train", version_base="1.3")
def main(cfg) -> None:
    from training.trainer import run

    sys.exit(run(cfg))


if __name__ == "__main__":  # megatron's checkpoint writers re-import this module: keep the guard
    register_configs()
    main()
