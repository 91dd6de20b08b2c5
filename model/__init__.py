"""The hybrid Mamba-Transformer on megatron-core, and its parameter, memory and FLOP counts.

- config: `ModelConfig`, the Hydra group `model/` (its pattern: `M` Mamba-2, `*` attention,
  `-` MLP).
- device: the one device decision (`Hardware`: the run's device, its CUDA capability, the CPU's
  ISA, whether BF16 GEMMs are native), read by every device-dependent choice.
- build: the model from its config and the precision policy; backend: which layer spec and GEMM
  backend a run uses, and why.
- specs, stack: one layer spec per pattern layer (portable or Transformer Engine) and the stack
  that takes them; attention, mamba_mixer, ssd: the portable spec's SDPA core attention, PyTorch
  Mamba-2 mixer and chunked SSD scan; te_mamba_mixer: megatron's mixer for the TE spec;
  recompute: activation recompute; ssd_check: the GPU check's comparison of mamba_ssm's
  Triton scan against ssd (`python -m model.ssd_check`).
- memory_model, flops: parameters and activation memory, and FLOPs per token (the dry-run planner,
  training/plan.py, and the benches use them).
- hf: the config and weights mapped to and from transformers' NemotronH (the export command is
  tools/hf_export.py).

Uses `nvfp4_recipe` (each linear's precision) and `compat`; knows nothing of data or training.
"""
