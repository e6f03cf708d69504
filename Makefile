# resumekit — the two commands a newcomer runs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel of this machine kind; a bare "torch" would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# Every package but torch at the version of requirements/dev.lock (scripts/dev_lock.py):
# pip gets one candidate per package, so an install never turns into a resolver search.
LOCK := requirements/dev.lock
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(LOCK) | sha1sum | cut -c1-12)

.PHONY: venv lock test test-suites test-fast lint demo docs docs-build bench bench-scale bench-goodput \
	bench-emergency bench-collectives \
	bench-world gpu-check \
	gpu-wheels clean test-torch test-matrix

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml $(LOCK)
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev,docs]" -c $(LOCK)
	@# torchtitan's model classes for the tests, without torchtitan's own requirements
	$(PIP) install -q --no-deps -c $(LOCK) $$($(PYTHON) scripts/dev_lock.py no-deps)
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# Regenerate requirements/dev.lock: .[dev,docs,bench] resolved afresh beside TORCH_PIN in a
# throwaway venv (after a change of pyproject.toml's requirements; a unit test names any
# requirement the lock no longer satisfies).
lock:
	$(PYTHON) scripts/dev_lock.py write

# Every suite. With CI=true nothing may skip for lack of a service (tests/conftest.py enforces it).
# The unit and property suites run first, one worker per core (as test-fast); then every other
# suite (test-suites) alongside lint and the docs build, whose CPU fills the time test-suites
# spends waiting on its cluster drills.
test: $(STAMP)
	$(PY) -m pytest -q -n $(FAST_WORKERS) tests/unit tests/property
	$(MAKE) --no-print-directory -j3 --output-sync=line test-suites lint docs-build

# Every suite but unit and property, on SLOW_WORKERS workers, one test file to one worker
# (--dist loadfile: a module fixture, such as a reference run or the bench smoke run, is built
# once; the multi-host namespaces, fixed names on this machine, are built by one worker only).
# The cluster suites start first (tests/conftest.py): they mostly wait on SLURM and on timeouts
# while the other workers run the multi-rank, crash, e2e, bench and docs suites (each on its
# own free ports and temp dirs).
test-suites: $(STAMP)
	$(PY) -m pytest -q -n $(SLOW_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests --ignore=tests/unit --ignore=tests/property

# One worker more than cores: a cluster suite's worker is mostly idle.
SLOW_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) + 1 )))

# Unit + property suites, one pytest worker per core (pytest-xdist; each worker starts its own
# loopback S3 server on a free port). FAST_WORKERS=0 runs them in one process.
FAST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test-fast: $(STAMP)
	$(PY) -m pytest -q -n $(FAST_WORKERS) tests/unit tests/property

# ruff, mypy --strict, and the layer rules of docs/design.md as import-linter contracts
# ([tool.importlinter] in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check resumekit tests benchmarks examples
	$(VENV)/bin/mypy resumekit
	$(VENV)/bin/lint-imports

# -- torch releases (docs/compatibility.md) ------------------------------------------------
# `make test-torch TORCH=X.Y.Z`: the unit, property and dist suites (CI=true: a skip fails)
# and the LingBot drill on that torch, from this checkout, in .venv-torch-X.Y.Z (made when
# missing: torch==X.Y.Z and -e .[dev], every other package pinned by requirements/dev.lock;
# with PIP_CONFIG_FILE=/dev/null only when pip's configured constraints cap torch below X.Y.Z). TORCH_VENV=DIR: an existing venv instead. Writes
# .compat/torch-X.Y.Z.json (suite -> passed, failed, errors, skipped, seconds, commit).
# `make test-torch-X.Y.Z` is the same (a failure names the version in make's own error line).
# `make test-matrix`: the declared floor, the CI pin and the newest release, the cross-version
# check (written by the newest, refused by the others, resumed by the newest), and the table
# of docs/compatibility.md. A release step: each torch but the local wheels downloads GBs.
TORCH ?=
TORCH_VENV ?=
TORCH_SUITES ?= unit,property,dist,drill
TORCH_WORKERS ?= 2
MATRIX_TORCH ?= 2.9.1 2.13.0 2.15.0
# Existing venvs for the matrix, instead of .venv-torch-X.Y.Z of MATRIX_TORCH.
MATRIX_VENVS ?=
COMPAT := $(PYTHON) scripts/compat_matrix.py

test-torch:
	@if [ -z "$(TORCH)$(TORCH_VENV)" ]; then \
	  echo "usage: make test-torch TORCH=X.Y.Z (or TORCH_VENV=DIR)" >&2; exit 2; fi
	@echo "==== torch $(or $(TORCH),in $(TORCH_VENV)): $(TORCH_SUITES) ===="
	@$(COMPAT) run $(if $(TORCH),--torch $(TORCH)) $(if $(TORCH_VENV),--venv $(TORCH_VENV)) \
		--suites=$(TORCH_SUITES) --workers $(TORCH_WORKERS) \
	  || { echo "==== FAILED on torch $(or $(TORCH),in $(TORCH_VENV)) ===="; exit 1; }

test-torch-%:
	@$(MAKE) --no-print-directory test-torch TORCH=$*

test-matrix:
	$(COMPAT) matrix $(if $(MATRIX_VENVS),--venvs $(MATRIX_VENVS),--torch $(MATRIX_TORCH)) \
		--suites=$(TORCH_SUITES) --workers $(TORCH_WORKERS)

docs-build: $(STAMP)
	@if [ -f mkdocs.yml ]; then NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site; fi

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

demo: $(STAMP)
	$(PY) -m examples.lingbot.drill

bench: $(STAMP)
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev,docs,bench]" -c $(LOCK)
	@# fio measures the disk's best (save_vs_disk_best, load_vs_disk_best); without it the
	@# bench skips those two figures and says so.
	@if ! command -v fio >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio >/dev/null) \
	      || echo "bench: could not install fio; the disk figures will be skipped"; \
	  else echo "bench: fio is not installed (apt-get install -y fio); the disk figures will be skipped"; fi; \
	fi
	$(PY) -m benchmarks.run

# Issue 27's scale model (docs/performance.md, "Scale"): 2 FSDP2 ranks x 2 GB of state each
# on a NAS stand-in the bench builds itself (root: a loop device under a cgroup bandwidth
# bound), under a SIGTERM/SIGKILL schedule. Sized to fit ~15 minutes on an idle 2-core
# machine (not yet timed at full size there: 0.5 GB per rank took 30 min at load 12-16).
# BENCH_SCALE_ARGS="--state-gb 0.2" for a quick look; --no-stand-in without root.
bench-scale: $(STAMP)
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev,docs,bench]" -c $(LOCK)
	$(PY) -m benchmarks.scale $(BENCH_SCALE_ARGS)

# Issue 40's world-size bench (docs/performance.md, "World size"): real gloo ranks W = 2..32
# (tiny FSDP2 model) and a simulated W = 8..1,024 over the 5B LingBot-VA shapes on the meta
# device, side by side with plain DCP; benchmarks/results/world.json and world.png.
# BENCH_WORLD_ARGS="--real 2,4,8 --fake 8,64,256" for a quick look.
bench-world: $(STAMP)
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev,docs,bench]" -c $(LOCK)
	$(PY) -m benchmarks.world $(BENCH_WORLD_ARGS)

# What one collective of the checkpoint group costs a rank at W = 2 and 32 gloo ranks (CPU of
# every thread, per call): the raw collectives and the Coordinator's; results/collectives.json.
bench-collectives: $(STAMP)
	$(PY) -m benchmarks.collectives $(BENCH_COLLECTIVES_ARGS)

# The goodput of the incident's week, modelled per method from the scale bench's measured
# figures (benchmarks/results/scale.json, latest.json); writes benchmarks/results/goodput.json
# and goodput.png. A model, not a run: ~2 minutes of CPU, no device.
bench-goodput: $(STAMP)
	$(PY) -m benchmarks.goodput_model $(BENCH_GOODPUT_ARGS)

# From a preemption signal to the emergency write's start, against a staging copy (issue 38).
bench-emergency: $(STAMP)
	$(PY) -m benchmarks.emergency_latency

# Every CUDA path in one short run (docs/performance.md, "GPU"). Without CUDA it runs the CPU
# mode; add GPU_CHECK_ARGS=--require-cuda to fail instead. On a bare GPU machine without this
# venv: `bash benchmarks/gpu_check_device.sh` (python3 with its own CUDA torch).
gpu-check: $(STAMP)
	$(PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# Wheels a bare GPU machine lacks (it has torch, numpy, fsspec, xxhash, rich, tqdm,
# safetensors, not pydantic), for its Python 3.12, at the versions of this venv, into .whl/.
GPU_WHEELS := pydantic pydantic_core annotated_types typing_inspection typing_extensions
gpu-wheels: $(STAMP)
	rm -rf .whl
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $$($(PY) -c "import importlib.metadata as m; \
		print(' '.join(n + '==' + m.version(n) for n in '$(GPU_WHEELS)'.split()))")

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache
