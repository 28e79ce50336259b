# Every target bootstraps .venv itself, so each works on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Debian packages the test suite drives for real.
TEST_SYSTEM_PACKAGES := chromium redis-server espeak-ng
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: serve test test-fast bench bench-gpu lint system-deps

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

test: $(VENV)/.test system-deps
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(PY) -m pytest -q --durations=25

# The inner loop: everything but the tests marked slow (real servers, browsers, clients).
test-fast: $(VENV)/.test system-deps
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.runtime
	$(VENV)/bin/duplex models build tiny-omni --if-missing
	$(VENV)/bin/duplex models build smart-turn --if-missing
	$(VENV)/bin/duplex bench --baseline per-session

# On a CUDA machine (pip's torch==2.13.0 for Linux is the CUDA build): Qwen3-Omni-30B-A3B's
# widths at full depth with random weights, built in GPU memory when the engine starts (its
# 66 GiB checkpoint need not fit on the disk), in bf16 with the code predictor as CUDA graphs;
# the largest real-time session counts of batched and per-session modes go to BENCH_GPU_JSON.
BENCH_GPU_JSON ?= bench-gpu.json
bench-gpu: $(VENV)/.runtime
	@$(PY) -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else \
	  'bench-gpu needs a CUDA device; torch ' + torch.__version__ + ' sees none')"
	DUPLEX_ENGINE__CUDA_GRAPHS=true $(VENV)/bin/duplex bench --model shaped:qwen3-omni-30b-a3b \
	  --dtype bfloat16 --find-max --duration 8 --max-sessions 64 --json $(BENCH_GPU_JSON)

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
