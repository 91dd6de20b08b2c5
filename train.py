"""Pretrain a hybrid Mamba-Transformer on megatron-core, in BF16, FP8, MXFP4 or NVFP4.

    python train.py                                   # the CPU demo
    python train.py precision=nvfp4 precision.rht=false trainer.max_steps=50
    torchrun --nproc-per-node 2 train.py parallel.tensor=2
    python train.py model=nemotron_h_12b precision=nvfp4 run.dry_run=true

Compose the config (recipes/, validated by training/config.py), build, train, close.
Exit codes: see training.trainer.ExitCode and the README.
"""

import sys

import hydra

from training.config import register_configs


@hydra.main(config_path="recipes", config_name="train", version_base="1.3")
def main(cfg) -> None:
    from training.trainer import run

    sys.exit(run(cfg))


if __name__ == "__main__":  # megatron's checkpoint writers re-import this module: keep the guard
    register_configs()
    main()
