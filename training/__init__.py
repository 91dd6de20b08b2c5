"""The training loop and its parts, run management and start-up; the dry-run planner, the GEMM
preflight. The offline commands over finished runs (the HF export, evaluate) are in tools/.

- entry (`train.py`'s `run`: the start-up checks, cheapest first, then `Trainer.fit`), trainer
  (the loop), signals (preemption and Ctrl-C, obeyed at a step's end), config (the Hydra
  schema, each group checking its own fields, and `validate` across groups), schedules (forward
  and backward over a step's micro-batches), ddp_optimizer (BF16 weights, FP32 grads and master
  weights, data parallelism), lr_schedule (the WSD schedule), validation (the validation loss),
  cadence (`Every`: when each part of the loop is due), precision (the run's per-step precision:
  the switch to BF16, diagnostics, weight-cache refresh, input amax), distributed, grad_health,
  metrics.
- checkpoint, safe_load (atomic, verified checkpoints, loaded without running code from them),
  run_reader (a finished run read back: its config.yaml, a verified checkpoint, the model's full
  tensors; for init_from and tools/), run_dir (one trainer per run directory: its lock, its safe
  files, its preparation at start-up).
- plan (the dry run: memory, FLOPs and time per rank), preflight (every low-precision GEMM checked
  against its backend's rules, at start-up and in the dry run).
- init_from (`model.init_from` of a run directory: its newest checkpoint's weights).
- downstream (evaluations in the loop, and the task preparation `python -m tools.evaluate`
  shares), lm_eval_model (lm-eval's `LM` over the project's model, in the loop and in
  tools/evaluate.py).
"""
