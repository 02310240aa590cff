"""CPU kernels in C++ (`kernels/cpu/*.cpp`), compiled for this machine on first use.

Ops registered as `torch.ops.quiver_cpu.*`:
- `paged_decode_attention`: decode attention read in place from the paged KV cache (the torch
  path gathers every sequence's blocks into a padded copy first);
- `lora_bgmv`, `lora_bgmv_parts`: the LoRA delta of decode rows, one pass for any mix of
  adapters (the torch path runs a matmul pair per distinct adapter), for one projection or for
  all parts of a fused one (q|k|v, gate|up) at once;
- `lora_sgmv_parts`: the same for prefill segments (rows sharing one adapter), in tiles of rows
  that read their adapter's weights once (the torch path runs a matmul pair per segment and part);
- `rms_norm`, `silu_and_mul`, `rotary_`: one pass each where torch makes 3-6 (elementwise.cpp);
- `greedy_logprob`: argmax and its log-softmax per row of the logits (greedy.cpp);
- `float8_grid_`, `widen_float8`: a float8 KV cache's rounding and widening in one vector pass
  each, where torch's e4m3 conversion is a scalar loop (kv_float8.cpp);
- `write_kv`: a layer's k and v into their cache slots in the cache's dtype, one call where the
  torch path makes two to ten (kv_write.cpp);
- `linear_quant`: weight-only int8/int4 projections, dequantized in registers (linear_quant.cpp,
  driven by `quant_gemm`);
- `linear_int8_dot`: the same weights times activations rounded to int8 in blocks of 32, in
  8-bit integer dot products (linear_int8_dot.cpp: `--quantize-activations int8`).

The build (torch's cpp_extension with ninja, about 20 s on 2 cores) lands in
$QUIVER_KERNEL_DIR, by default `.cache/cpu-kernels` of a source checkout (`make install` builds
it there with `quiver-server build-kernels`) or ~/.cache/quiver/cpu-kernels; a CPU shard that
finds no build makes one during warmup. Where it cannot be built (no C++ compiler) the shard
logs why once and serves with the torch paths; QUIVER_CPU_KERNELS=0 forces those, e.g. to rule
the kernels out while debugging. QUIVER_CPU_ISA=avx2|avx512 builds for that vector width instead
of the widest the CPU runs (`make test` tests each width the host can run this way).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

from quiver_server.engine import kv_cache_dtype
from quiver_server.engine.kv_cache_dtype import FLOAT8_DTYPES

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "cpu" / name
           for name in ("paged_attention.cpp", "lora_bgmv.cpp", "lora_sgmv.cpp", "linear.cpp", "linear_quant.cpp",
                        "linear_int8_dot.cpp", "linear_quant_amx.cpp", "linear_bf16_amx.cpp", "elementwise.cpp",
                        "greedy.cpp", "kv_float8.cpp", "kv_write.cpp", "build_info.cpp")]
# -march=native: the kernels' loops are only worth it in the machine's full vector width (AVX2 or
# AVX-512 with FMA, not the SSE2 of a portable build); builds are kept per CPU (`cpu_fingerprint`)
# and ISA, so a checkout shared by different machines never loads code for another CPU. -fopenmp
# because at::parallel_for is inlined from ATen's headers (without it the kernels run on one
# thread) and for the `omp simd` loops; it binds to the libgomp torch loaded. -ffp-contract=off: no
# fused multiply-adds the source does not ask for, so the row ops round exactly as torch's do
# (rotary is bit-identical to transformers' in float32). -fno-trapping-math: nothing here unmasks
# floating-point traps, and without it GCC keeps a select such as fast_exp's clamp as a branch
# wherever it has no masked vector instructions (AVX2), which left every loop calling fast_exp
# (greedy's sum, the attention softmax, SiLU) scalar there; results are unchanged (no
# reassociation, no contraction).
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
# The vector ISAs the kernels are tuned for (register blocking follows the width: vec_width.h).
# QUIVER_CPU_ISA picks one (default `native`: the widest this CPU runs), so an AVX-512 host can
# build and test the AVX2 code too. GCC keeps to 256-bit vectors on Intel server CPUs unless told.
ISA_CFLAGS = {
    "avx512": ["-mprefer-vector-width=512"],
    "avx2": ["-mno-avx512f"],
}
# /proc/cpuinfo flags each ISA needs: AVX-512 Foundation for the zmm build, AVX2 with FMA for the other.
ISA_CPU_FLAGS = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}

_lock = threading.Lock()
_state: dict[str, object] = {}


def build_dir() -> Path:
    configured = os.environ.get("QUIVER_KERNEL_DIR")
    if configured:
        return Path(configured)
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").is_file() and (checkout / "server" / "quiver_server").is_dir():
        return checkout / ".cache" / "cpu-kernels"
    return Path.home() / ".cache" / "quiver" / "cpu-kernels"


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The first CPU's model name and instruction-set flags from Linux's /proc/cpuinfo (empty
    where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "", set()
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("model name", ""), set(fields.get("flags", "").split())


def cpu_fingerprint() -> str:
    """A short name for this CPU's model and instruction-set flags."""
    model, flags = cpu_model_and_flags()
    if not model and not flags:
        return "unknown-cpu"
    return "cpu-" + hashlib.sha256(f"{model}\n{' '.join(sorted(flags))}".encode()).hexdigest()[:12]


def host_isas() -> list[str]:
    """The kernel ISAs this CPU can run, widest first (empty off x86-64 or without AVX2)."""
    _, flags = cpu_model_and_flags()
    return [isa for isa, needed in ISA_CPU_FLAGS.items() if needed <= flags]


def selected_isa() -> str:
    """The ISA to build for: QUIVER_CPU_ISA (avx2, avx512, or native: the widest this CPU runs;
    `native` with neither means the compiler's own choice for this machine)."""
    wanted = os.environ.get("QUIVER_CPU_ISA", "native").strip().lower() or "native"
    runnable = host_isas()
    if wanted == "native":
        return runnable[0] if runnable else "native"
    if wanted not in ISA_CFLAGS:
        raise ValueError(f"QUIVER_CPU_ISA={wanted!r}: expected one of native, {', '.join(ISA_CFLAGS)}")
    if wanted not in runnable:
        raise ValueError(
            f"QUIVER_CPU_ISA={wanted}: this CPU cannot run it (it runs: {', '.join(runnable) or 'neither'})"
        )
    return wanted


def _compile() -> None:
    from torch.utils import cpp_extension

    try:  # the `ninja` wheel: its binary is not on PATH when the venv is not activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    isa = selected_isa()
    directory = build_dir() / f"{cpu_fingerprint()}-{isa}"
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name="quiver_cpu_kernels", sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS + ISA_CFLAGS.get(isa, []),
        extra_include_paths=[str(SOURCES[0].parent)],
        build_directory=str(directory), is_python_module=False, verbose=False,
    )
    _state["isa"] = isa
    log.info("CPU kernels loaded, built for %s (%d floats per vector)", isa, vector_width())


def available() -> bool:
    """Whether the kernels are loaded (building them on the first call); False when disabled by
    QUIVER_CPU_KERNELS=0 or when the build failed (logged once)."""
    if os.environ.get("QUIVER_CPU_KERNELS", "1") == "0":
        return False
    loaded = _state.get("loaded")
    if loaded is not None:
        return bool(loaded)
    with _lock:
        if "loaded" not in _state:
            selected_isa()  # an ISA this CPU cannot run is the operator's error, not a build failure
            try:
                _compile()
                _state["loaded"] = True
            except Exception as error:  # noqa: BLE001 - any build failure means: use torch
                log.warning("CPU kernels unavailable, serving with the torch paths: %s", error)
                _state["loaded"] = False
    return bool(_state["loaded"])


def loaded_isa() -> str | None:
    """The ISA the loaded kernels were built for (None before `available()` loaded them)."""
    return _state.get("isa")  # type: ignore[return-value]


def vector_width() -> int:
    """Floats per vector in the loaded build (16: AVX-512, 8: AVX2), as compiled."""
    return int(torch.ops.quiver_cpu.vector_width())


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, scale: float, sliding_window: int | None, softcap: float | None = None,
) -> torch.Tensor:
    """q [B, heads, d] over caches [blocks, block_size, kv_heads, d] -> [B, heads, d]; keys
    0 .. seq_lens[s] - 1 of block_tables[s] (the last `sliding_window` of them, if given),
    scores capped to softcap * tanh(score / softcap) when `softcap` is given."""
    return torch.ops.quiver_cpu.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale, sliding_window or 0, softcap or 0.0
    )


def lora_bgmv_parts(
    y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
    slot_ranks: list[torch.Tensor], columns: list[int], scaling: torch.Tensor, token_slots: torch.Tensor,
) -> None:
    """`lora_bgmv` for the parts of one fused projection (shared x and scaling) in one pass:
    y[t, columns[p]:columns[p] + out_p] += scaling[s] * lora_b[p][s] @ (lora_a[p][s] @ x[t]).
    slot_ranks: empty, or per part an int32 [S] of each slot's own rank in that part, promising
    that lora_a[p][s, r:] and lora_b[p][s, :, r:] are zero; those rows are then not read, and a
    slot of rank 0 (the part is not targeted) costs nothing."""
    torch.ops.quiver_cpu.lora_bgmv_parts(y, x.contiguous(), lora_a, lora_b, slot_ranks, columns, scaling,
                                         token_slots)


def rank_major(lora_b: torch.Tensor) -> bool:
    """Whether lora_b [S, out, R] is a transposed view of contiguous [S, R, out] storage (the CPU
    slots' layout, which `lora_sgmv_parts` needs)."""
    slots, out, rank = lora_b.shape
    return lora_b.stride() == (rank * out, 1, out)


def lora_sgmv_parts(
    y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
    slot_ranks: list[torch.Tensor], columns: list[int], scaling: torch.Tensor, seg_indptr: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    """`lora_bgmv_parts` over segments: rows seg_indptr[g] .. seg_indptr[g + 1] - 1 all use slot
    seg_slots[g] (-1: none). lora_b must be in the CPU slots' layout (a transposed view of
    contiguous [S, R, out])."""
    torch.ops.quiver_cpu.lora_sgmv_parts(y, x.contiguous(), lora_a, lora_b, slot_ranks, columns, scaling,
                                         seg_indptr, seg_slots)


def greedy_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [B, V] -> (tokens [B] long, logprobs [B] float32): torch.argmax's token per row
    and logits[token] - logsumexp(logits) (NaN where torch's is NaN too)."""
    return torch.ops.quiver_cpu.greedy_logprob(logits.contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.quiver_cpu.rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    return torch.ops.quiver_cpu.silu_and_mul(gate_up)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, D] in place by cos, sin [T, D]; returns x."""
    torch.ops.quiver_cpu.rotary_(x, cos, sin)
    return x


def as_stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`kv_cache_dtype.as_stored`: x as a cache in `dtype` holds it, in x's dtype (a new tensor
    for a float8 cache, rounded in one pass)."""
    if dtype not in FLOAT8_DTYPES or x.dtype == dtype:
        return kv_cache_dtype.as_stored(x, dtype)
    return torch.ops.quiver_cpu.float8_grid_(x.clone(memory_format=torch.contiguous_format), dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """`layers.attention.write_kv` in one call: k, v [T, kv_heads, D] (any strides) rounded to the
    caches' dtype at the flat slots `slot_mapping` [T] (< 0: not written)."""
    torch.ops.quiver_cpu.write_kv(k_cache, v_cache, k, v, slot_mapping.to(torch.long))


def widen(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache values in `dtype`, exactly (float8 widened in one pass, anything else by torch)."""
    if cache.dtype not in FLOAT8_DTYPES or cache.dtype == dtype:
        return cache.to(dtype)
    return torch.ops.quiver_cpu.widen_float8(cache.contiguous(), dtype)


def lora_bgmv(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, token_slots: torch.Tensor,
) -> None:
    """In place: y[t] += scaling[s] * lora_b[s] @ (lora_a[s] @ x[t]) for rows with slot s >= 0."""
    torch.ops.quiver_cpu.lora_bgmv(y, x.contiguous(), lora_a, lora_b, scaling, token_slots)

