"""Launchers and the GPU check: shell scripts, run from the repository root, and one module.

- torchrun.sh: train.py under torchrun, on one node or many; slurm.sbatch: one torchrun.sh per
  node of a Slurm job, preemption-safe (checkpoint, exit 75, requeue). See docs/cluster.md.
- prepare.sbatch: the tokenizing array job, one `python -m data.prepare --shard I/N` per task.
- gpu_check.sh (`make gpu-check`): the one prepared GPU check, one 10-minute command (the GPU
  path, CUDA tests, the Triton SSD check, a compile warm-up, host syncs per micro-batch, demo
  runs and their resume, the hardware bench) -> runs/gpu_check/. gpu_check_plan.py holds its
  budget (which parts run, each one's limit, what is skipped and why) and the resume check;
  gpu_path_check.py (`python -m launch.gpu_path_check`) is its GPU-path and sync parts; its
  Triton SSD part is a numerics check of the model's scan, model/ssd_check.py.
"""
