# quiver's image: the Rust launcher and router, the Python shard, on a CUDA runtime base.
#
#   docker build -t quiver:0.1.0 .
#   docker build --build-arg CUDA_BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 -t quiver:0.1.0-cu126 .
#
# CUDA_BASE must be an Ubuntu 24.04 (Python 3.12) image; the torch wheel brings its own CUDA
# libraries, so the base only has to match the node's driver. docs/deploy.md has the details.
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG RUST_IMAGE=rust:1.95-bookworm

# ---- the launcher and router --------------------------------------------------------------
FROM ${RUST_IMAGE} AS rust-build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY flags flags
COPY launcher launcher
COPY router router
COPY proto proto
# protoc comes vendored with the build dependencies; nothing else is needed.
RUN cargo build --release --locked -p quiver-launcher -p quiver-router \
    && install -D -m 755 target/release/quiver-launcher target/release/quiver-router -t /out

# ---- the shard, in a virtual environment copied whole into the runtime ----------------------
FROM ${CUDA_BASE} AS python-build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml ./
COPY server server
COPY proto proto
# The gRPC stubs are generated, never committed (as `make proto-py` does), with the pinned
# grpcio-tools of pyproject's test extra.
RUN python3 -m venv /opt/quiver \
    && /opt/quiver/bin/pip install --no-cache-dir grpcio-tools==1.85.1 \
    && /opt/quiver/bin/python -m grpc_tools.protoc -I quiver_server/pb=proto/quiver/v1 \
        --python_out=server --grpc_python_out=server proto/quiver/v1/shard.proto \
    && /opt/quiver/bin/pip install --no-cache-dir /src \
    && /opt/quiver/bin/pip uninstall --yes grpcio-tools

# ---- runtime ---------------------------------------------------------------------------------
FROM ${CUDA_BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin quiver \
    && install -d -o 10001 -g 10001 /var/cache/quiver
COPY --from=python-build /opt/quiver /opt/quiver
# Next to quiver-server, where the launcher looks for its children first.
COPY --from=rust-build /out/ /opt/quiver/bin/
ENV PATH=/opt/quiver/bin:$PATH \
    QUIVER_HOSTNAME=0.0.0.0 \
    QUIVER_PORT=8080 \
    QUIVER_CACHE_DIR=/var/cache/quiver \
    HF_HOME=/var/cache/quiver/huggingface \
    QUIVER_KERNEL_DIR=/tmp/quiver-cpu-kernels \
    QUIVER_JSON_LOGS=true
USER 10001:10001
WORKDIR /home/quiver
EXPOSE 8080
# The launcher's /health is 200 once every shard has loaded the model; a Hub download can take
# many minutes, hence the long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30m --retries=3 \
    CMD ["/opt/quiver/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('QUIVER_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["quiver-launcher"]
