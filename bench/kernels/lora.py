"""LoRA kernel micro-benchmark: the per-part LoRA backends against the memory-bandwidth floor.

For each case (a decode batch or a prefill batch of one LoRA target module: T tokens over
`adapters` distinct adapters, in -> out features, rank R) it times

- triton: the fused BGMV/SGMV kernels (CUDA), eagerly and, where capture works, as a CUDA graph
  of many calls (launch gaps gone: the kernels' own time); triton.grouped: the fused-projection
  kernel as served (`FusedLora`), decode rows grouped by adapter, likewise;
- torch: the vectorised torch path and each of its strategies (gather_rows, group_by_slot,
  by_segment);
- reference: the per-token loop (only for small T: it exists to be obviously right, not fast);

and compares each with the floor: the fewest bytes the operation must move (x read once, A and B
of each adapter in the batch read once, y read and written once) over the device's memory
bandwidth, measured here with a large device-to-device copy. Every backend's output is checked
against float64 math first (relative error ||out - exp|| / ||delta||), so a fast wrong kernel
shows up as an error, not as a good time. Inputs rotate over enough copies to exceed the caches.

    python -m bench.kernels.lora                 # cuda if available (7B shapes), else cpu
    python -m bench.kernels.lora --device cpu    # CPU shapes; compare the torch strategies
    python -m bench.kernels.lora --quick         # seconds: tiny shapes, every backend (Triton via
                                                 # its interpreter off CUDA), a smoke test
    python -m bench.kernels.lora --sweep         # cuda: also try launch configs, report the best

Prints ONE JSON report on stdout and writes it to bench/results/; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.fixtures.paths import RESULTS_DIR


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu (the serving defaults)")
    p.add_argument("--quick", action="store_true", help="tiny shapes, one repeat: a smoke test")
    p.add_argument("--sweep", action="store_true", help="cuda: time a grid of Triton launch configs")
    p.add_argument("--min-time-ms", type=float, default=50.0, help="per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    p.add_argument("--only", default="", help="regex: run only the cases whose name matches")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    return p.parse_args()


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.quick and ARGS.device != "cuda":
    # Triton's interpreter runs the kernels on CPU tensors; the flag must be set before any
    # kernel is decorated, i.e. before lora_triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from quiver_server.kernels import lora_torch  # noqa: E402
from quiver_server.kernels.lora_meta import LoraBatchMeta  # noqa: E402
from quiver_server.kernels.lora_reference import add_lora_reference  # noqa: E402


def log(message: str) -> None:
    print(f"[lora-bench] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Case:
    name: str
    tokens_per_request: tuple[int, ...]
    adapters: int  # distinct adapters among the requests (round-robin); slots hold 32 or more
    in_features: int
    out_features: int
    rank: int
    slots: int = 32

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens_per_request)


def cases(device: str, quick: bool) -> list[Case]:
    def decode(batch, adapters, k, n, r, slots=32):
        return Case(f"decode b{batch} a{adapters} {k}x{n} r{r}", (1,) * batch, adapters, k, n, r, slots)

    def prefill(requests, length, adapters, k, n, r, slots=32):
        return Case(f"prefill {requests}x{length} a{adapters} {k}x{n} r{r}", (length,) * requests,
                    adapters, k, n, r, slots)

    if quick:
        return [decode(4, 2, 64, 96, 8, 4), prefill(3, 20, 2, 64, 96, 16, 4)]
    if device == "cuda":  # Llama-2-7B: q/k/v/o 4096x4096, gate/up 4096x11008, down 11008x4096
        out = []
        for k, n in [(4096, 4096), (4096, 11008), (11008, 4096)]:
            for batch, adapters in [(1, 1), (32, 1), (32, 8), (32, 32), (128, 32)]:
                out.append(decode(batch, adapters, k, n, 16))
            out.append(decode(32, 32, k, n, 64))
            out.append(prefill(16, 128, 8, k, n, 16))
            out.append(prefill(4, 512, 4, k, n, 64))
        out.append(decode(32, 32, 4096, 4096, 128))  # the largest rank served
        out.append(prefill(4, 512, 4, 4096, 4096, 128))
        return out
    out = []  # CPU: the bench model's shapes (512 / 1408) and a 4096 one
    for k, n in [(512, 512), (512, 1408), (4096, 4096)]:
        for batch, adapters in [(8, 8), (32, 1), (32, 8), (32, 32), (128, 32)]:
            out.append(decode(batch, adapters, k, n, 16))
        out.append(decode(32, 32, k, n, 128))
        out.append(prefill(4, 128, 4, k, n, 16))
        out.append(prefill(32, 64, 8, k, n, 16))
        out.append(prefill(16, 128, 16, k, n, 64))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def peak_bandwidth_gbs(device: str) -> float:
    """Bytes read + written per second of a large device-to-device copy (best of several)."""
    numel = (1 << 28) if device == "cuda" else (1 << 25)  # 1 GiB / 128 MiB of float32
    src = torch.rand(numel, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(5 if device == "cuda" else 3):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best / 1e9


@dataclass
class Inputs:
    x: torch.Tensor
    y: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: torch.Tensor


def make_inputs(case: Case, dtype: torch.dtype, device: str, gen: torch.Generator) -> Inputs:
    t, k, n, r = case.num_tokens, case.in_features, case.out_features, case.rank
    a = torch.randn(case.slots, r, k, generator=gen, device=device) / math.sqrt(k)
    b = torch.randn(case.slots, n, r, generator=gen, device=device) / math.sqrt(r)
    return Inputs(
        x=torch.randn(t, k, generator=gen, device=device).to(dtype),
        y=torch.randn(t, n, generator=gen, device=device).to(dtype),
        lora_a=a.to(dtype), lora_b=b.to(dtype),
        scaling=torch.rand(case.slots, generator=gen, device=device) + 0.5,
    )


def make_meta(case: Case, device: str) -> tuple[LoraBatchMeta, list[int]]:
    # Adapters land in spread-out slots, requests cycle through them (worst case for grouping).
    stride = max(case.slots // case.adapters, 1)
    slots = [(i % case.adapters) * stride for i in range(len(case.tokens_per_request))]
    return LoraBatchMeta.build(slots, list(case.tokens_per_request), case.rank, device), slots


def floor_bytes(case: Case, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    t, k, n, r = case.num_tokens, case.in_features, case.out_features, case.rank
    return size * (t * k + case.adapters * r * (k + n) + 2 * t * n)


def expected(inp: Inputs, meta: LoraBatchMeta) -> torch.Tensor:
    """float64 math straight from the definition, one group of rows per adapter (any device)."""
    want = inp.y.double()
    slots = meta.token_slots.long()
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).squeeze(1)
        h = inp.x[rows].double() @ inp.lora_a[slot].double().T
        want[rows] += inp.scaling[slot].double() * (h @ inp.lora_b[slot].double().T)
    return want


def relative_error(fn, inp: Inputs, meta: LoraBatchMeta, want: torch.Tensor) -> float:
    y = inp.y.clone()
    fn(y, inp.x, inp.lora_a, inp.lora_b, inp.scaling, meta, slice(0, y.shape[1]))
    delta = want - inp.y.double()
    return ((y.double() - want).norm() / delta.norm().clamp(min=1e-30)).item()


def time_eager(fn, sets: list[Inputs], meta: LoraBatchMeta, device: str, min_time_ms: float, repeats: int) -> float:
    """Median seconds per call; each call on the next input set (y accumulates: harmless)."""
    def call(i: int) -> None:
        inp = sets[i % len(sets)]
        fn(inp.y, inp.x, inp.lora_a, inp.lora_b, inp.scaling, meta, slice(0, inp.y.shape[1]))

    for i in range(len(sets)):
        call(i)  # warm-up: compilation, allocator, caches
    sync(device)
    start = time.perf_counter()
    call(0)
    sync(device)
    iters = max(1, min(10_000, int(min_time_ms / 1e3 / max(time.perf_counter() - start, 1e-7))))
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for i in range(iters):
                call(i)
            end.record()
            end.synchronize()
            samples.append(begin.elapsed_time(end) / 1e3 / iters)
        else:
            start = time.perf_counter()
            for i in range(iters):
                call(i)
            samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def time_graph(fn, sets: list[Inputs], meta: LoraBatchMeta, repeats: int) -> float:
    """CUDA graph of 20 rounds of launches over the rotating sets; median replay time per call."""
    calls = [functools.partial(fn, inp.y, inp.x, inp.lora_a, inp.lora_b, inp.scaling, meta,
                               slice(0, inp.y.shape[1])) for inp in sets]
    return time_calls_in_graph(calls, 20, repeats)


def time_calls_in_graph(calls: Sequence[Callable[[], object]], rounds: int, repeats: int) -> float:
    """Median seconds per call of `rounds` rounds of `calls` captured in one CUDA graph (the
    launches' host cost is not what is measured). The calls run once first on the capture stream:
    compiles and caches happen before the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(begin.elapsed_time(end) / 1e3 / (rounds * len(calls)))
    return statistics.median(samples)


def strategy(name: str):
    """Adapts a lora_torch strategy to the per-part kernels' signature (`add_lora_reference`'s)."""
    def run(y, x, a, b, s, meta, out_slice):
        if name == "by_segment":
            lora_torch.by_segment(y[:, out_slice], x, a, b, s, meta.seg_indptr, meta.seg_slots)
        else:
            getattr(lora_torch, name)(y[:, out_slice], x, a, b, s, meta.token_slots)
    return run


def grouped_triton() -> Callable[..., None]:
    """The serving path of a fused projection (`lora_triton.FusedLora`) over this one part: rows
    grouped by adapter (decode rows sorted by slot), each adapter's tiles read once per row block."""
    from quiver_server.kernels.lora_triton import FusedLora
    fused: dict[tuple[int, ...], FusedLora] = {}

    def run(y, x, a, b, s, meta, out_slice):
        key = (a.data_ptr(), b.data_ptr(), s.data_ptr(), out_slice.start)
        if key not in fused:
            fused[key] = FusedLora([(a, b, s, out_slice, None)])
        fused[key].add(y, x, meta)
    return run


def backends(case: Case, device: str, quick: bool) -> dict[str, Callable[..., None]]:
    out: dict[str, Callable[..., None]] = {"torch": lora_torch.add_lora_torch}
    if device == "cuda" or quick:
        from quiver_server.kernels.lora_triton import add_lora_triton
        out = {"triton": add_lora_triton, "triton.grouped": grouped_triton(), **out}
    if device == "cpu" or quick:
        out["torch.gather_rows"] = strategy("gather_rows")
        out["torch.group_by_slot"] = strategy("group_by_slot")
        if any(n > 1 for n in case.tokens_per_request):
            out["torch.by_segment"] = strategy("by_segment")
    if case.num_tokens <= 64:
        out["reference"] = add_lora_reference
    return out


def sweep_configs(case: Case) -> list:
    from quiver_server.kernels.lora_triton import LaunchConfig
    decode = all(n == 1 for n in case.tokens_per_request)
    configs = []
    for splits in (1, 2, 4, 8, 16):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                if decode:
                    for block_k in (64, 128, 256):
                        configs.append(LaunchConfig(block_k=block_k, block_n=block_n, splits=splits,
                                                    num_warps=warps))
                else:
                    for block_m in (16, 32, 64):
                        configs.append(LaunchConfig(block_m=block_m, block_n=block_n, splits=splits,
                                                    num_warps=warps))
    return configs


def run_case(case: Case, args, dtype: torch.dtype, bandwidth: float) -> dict:
    device = args.device
    gen = torch.Generator(device=device).manual_seed(0)
    meta, slots = make_meta(case, device)
    probe = make_inputs(case, dtype, device, gen)
    per_set = sum(t.numel() * t.element_size() for t in asdict(probe).values())
    sets = [probe] + [make_inputs(case, dtype, device, gen)
                      for _ in range(min(15, (128 << 20) // per_set))]  # > L2 / LLC in all
    bytes_moved = floor_bytes(case, dtype)
    floor_s = bytes_moved / (bandwidth * 1e9)
    row = {**asdict(case), "tokens": case.num_tokens, "decode": meta.is_decode, "input_sets": len(sets),
           "floor_bytes": bytes_moved, "floor_us": floor_s * 1e6, "results": {}}
    row.pop("tokens_per_request")
    want = expected(probe, meta)
    sets_y0 = probe.y.clone()
    repeats = 1 if args.quick else args.repeats
    chosen = backends(case, device, args.quick)
    # Correctness first, on pristine inputs (timing below accumulates into the sets' y).
    errors = {name: relative_error(fn, probe, meta, want) for name, fn in chosen.items()}
    for name, fn in chosen.items():
        result: dict[str, Any] = {"rel_error": errors[name]}
        result["us"] = time_eager(fn, sets, meta, device, args.min_time_ms, repeats) * 1e6
        result["x_floor"] = result["us"] / row["floor_us"]
        if name == "triton" and device == "cuda":
            try:
                result["graph_us"] = time_graph(fn, sets, meta, repeats) * 1e6
                result["graph_x_floor"] = result["graph_us"] / row["floor_us"]
            except Exception as exc:  # a capture problem must not lose the eager numbers
                result["graph_error"] = repr(exc)
        row["results"][name] = result
        log(f"{case.name}: {name} {result['us']:.1f} us ({result['x_floor']:.1f}x floor, "
            f"err {result['rel_error']:.1e})")
    if args.sweep and device == "cuda":
        from quiver_server.kernels.lora_triton import add_lora_triton
        probe.y.copy_(sets_y0)
        timings: list[dict[str, Any]] = []
        for config in sweep_configs(case):
            fn = functools.partial(add_lora_triton, config=config)
            try:
                error = relative_error(fn, probe, meta, want)
                us = time_graph(fn, sets, meta, repeats) * 1e6
                timings.append({"config": asdict(config), "graph_us": us, "rel_error": error})
            except Exception as exc:
                timings.append({"config": asdict(config), "error": repr(exc)})
        timed = sorted((t for t in timings if "graph_us" in t), key=lambda t: t["graph_us"])
        row["sweep_best"] = timed[:5]
        row["sweep_failed"] = [t for t in timings if "error" in t][:5]
    return row


def summary(rows: list[dict]) -> None:
    """A short table on stderr: microseconds per backend and the floor."""
    names = sorted({name for row in rows for name in row["results"]})
    log("case | floor_us | " + " | ".join(names))
    for row in rows:
        cells = []
        for name in names:
            result = row["results"].get(name)
            if result is None:
                cells.append("-")
            else:
                graph = f" (graph {result['graph_us']:.1f})" if "graph_us" in result else ""
                cells.append(f"{result['us']:.1f}{graph}")
        log(f"{row['name']} | {row['floor_us']:.1f} | " + " | ".join(cells))


def main() -> None:
    args = ARGS
    if args is None:
        raise SystemExit("bench/kernels/lora.py is a script: run it with python -m bench.kernels.lora, not import it")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.quick:
        args.min_time_ms = 1.0
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    log(f"device {args.device}, dtype {args.dtype}, threads {torch.get_num_threads()}")
    bandwidth = peak_bandwidth_gbs(args.device)
    log(f"copy bandwidth {bandwidth:.0f} GB/s")
    selected = [c for c in cases(args.device, args.quick) if re.search(args.only, c.name)]
    rows = [run_case(case, args, dtype, bandwidth) for case in selected]
    summary(rows)
    machine = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "device": args.device}
    if args.device == "cuda":
        import triton
        machine |= {"gpu": torch.cuda.get_device_name(0), "triton": triton.__version__}
    report = {
        "benchmark": "lora-kernels",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": args.quick,
        "dtype": args.dtype,
        "machine": machine,
        "copy_bandwidth_gbs": bandwidth,
        "cases": rows,
    }
    text = json.dumps(report, indent=2)
    print(text)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    path = args.results_dir / f"lora-kernels-{args.device}{suffix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(text + "\n")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
