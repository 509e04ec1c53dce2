# `make demo` runs the default model; `make test` runs the whole test suite (and the CUDA
# backend's tests in Numba's CUDA simulator, a process of their own).
# Both create .venv and install the project with its test extras on first use.
PY ?= python3
VENV ?= .venv
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(VENV)/bin/npllama run "$(PROMPT)"

# The simulator's tests run in a process of their own beside the main suite (one core of
# Python threads, where the main suite spends much of its time in one-threaded Numba
# compiles); their output follows the main suite's, and either one failing fails `make test`.
# Each lists its slowest tests (cold Numba compiles included), to keep the whole under ~20 min.
test: $(VENV)/.installed
	@NUMBA_ENABLE_CUDASIM=1 $(VENV)/bin/python -m pytest --durations=10 tests/cuda > .cuda-sim.log 2>&1 & sim=$$!; \
	trap 'kill $$sim 2>/dev/null' INT TERM; \
	$(VENV)/bin/python -m pytest --durations=25; main=$$?; \
	wait $$sim; cuda=$$?; \
	echo "--- the CUDA backend in Numba's simulator (NUMBA_ENABLE_CUDASIM=1 pytest tests/cuda) ---"; \
	cat .cuda-sim.log; \
	test $$main -eq 0 && test $$cuda -eq 0

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/bench_compare.py

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@
