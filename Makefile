# Two commands on a fresh machine:  `make train` (the CPU demo) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# On a CPU-only machine pin the local CPU wheel of torch; a GPU machine brings its own torch.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup train test test-fast test-system bench gpu-check gpu-wheels ablations components clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev,hf,eval]"
	touch $@

setup: $(VENV)/.installed

train: setup  ## the CPU demo: ~6M-parameter hybrid, 3-6 min of training on 2 cores
	$(PY) train.py $(ARGS)

# Two tiers, by directory (README "Tests"): tests/system holds every test that starts processes
# (train.py, torchrun, a module's command line, gloo ranks) or trains runs of several steps, and
# marks them `slow`; the rest is the unit tier. tests/test_suite_tiers.py keeps them apart.
# TEST_WORKERS=N: N pytest-xdist workers run the files, each file whole on one worker (--dist
# loadfile: a module's fixtures are built once). TEST_WORKERS=0 runs the session serially.
# TEST_THREADS: the torch (OpenMP/MKL) threads of each worker and of every process it starts, the
# cores over the workers (1 on 2 cores with 2 workers). With torch's default (every core) per
# process, two workers each training in one or two processes ran 4+ spinning OpenMP threads on
# 2 cores: 69.9 min of tests in 35.7 min; with one thread each, 35.7 min of tests in 18.4 min
# (docs/performance.md). torchrun gives each of its ranks one thread itself.
TEST_WORKERS ?= 2
TEST_THREADS ?= $(shell n=$$(nproc); w=$(TEST_WORKERS); t=$$n; [ "$$w" -gt 0 ] && t=$$((n / w)); \
	[ "$$t" -lt 1 ] && t=1; echo $$t)
PYTEST := OMP_NUM_THREADS=$(TEST_THREADS) MKL_NUM_THREADS=$(TEST_THREADS) \
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: setup  ## the CI suite: both tiers in one session, the unit tier first; the 25 slowest tests
	$(PYTEST) --durations=25 $(PYTEST_ARGS)

test-fast: setup  ## the unit tier (~3 min on 2 cores); -m "not slow" selects the same tests
	$(PYTEST) --ignore=tests/system $(PYTEST_ARGS)

test-system: setup  ## the system tier alone
	$(PYTEST) tests/system $(PYTEST_ARGS)

bench: setup  ## the hardware bench (benchmarks/hardware.py): GEMMs at 12B shapes, training steps
	$(PY) -m benchmarks.hardware $(ARGS)

gpu-check:  ## on a GPU machine, < 10 min: GPU path, CUDA tests, SSD check, warm-up, syncs, demos, resume, bench -> runs/gpu_check/
	bash launch/gpu_check.sh

# `make gpu-wheels`: a wheelhouse for launch/gpu_check.sh on an offline GPU machine with CPython
# 3.12 on Linux x86-64 that has torch (and its own dependencies), triton and pytest, and nothing
# else of ours. Copy the repo with .wheels/ over and run `WHEELS=.wheels bash launch/gpu_check.sh`.
# Never downloads torch: binary wheels come --no-deps or from dependency trees without torch, and
# the two sdists (antlr4's runtime, mamba-ssm) build without build isolation against the local torch.
GPU_WHEELS ?= .wheels
GPU_WHEELS_MAX_MIB ?= 40
GPU_WHEEL_TAGS := --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
	--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
# With their dependency trees (none of which contains torch):
GPU_WHEELS_TREES := hydra-core omegaconf numpy einops rich psutil
# Without dependencies. megatron-core needs torch (the machine's), numpy and packaging (in the trees
# above); tokenizers' huggingface-hub only serves Tokenizer.from_pretrained, which we never call.
# wandb (26 MiB with its tree: over the limit) is left out: the check runs with logger.mode=disabled,
# and training/metrics.py imports wandb only for the other modes.
# GPU_MEGATRON: pinned to the newest release compat.py covers (read at core_v0.19.0; 0.19.2 trained
# and resumed the demo on CPU, README "What has not run"), so a later release cannot slip into the
# check unread; GPU_MEGATRON=megatron-core==0.16.1 checks the version the CPU suite runs.
GPU_MEGATRON ?= megatron-core==0.19.2
GPU_WHEELS_NODEPS := $(GPU_MEGATRON) tokenizers

gpu-wheels: setup  ## download the offline wheelhouse for launch/gpu_check.sh into .wheels/ (< 40 MiB)
	@set -eu; W="$(GPU_WHEELS)"; T=$$(mktemp -d); trap 'rm -rf "$$T"' EXIT; \
	rm -rf "$$W"; mkdir -p "$$W"; \
	$(PY) -c "import re, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
	deps = p['dependencies'] + p['optional-dependencies']['gpu']; \
	print('\n'.join(re.sub(r'\[.*?\]', '', d) for d in deps if not d.startswith('torch')))" > "$$T/constraints.txt"; \
	echo "gpu-wheels: the project's version bounds (pyproject.toml): $$(tr '\n' ' ' < "$$T/constraints.txt")"; \
	echo "gpu-wheels: building antlr4-python3-runtime 4.9.x (hydra-core's pin; PyPI has only its sdist)"; \
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --no-binary antlr4-python3-runtime \
		-w "$$W" "antlr4-python3-runtime==4.9.*"; \
	echo "gpu-wheels: downloading $(GPU_WHEELS_TREES) with dependencies, $(GPU_WHEELS_NODEPS) without"; \
	$(PY) -m pip download --quiet $(GPU_WHEEL_TAGS) -c "$$T/constraints.txt" --find-links "$$W" \
		-d "$$W" $(GPU_WHEELS_TREES); \
	$(PY) -m pip download --quiet --no-deps $(GPU_WHEEL_TAGS) -c "$$T/constraints.txt" \
		-d "$$W" $(GPU_WHEELS_NODEPS); \
	echo "gpu-wheels: building mamba-ssm without its CUDA extension (MAMBA_SKIP_CUDA_BUILD, for its Triton SSD kernels)"; \
	$(PY) -m pip install --quiet --target "$$T/tools" wheel; \
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE PYTHONPATH="$$T/tools" \
		$(PY) -m pip wheel --quiet --no-deps --no-build-isolation --no-binary mamba-ssm \
		-c "$$T/constraints.txt" -w "$$W" mamba-ssm; \
	echo "gpu-wheels: checking that the wheelhouse alone installs on cp312 manylinux x86-64 (torch stubbed)"; \
	mkdir -p "$$T/stub/torch-2.11.0.dist-info"; \
	printf 'Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n' > "$$T/stub/torch-2.11.0.dist-info/METADATA"; \
	printf 'Wheel-Version: 1.0\nGenerator: make\nRoot-Is-Purelib: true\nTag: py3-none-any\n' > "$$T/stub/torch-2.11.0.dist-info/WHEEL"; \
	printf 'torch-2.11.0.dist-info/METADATA,,\ntorch-2.11.0.dist-info/WHEEL,,\ntorch-2.11.0.dist-info/RECORD,,\n' > "$$T/stub/torch-2.11.0.dist-info/RECORD"; \
	(cd "$$T/stub" && $(abspath $(PY)) -c "import shutil; shutil.make_archive('torch-2.11.0-py3-none-any', 'zip', '.')" \
		&& mkdir -p ../torchstub && mv torch-2.11.0-py3-none-any.zip ../torchstub/torch-2.11.0-py3-none-any.whl); \
	$(PY) -m pip install --dry-run --no-index --find-links "$$W" --find-links "$$T/torchstub" \
		$(GPU_WHEEL_TAGS) --target "$$T/target" "torch==2.11.0" megatron-core $(GPU_WHEELS_TREES) \
		> "$$T/dry.txt" 2>&1 \
	&& $(PY) -m pip install --dry-run --no-index --no-deps --find-links "$$W" \
		$(GPU_WHEEL_TAGS) --target "$$T/target" tokenizers mamba-ssm >> "$$T/dry.txt" 2>&1 \
	|| { cat "$$T/dry.txt"; echo "gpu-wheels: $$W does not install on its own (see above)" >&2; exit 1; }; \
	grep '^Would install' "$$T/dry.txt" | sed 's/^/gpu-wheels: /'; \
	ls -1 "$$W"; \
	BYTES=$$(du -cb "$$W"/*.whl | tail -n 1 | cut -f 1); \
	MIB=$$(awk "BEGIN { printf \"%.1f\", $$BYTES / 1048576 }"); \
	if [ "$$BYTES" -gt $$(( $(GPU_WHEELS_MAX_MIB) * 1048576 )) ]; then \
		echo "gpu-wheels: $$W holds $$MIB MiB, over the $(GPU_WHEELS_MAX_MIB) MiB limit" >&2; exit 1; fi; \
	echo "gpu-wheels: $$W holds $$(ls "$$W" | wc -l) wheels, $$MIB MiB (limit $(GPU_WHEELS_MAX_MIB) MiB)"

ablations: setup  ## the precision ablation -> docs/ablations/; ARGS="--jobs 2 evaluation=demo" adds downstream scores
	$(PY) -m studies.ablations $(ARGS)

components: setup  ## the component study on captured tensors -> docs/components/ (~10 min on 2 cores)
	$(PY) -m studies.components $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
