# `make demo` runs the default model; `make test` runs the whole test suite (and the CUDA
# backend's tests in Numba's CUDA simulator, a process of their own).
# Both create .venv on first use: the demo installs the project alone, the tests its test extras.
PY ?= python3
VENV ?= .venv
PROMPT ?= Explain in two sentences why the sky is blue.

.PHONY: demo test bench browser test-numba-newest
demo: $(VENV)/.installed-demo
	$(VENV)/bin/npllama run "$(PROMPT)"

# The simulator's tests run in a process of their own beside the main suite (one core of
# Python threads, where the main suite spends much of its time in one-threaded Numba
# compiles); their output follows the main suite's, and either one failing fails `make test`.
# Each lists its slowest tests (cold Numba compiles included), to keep the whole under ~20 min.
test: $(VENV)/.installed browser
	@NUMBA_ENABLE_CUDASIM=1 $(VENV)/bin/python -m pytest --durations=10 tests/cuda > .cuda-sim.log 2>&1 & sim=$$!; \
	trap 'kill $$sim 2>/dev/null' INT TERM; \
	$(VENV)/bin/python -m pytest --durations=25; main=$$?; \
	wait $$sim; cuda=$$?; \
	echo "--- the CUDA backend in Numba's simulator (NUMBA_ENABLE_CUDASIM=1 pytest tests/cuda) ---"; \
	cat .cuda-sim.log; \
	test $$main -eq 0 && test $$cuda -eq 0

# The chat page's tests (tests/test_webui.py) drive Debian's Chromium through its chromedriver:
# installed here where missing (as root, else with sudo). NPLLAMA_SKIP_BROWSER=1 skips them instead.
browser:
	@if [ "$$NPLLAMA_SKIP_BROWSER" != 1 ] && ! { [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; }; then \
		echo "installing chromium and chromium-driver for tests/test_webui.py"; \
		sudo=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$sudo apt-get update -q && $$sudo apt-get install -y -q chromium chromium-driver; \
	fi

bench: $(VENV)/.installed
	$(VENV)/bin/python bench/bench_compare.py

$(VENV)/.installed-demo: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	touch $@

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

# The kernel cache's tests against Numba's newest release, in a virtualenv of their own: npllama
# pins the Numba its tests ran on and reaches into its caching, so an upgrade is measured first.
# Skipped where the newest release is the pinned one.
NEWEST ?= .venv-numba-newest
test-numba-newest:
	@newest=$$($(VENV)/bin/pip index versions numba 2>/dev/null | head -1 | sed 's/.*(\(.*\))/\1/'); \
	pinned=$$($(VENV)/bin/python -c 'import numba; print(numba.__version__)'); \
	if [ -z "$$newest" ] || [ "$$newest" = "$$pinned" ]; then \
		echo "Numba's newest release ($${newest:-unknown}) is the pinned one ($$pinned): nothing more to test"; exit 0; fi; \
	$(PY) -m venv $(NEWEST) && $(NEWEST)/bin/pip install -q -e '.[test]' && \
	$(NEWEST)/bin/pip install -q --upgrade numba llvmlite && \
	$(NEWEST)/bin/python -m pytest -q tests/test_cachestamp.py tests/test_cacheload.py tests/test_arraytype.py \
		tests/test_compilelog.py
