"""The precision applied to megatron-core models (the rest of `nvfp4_recipe` is torch only).

- parallel_linear: megatron-core's tensor-parallel linears with the emulated GEMMs (imports
  megatron-core).
- te_mapping: each format's Transformer Engine recipe, and whether this machine's TE runs it.
- te_runtime: which TE recipe each layer and linear runs under as the run goes, and the refresh
  of the quantized-weight caches.
- controller: the run-time precision of a built model, step by step (the switch to BF16, the
  quantization diagnostics, the weight caches), for the trainer.
"""
