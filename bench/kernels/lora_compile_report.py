"""Compile the LoRA Triton kernels for a Hopper GPU on a machine without one, and report
registers, spills, shared memory, load widths and matrix instructions per launch plan.

What costs no device time (METHOD.md): Triton lowers to PTX in-process and its wheel ships
`ptxas`, so the launch plans that `lora_triton` would pick for the GPU benchmark's shapes are
compiled here exactly as the JIT would (same constexprs; arguments equal to 1 specialised away,
pointers and multiples of 16 marked 16-divisible), then assembled for sm_90a. Look for: spills
(0), 16-byte loads (`ld.global.v4`), `wgmma` in SGMV for 16-bit dtypes.

    python -m bench.kernels.lora_compile_report [--dtype bfloat16 float16 float32] [--arch 90]

Prints one JSON list on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default; silences a warning

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from bench.kernels import lora as lora_kernels
from quiver_server.kernels import lora_triton

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
H100_SMS = 132


def ptxas() -> str:
    # The newest bundled ptxas understands the PTX version this Triton emits.
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return str(bin_dir / name)
    raise SystemExit(f"no ptxas under {bin_dir}")


def _ptxas_number(pattern: str, report: str) -> int:
    """The number `pattern` captures in ptxas' `-v` report."""
    match = re.search(pattern, report)
    if match is None:
        raise RuntimeError(f"ptxas -v printed nothing matching {pattern!r}:\n{report[-2000:]}")
    return int(match.group(1))


def compile_plan(kernel, pointers: dict[str, str], ints: dict[str, int], constexprs: dict,
                 num_warps: int, arch: int) -> dict:
    names = kernel.arg_names
    signature, constants, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif ints[name] == 1:
            signature[name], constants[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        out = subprocess.run([ptxas(), f"-arch=sm_{arch}a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True)
    if out.returncode != 0:
        return {"ptxas_error": out.stderr[-2000:]}
    return {
        "registers": _ptxas_number(r"Used (\d+) registers", out.stderr),
        "spill_store_bytes": _ptxas_number(r"(\d+) bytes spill stores", out.stderr),
        "shared_bytes": compiled.metadata.shared,
        "global_loads": sorted(set(re.findall(r"ld\.global[.\w]*", ptx))),
        "matrix_ops": sorted(set(re.findall(r"wgmma\.mma_async[.\w]*|mma\.sync[.\w]*", ptx))),
    }


def plan_ints(case: lora_kernels.Case, cols_per_split: int) -> dict[str, int]:
    k, n, r = case.in_features, case.out_features, case.rank
    return dict(K=k, N=n, R=r, cols_per_split=cols_per_split,
                stride_xt=k, stride_xk=1, stride_as=r * k, stride_ar=k, stride_ak=1,
                stride_bs=n * r, stride_bn=r, stride_br=1,
                stride_yt=3 * n, stride_yn=1)  # y: a column slice of a fused q|k|v output


def report(case: lora_kernels.Case, dtype: torch.dtype, arch: int) -> dict:
    t = TYPES[dtype]
    config = lora_triton.LaunchConfig()
    decode = all(n == 1 for n in case.tokens_per_request)
    common = {"y_ptr": f"*{t}", "x_ptr": f"*{t}", "a_ptr": f"*{t}", "b_ptr": f"*{t}", "scaling_ptr": "*fp32"}
    if decode:
        plan = lora_triton.plan_bgmv(case.num_tokens, case.in_features, case.out_features, case.rank,
                                     H100_SMS, config)
        kernel, pointers, extra = lora_triton._bgmv_kernel, {**common, "slots_ptr": "*i32"}, {}
    else:
        meta, _ = lora_kernels.make_meta(case, "cpu")
        plan = lora_triton.plan_sgmv(case.num_tokens, meta.num_segments, meta.max_seg_len,
                                     case.in_features, case.out_features, case.rank, dtype, H100_SMS, config)
        kernel = lora_triton._sgmv_kernel
        pointers = {**common, "seg_indptr_ptr": "*i32", "seg_slots_ptr": "*i32"}
        extra = {"DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "UPCAST": False}
    result = compile_plan(kernel, pointers, plan_ints(case, plan.cols_per_split), {**plan.blocks, **extra},
                          plan.num_warps, arch)
    return {"case": case.name, "dtype": t, "grid": plan.grid, "blocks": plan.blocks,
            "num_warps": plan.num_warps, **result}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float16", "float32"])
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args()
    rows = []
    seen = set()
    for name in args.dtype:
        dtype = getattr(torch, name)
        for case in lora_kernels.cases("cuda", quick=False):
            row = report(case, dtype, args.arch)
            key = (row["dtype"], str(row["blocks"]), row["num_warps"], row["case"].split()[0])
            if key in seen:
                continue  # same kernel binary as an earlier case
            seen.add(key)
            rows.append(row)
            print(f"{row['dtype']} {row['case']}: {row['blocks']} warps {row['num_warps']} -> "
                  f"regs {row.get('registers')} spill {row.get('spill_store_bytes')} "
                  f"smem {row.get('shared_bytes')} {row.get('matrix_ops')}", file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
