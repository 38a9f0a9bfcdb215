# One target per habit. CPU machines use the venv below; the GPU machine uses environment.yml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PARAMS ?= params/rollout-runtime-v2.yaml
SMOKE ?= params/profiles/smoke.yaml

source-stamp: setup  ## commit + dirty flag for a tree copied to the GPU machine without .git (carry it)
	$(PY) -m rollout_lib.artifacts

.PHONY: source-stamp setup test test-gpu lint prereg smoke conformance-smoke snapshots clean-cache

$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed  ## CPU install path: CPU torch, no vLLM

test: setup  ## the README's test command: lint + every CPU test (GPU tests skip with a reason)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-gpu:  ## on a CUDA machine: only the gpu-marked tests
	python3 -m pytest -q -m gpu

lint: setup
	$(VENV)/bin/ruff check .

prereg: setup  ## validate the preregistration and the smoke profile, print their SHA-256
	$(PY) -m rollout_lib.prereg $(PARAMS)
	$(PY) -m rollout_lib.prereg $(SMOKE)

conformance-smoke: setup  ## local conformance (hf_cached vs hf_reference) on the tiny smoke model
	$(PY) -m rollout_lib.conformance --params $(SMOKE) --device cpu \
	  --out outputs/smoke/conformance/conformance-$$(date -u +%Y%m%dT%H%M%SZ).json

smoke: prereg conformance-smoke  ## the README's main command on a CPU-only machine

clean-cache:  ## synthetic snapshots are rebuilt bit-identically from seeds
	rm -rf .cache/snapshots
