"""Studies: train the model on fixed configurations and report what the numbers say.

    python -m studies.ablations    the precision ablation (every recipe in recipes/precision/),
                                   with downstream scores per recipe given evaluation=...
    python -m studies.components   each recipe component measured on the model's own tensors
    python -m studies.golden       the golden losses tests/system/test_golden_losses.py compares against

They use training/ and the packages below it (and benchmarks/ for the machine's CPU); no
package imports them, only tests do. Their reports are Markdown templates (templates/) that
render.py fills with each study's numbers.
"""
