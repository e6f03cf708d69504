# resumekit — the two commands a newcomer runs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# The CPU wheel of this machine kind; a bare "torch" would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: venv test test-fast lint demo docs docs-build bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml
	$(PIP) install -q "$(TORCH_PIN)"
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev,docs]"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

venv: $(STAMP)

# Every suite. With CI=true nothing may skip for lack of a service (tests/conftest.py enforces it).
test: $(STAMP)
	$(PY) -m pytest -q tests
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory docs-build

test-fast: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/property

lint: $(STAMP)
	$(VENV)/bin/ruff check resumekit
	$(VENV)/bin/mypy resumekit

docs-build: $(STAMP)
	@if [ -f mkdocs.yml ]; then NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -q -d site; fi

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

demo: $(STAMP)
	$(PY) -m examples.lingbot.drill

bench: $(STAMP)
	$(PIP) install -q "$(TORCH_PIN)" -e ".[dev,docs,bench]"
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) site .pytest_cache .mypy_cache .ruff_cache
