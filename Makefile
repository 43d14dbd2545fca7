# Slipstream developer entry points. Every target sets up what it needs from scratch.
#   make serve        serve the embedded tiny model on localhost:8000 (OpenAI-compatible)
#   make test         install everything and run the whole test suite (CI runs this)
#   make bench-engine engine throughput vs transformers; JSON and plots under results/
#   make dev-cluster  local Kubernetes control plane with fake GPU nodes; prints a kubeconfig
#                     path (first run builds the binaries into ~/.cache/slipstream/k8s)
#   make dev-cluster-stop   stop every process the dev cluster started

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
EXTRAS ?= agent,operator,dev
PORT ?= 8000
RESULTS ?= results

.PHONY: setup serve test test-unit test-e2e lint-imports bench-engine dev-cluster \
	dev-cluster-status dev-cluster-stop clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

serve: setup
	$(BIN)/slipstream serve --host 127.0.0.1 --port $(PORT)

lint-imports: setup
	$(BIN)/lint-imports

test: setup lint-imports
	$(BIN)/pytest

test-unit: setup
	$(BIN)/pytest tests/unit

test-e2e: setup
	$(BIN)/pytest e2e -m e2e

# Pods on the fake nodes run as local processes with $(BIN) first on PATH.
# POD_CIDR=10.244.0.0/16 gives pods routable IPs (needs CAP_NET_ADMIN); default loopback.
dev-cluster: setup
	$(BIN)/python e2e/cluster/devcluster.py start $(if $(POD_CIDR),--pod-cidr $(POD_CIDR))

dev-cluster-status:
	$(PYTHON) e2e/cluster/devcluster.py status

dev-cluster-stop:
	$(PYTHON) e2e/cluster/devcluster.py stop

bench-engine: setup
	$(BIN)/python -m slipstream.agent.bench.engine_bench --out $(RESULTS)/engine

clean:
	rm -rf $(VENV) build *.egg-info
