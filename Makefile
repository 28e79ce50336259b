# Every target bootstraps .venv itself, so each works on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Debian packages the test suite drives for real.
TEST_SYSTEM_PACKAGES := chromium redis-server espeak-ng
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test test-fast bench gpu-wheels gpu-check lint system-deps

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch goes first and pinned: anything unpinned would pull a multi-GB CUDA build.
$(VENV)/.runtime: pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	touch $@

# torch is pinned again so that nothing the extras pull in can swap the CPU build out.
$(VENV)/.test: $(VENV)/.runtime
	$(PIP) install --quiet torch==2.13.0 -e '.[test,dev,clients]'
	touch $@

system-deps:
	@missing=""; for p in $(TEST_SYSTEM_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# The embedded default serves the tiny random-weight Qwen3-Omni; build it on first start, and
# fetch semantic_vad's end-of-turn model (Smart Turn v3.2, from the pipecat-ai wheel on PyPI).
serve: $(VENV)/.runtime
	$(VENV)/bin/duplex models build tiny-omni --if-missing
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(VENV)/bin/duplex serve

# pytest-xdist workers. Most of the suite's time is tests waiting on real time (audio played at
# its pace, peers, a browser), so more workers than cores keep the cores busy. Tests marked
# cpu_bound run one at a time, leaving the timing-sensitive ones a core; a fixture that builds
# something costly builds it once for all workers (tests/builds.py). worksteal: an idle worker
# takes tests queued on a busy one, so no worker is left with a tail of long tests.
# One worker by default, what CI runs: with 4 on the 2-core machine the suite took 10.5-12 min,
# but a run had 1-2 tests that time live audio (a WebRTC peer hearing a resumed reply, a live
# caption's WER) fail under the contention; `make test TEST_WORKERS=4` for the fast run.
TEST_WORKERS ?= 1
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist worksteal

test: $(VENV)/.test system-deps
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=25

# The inner loop: everything but the tests marked slow (real servers, browsers, clients).
test-fast: $(VENV)/.test system-deps
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not slow"

bench: $(VENV)/.runtime
	$(VENV)/bin/duplex models build tiny-omni --if-missing
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(VENV)/bin/duplex bench --baseline per-session

# The first run on a GPU host (duplex/gpucheck; README, "The GPU check"). The host has its own
# CUDA torch and no package index: what its image lacks comes as wheels, downloaded here.
GPU_PYTHON ?= 3.12
GPU_WHEELS ?= gpu-wheels
GPU_CHECK_OUT ?= gpu-check-out
GPU_CHECK_DEVICE ?= cuda

# On a machine with the package index: x86-64 manylinux wheels for the host's CPython.
gpu-wheels: | $(PY)
	$(PY) -m duplex.gpucheck.wheels --python-version $(GPU_PYTHON) --dest $(GPU_WHEELS)

# On the GPU host: its own python3 and torch, no venv, no network (make is optional there:
# `python3 -m duplex.gpucheck` is the same). GPU_CHECK_DEVICE=cpu runs the same check here,
# small, with this checkout's venv and wheels for its CPython.
ifeq ($(GPU_CHECK_DEVICE),cpu)
gpu-check: $(VENV)/.runtime
	$(MAKE) gpu-wheels GPU_PYTHON=$$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
	$(PY) -m duplex.gpucheck --device cpu --wheels $(GPU_WHEELS) --out $(GPU_CHECK_OUT)
else
gpu-check:
	python3 -m duplex.gpucheck --device $(GPU_CHECK_DEVICE) --wheels $(GPU_WHEELS) --out $(GPU_CHECK_OUT)
endif

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
