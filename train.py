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

# Nothing heavy at module level: megatron's checkpoint writer starts a spawned helper process
# (mc 0.16.1 dist_checkpointing/strategies/filesystem_async.py, _get_write_results_queue: a
# "spawn" Manager; later releases keep spawn as the default) that re-imports this module;
# importing torch and megatron there cost 2-4 s per run that saves, and re-printed their warnings.


@hydra.main(config_path="recipes", config_name="train", version_base="1.3")
def main(cfg) -> None:
    from training.entry import run  # deferred: torch and megatron stay out of the helper, as above

    sys.exit(run(cfg))


if __name__ == "__main__":  # the spawned helper re-imports this module: keep the guard
    from compat import quiet_cpu_fallback_warnings
    from training.config import register_configs

    quiet_cpu_fallback_warnings()
    register_configs()
    main()
