"""The training loop and its parts; the dry-run planner, the GEMM preflight, the HF export.

- trainer (the loop, `train.py`'s `run`), config (the Hydra schema and `validate`), schedules
  (forward and backward over a step's micro-batches), ddp_optimizer (BF16 weights, FP32 grads and
  master weights, data parallelism), lr_schedule (the WSD schedule), distributed, grad_health, metrics.
- checkpoint, safe_load (atomic, verified checkpoints, loaded without running code from them),
  run_dir (one trainer per run directory).
- plan (the dry run: memory, FLOPs and time per rank), preflight (every low-precision GEMM checked
  against its backend's rules, at start-up and in the dry run).
- hf_export (`python -m training.hf_export`: a run to a transformers directory, BF16 or NVFP4),
  init_from (`model.init_from` of a run directory: its newest checkpoint's weights).
- downstream (evaluations in the loop), lm_eval_model (lm-eval's `LM` over the project's model),
  evaluate (`python -m training.evaluate`: lm-eval tasks on any checkpoint).
"""
