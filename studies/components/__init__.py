"""The component study: what each part of the NVFP4 recipe fixes, measured on the demo model's own
tensors instead of through loss curves.

    python -m studies.components                        # train, capture, measure, docs/components/
    python -m studies.components --steps 60 --batches 2 --out /tmp/components   # a quicker look

The ablation study (docs/ablations/) trains 81,920 tokens per recipe: too few for the effects RHT,
stochastic rounding and 2D weight scaling address to show in the loss. Here one BF16 run of the
demo model (the ablation's shapes, constant LR after warm-up: a mid-pretraining state) is stopped at
three points; at each, the next `--batches` training steps are captured: every linear's GEMM input
x, weight W and output gradient dY, exactly as megatron's linear hands them to its GEMM. On them,
with this project's quantizers (nvfp4_recipe; the GEMMs composed from the public quantizers as
nvfp4_recipe/linear.py composes them, checked bit for bit against `quantized_linear` by
tests/studies/test_components.py, and the quantizers against the independent per-block reference of
tests/nvfp4_recipe/quant_reference.py on captured slices):

  RHT         relative error of the quantized Wgrad dY^T X against FP32, with and without the
              16-point RHT, per linear kind, and the kurtosis of the operands along T.
  SR          bias of the Wgrad accumulated over N micro-batches (one sequence each), nearest vs
              stochastic; the same on one micro-batch drawn N times; and k optimizer steps from one
              state on the same batches, full recipe vs the recipe without SR, against BF16.
  2D weights  mismatch between the weight Fprop uses and the one Dgrad uses (1x16 along K vs along
              N) against 16x16 tiles, each copy's error, and the error of dX.
  BF16 layers per-layer quantization error, and the loss change / gradient error when only that
              layer is quantized (a sensitivity scan over all layers).
  MXFP4       the same operand and GEMM errors for MXFP4 (1x32, E8M0) and NVFP4 (1x16, E4M3 + FP32).
  variants    every ablation recipe applied to the same captured batches: loss change and gradient
              error against BF16.

Intervals: 95 % Student-t intervals over the captured batches (each batch contributes one value,
the mean over the linears it covers); n is given with every interval. The report: README.md,
*.png and results.json in --out (default docs/components/).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
