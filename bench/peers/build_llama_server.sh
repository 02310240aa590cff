#!/usr/bin/env bash
# llama.cpp's llama-server, built from the llama.cpp sources vendored in the llama-cpp-python
# sdist (PyPI), for `make bench-peers`. The converters (convert_hf_to_gguf.py,
# convert_lora_to_gguf.py and their gguf-py) are kept beside the binary.
# usage: build_llama_server.sh DEST_DIR PIP VERSION JOBS BUILD_TAG
set -euo pipefail
dest=$1 pip=$2 version=$3 jobs=$4 build_tag=$5
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
# AMX is left out (the -mno-amx-* flags win over -march=native whatever their order): with it,
# ggml moves Q4_0/Q4_1/Q8_0 weights into its AMX buffer type, and on the virtualized Xeons
# (Sapphire Rapids and later) these machines run, llama-server then dies with a segfault at
# start-up on the Q4_1 and Q8_0 files while F32 runs (llama.cpp issue 20824 reports the same
# crash in ggml_backend_amx_mul_mat). Without it the same types run on the AVX-512 VNNI kernels.
# On a CPU without AMX the flags change nothing.
no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$dest/src" -B "$dest/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$dest/build" --target llama-server -j "$jobs" >&2
cp "$dest/build/bin/llama-server" "$dest/llama-server"
rm -rf "$dest/build"
"$dest/llama-server" --version >&2
touch "$dest/.installed-$version-$build_tag"
