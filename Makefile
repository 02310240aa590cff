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

.PHONY: install python cpu-kernels rust proto-py serve test test-rust test-server test-integration bench lint clean

install: python rust

$(UV):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet uv==$(UV_VERSION)

$(VENV)/.installed: pyproject.toml | $(UV)
	$(UV) pip install --python $(PY) -e '.[test]'
	touch $@

proto-py: $(PB_OUT)/shard_pb2.py

$(PB_OUT)/shard_pb2.py: proto/quiver/v1/shard.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I quiver_server/pb=proto/quiver/v1 \
		--python_out=server --grpc_python_out=server --pyi_out=server proto/quiver/v1/shard.proto

python: $(VENV)/.installed proto-py cpu-kernels

# The shard's C++ CPU kernels, compiled for this machine into .cache/cpu-kernels (torch's
# cpp_extension rebuilds only when a source changes).
cpu-kernels: $(VENV)/.installed
	$(VENV)/bin/quiver-server build-kernels

rust: | $(UV)
	$(CARGO) build --release --workspace
	install -m 755 target/release/quiver-router target/release/quiver-launcher $(VENV)/bin/

serve: install
	$(VENV)/bin/quiver-launcher

test: install test-rust test-server test-integration

test-rust:
	$(CARGO) test --workspace

test-server: python
	$(PY) -m pytest server/tests -q

test-integration: install
	$(PY) -m pytest integration-tests -q

bench: install
	$(PY) bench/run.py

lint:
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) fmt --all -- --check

clean:
	rm -rf target $(VENV) .cache
