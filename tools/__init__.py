"""Offline commands over finished runs: they read a run directory that train.py wrote and never
write into it.

- hf_export (`python -m tools.hf_export`: a run's checkpoint to a transformers NemotronH
  directory, BF16 or NVFP4 for vLLM / TensorRT-LLM).
- evaluate (`python -m tools.evaluate`: lm-eval tasks on any checkpoint, with the model as
  training builds it).

Future tools that read finished runs (a step replay, a run report) go here too. What the training
loop also uses stays in training/: the run reader (training/run_reader.py), the lm-eval model
(training/lm_eval_model.py), the task preparation (training/downstream.py) and `model.init_from`
of a run (training/init_from.py). So tools imports training and the packages below it, and
nothing below imports tools (tests/test_layering.py).
"""
