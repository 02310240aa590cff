#!/usr/bin/env bash
# llama.cpp's llama-server, built from the llama.cpp sources vendored in the llama-cpp-python
# sdist (PyPI), for `make bench-peers`. The converters (convert_hf_to_gguf.py,
# convert_lora_to_gguf.py and their gguf-py) are kept beside the binary.
# usage: build_llama_server.sh DEST_DIR PIP VERSION JOBS
set -euo pipefail
dest=$1 pip=$2 version=$3 jobs=$4
rm -rf "$dest"
mkdir -p "$dest"
dest=$(cd "$dest" && pwd)
echo "build_llama_server: llama-cpp-python==$version sdist" >&2
"$pip" download --no-binary :all: --no-deps --quiet -d "$dest/sdist" "llama-cpp-python==$version" >&2
tar -xzf "$dest"/sdist/llama_cpp_python-"$version".tar.gz -C "$dest/sdist"
src="$dest/sdist/llama_cpp_python-$version/vendor/llama.cpp"
mv "$src" "$dest/src"
rm -rf "$dest/sdist"
# Release, this CPU's own vector flags (GGML_NATIVE), CPU only, the server and nothing else.
cmake -S "$dest/src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$dest/build" --target llama-server -j "$jobs" >&2
cp "$dest/build/bin/llama-server" "$dest/llama-server"
rm -rf "$dest/build"
"$dest/llama-server" --version >&2
touch "$dest/.installed-$version"
