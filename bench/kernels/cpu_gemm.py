"""CPU float32 decode matmuls: quiver's packed kernel (cpu/linear.cpp) against oneDNN's packed
sgemm and plain `F.linear`, on every projection and the LM head of the benchmark model.

One timed "step" runs all of the model's products in order for `rows` tokens, as a decode step
does, so the weights (168 MB for the CPU shape, more than a 2-core VM's share of L3) come from
DRAM as they do when serving. The kernels' steps alternate within each repeat (the shared VM
drifts by tens of percent over minutes) and the report gives each one's median. Prints one JSON
object; `bench/suite/run.py` puts it in the bench report.

    .venv/bin/python -m bench.kernels.cpu_gemm [--rows 1,8,32] [--repeats 15]
    QUIVER_CPU_ISA=avx2 .venv/bin/python -m bench.kernels.cpu_gemm   # the AVX2 build on an AVX-512 host
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from bench.fixtures.bench_model import SHAPES, Shape
from quiver_server.kernels import cpu_gemm, cpu_ops


def weight_shapes(shape: Shape) -> list[tuple[int, int]]:
    """(out, in) of every product of one forward pass: fused q|k|v, o, fused gate|up, down per
    layer, then the LM head."""
    h, i = shape.hidden_size, shape.intermediate_size
    kv = h * shape.num_key_value_heads // shape.num_attention_heads
    per_layer = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]
    return per_layer * shape.num_hidden_layers + [(shape.vocab_size, h)]


def measure(shape: Shape, rows_list: list[int], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=gen) * inp**-0.5 for out, inp in weight_shapes(shape)]
    kernels = {"quiver": [cpu_gemm.pack(w, "quiver") for w in weights],
               "onednn": [cpu_gemm.pack(w, "onednn") for w in weights]}

    def run(kernel: str, xs: dict[int, torch.Tensor]) -> None:
        if kernel == "f_linear":
            for w in weights:
                F.linear(xs[w.shape[1]], w)
        else:
            for packed in kernels[kernel]:
                cpu_gemm.linear(xs[packed.in_features], packed, None)

    names = ["quiver", "onednn", "f_linear"]
    results = []
    for rows in rows_list:
        xs = {inp: torch.randn(rows, inp, generator=gen) for inp in {w.shape[1] for w in weights}}
        for name in names:  # warm-up, and a check that the kernels agree
            run(name, xs)
        for packed, w in zip(kernels["quiver"][:4], weights[:4], strict=True):
            probe = xs[w.shape[1]]
            torch.testing.assert_close(cpu_gemm.linear(probe, packed, None), F.linear(probe, w), rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:
                start = time.perf_counter()
                run(name, xs)
                times[name].append(time.perf_counter() - start)
        medians = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        results.append({
            "rows": rows,
            "step_ms_median": {name: round(ms, 3) for name, ms in medians.items()},
            "quiver_speedup_vs_onednn": round(medians["onednn"] / medians["quiver"], 3),
            "quiver_speedup_vs_f_linear": round(medians["f_linear"] / medians["quiver"], 3),
        })
    weight_bytes = sum(w.numel() for w in weights) * 4
    return {"shape": shape.name, "weight_mb": round(weight_bytes / 1e6, 1), "isa": cpu_ops.loaded_isa(),
            "vector_width": cpu_ops.vector_width(), "threads": torch.get_num_threads(), "repeats": repeats,
            "steps": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--rows", default="1,8,32", help="comma-separated row counts (tokens per step)")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit("the C++ CPU kernels are not built (make install)")
    report = measure(SHAPES[args.shape], [int(r) for r in args.rows.split(",")], args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
