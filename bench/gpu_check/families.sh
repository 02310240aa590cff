#!/usr/bin/env bash
# The model-family checks on a GPU machine (offline; torch, triton, transformers, peft there):
# every family's parity with transformers/peft on CUDA, the grouped expert matmul on CUDA, the
# Triton LoRA kernels compiled for the device (the C++ CPU kernels' tests are left out: nothing
# builds them there), the engine's greedy agreement with transformers per family in bfloat16 and
# float16, and the MoE expert-matmul figures. Writes into $1 (default $OUT): gpu.txt,
# pytest.log, families.xml, greedy_bf16.json, greedy_fp16.json, moe_bf16.json.
#   bash bench/gpu_check/families.sh "$OUT"    # wheels the machine lacks (llguidance) in .whl/
set -uo pipefail
out=${1:-${OUT:?give a report directory}}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/server:$PWD/server/tests:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 QUIVER_TEST_DEVICE=cuda
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  git log -1 --format='commit %H' 2>/dev/null || true
  python3 -c "import torch, transformers, peft, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'triton', triton.__version__)"
} > "$out/gpu.txt" 2>&1
timeout 240 python3 -m pytest -q -p no:cacheprovider --junitxml="$out/families.xml" -m "not cpu_kernels" -k "not cpu" \
  server/tests/test_model_parity.py server/tests/test_family_adapters.py server/tests/test_moe_grouped.py \
  server/tests/test_lora_kernels.py 2>&1 | tail -60 > "$out/pytest.log"
timeout 120 python3 -m bench.gpu_check.family_greedy --device cuda --dtype bfloat16 > "$out/greedy_bf16.json" 2>"$out/greedy.log"
timeout 120 python3 -m bench.gpu_check.family_greedy --device cuda --dtype float16 > "$out/greedy_fp16.json" 2>>"$out/greedy.log"
timeout 90 python3 -m bench.kernels.moe_grouped --device cuda --dtype bfloat16 > "$out/moe_bf16.json" 2>&1
cat "$out/gpu.txt"; tail -8 "$out/pytest.log"; tail -5 "$out/greedy.log"; grep '^{"' "$out/greedy_bf16.json" "$out/greedy_fp16.json" | cut -c1-400
