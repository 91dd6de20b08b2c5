# Two commands on a fresh machine:  `make train` (the CPU demo) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a CPU-only machine pin the local CPU wheel of torch; a GPU machine brings its own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup train test test-fast bench gpu-check ablations clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,hf]"
	touch $@

setup: $(VENV)/.installed

train: setup  ## the CPU demo: ~6M-parameter hybrid, a few minutes on 2 cores
	$(PY) train.py $(ARGS)

test: setup  ## the CI suite (fast + slow, ~18 min on 2 cores)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: setup
	$(PY) -m launch.bench $(ARGS)

gpu-check:  ## on a GPU machine: CUDA tests, bench, 50-step demos -> runs/gpu_check/
	bash launch/gpu_check.sh

ablations: setup
	$(PY) -m launch.ablations $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
