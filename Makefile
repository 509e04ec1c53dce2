# `make demo` runs the default model; `make test` runs the whole test suite (then the CUDA
# backend's tests in Numba's CUDA simulator, a process of their own).
# Both create .venv and install the project with its test extras on first use.
PY ?= python3
VENV ?= .venv
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(VENV)/bin/npllama run "$(PROMPT)"

test: $(VENV)/.installed
	$(VENV)/bin/python -m pytest
	NUMBA_ENABLE_CUDASIM=1 $(VENV)/bin/python -m pytest tests/cuda

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/bench_compare.py

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@
