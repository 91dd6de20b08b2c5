"""The precision applied to megatron-core models (the rest of `nvfp4_recipe` is torch only).

- parallel_linear: megatron-core's tensor-parallel linears with the emulated GEMMs (imports
  megatron-core).
- te_mapping: each format's Transformer Engine recipe, and whether this machine's TE runs it.
- te_runtime: which TE recipe each layer and linear runs under as the run goes, and TE's linears
  as the precision controller steers them (`TEPrecisionLinear`).
- te_telemetry: the underflow telemetry of a TE linear, measured beside it by the emulated
  quantizers.
- input_amax: the running input amax of the low-precision linears (the serving export's
  activation scales).
The run's precision step by step (the switch to BF16, the diagnostics, the weight caches) is the
trainer's: training/precision.py.
"""
