"""LoRA kernels against their reference: Triton, vectorised torch, dispatcher.

The reference (`lora_reference`) is the per-token loop of the docstring semantics; it is itself
checked against an independent float64 computation of y + scaling * B @ (A @ x) per token. Every
case draws fresh random inputs; y starts as random data (never zeros), and columns outside
out_slice must come back bit-identical, so a kernel writing the wrong columns or rows fails.

Triton runs compiled on a GPU when there is one, else on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports triton). Interpreter cases are
small: each launch runs the kernel in numpy, program by program.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import pytest
import torch
from float_error import lora_error_bound

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # running this file alone, without conftest

from quiver_server.kernels import cpu_ops, lora_torch  # noqa: E402
from quiver_server.kernels.lora_meta import LoraBatchMeta  # noqa: E402
from quiver_server.kernels.lora_projection import LoraProjection  # noqa: E402
from quiver_server.kernels import lora_triton  # noqa: E402
from quiver_server.kernels.lora_reference import add_lora_reference  # noqa: E402
from lora_parts_cases import assert_within_parts_bound, fused_parts, random_batch, reference_per_part  # noqa: E402

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DEFAULT_LAUNCH = lora_triton.LaunchConfig()


def test_triton_runs_interpreted_without_a_gpu() -> None:
    # If this fails, triton was imported before TRITON_INTERPRET was set (see conftest.py).
    if TRITON_DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(lora_triton._sgmv_kernel, InterpretedFunction)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@dataclass
class Case:
    y: torch.Tensor
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: torch.Tensor
    meta: LoraBatchMeta
    out_slice: slice
    slots_per_request: list[int]
    tokens_per_request: list[int]


def make_case(
    tokens_per_request: list[int], slots_per_request: list[int], in_features: int,
    out_features: int, num_slots: int, max_rank: int, ranks: list[int] | None = None,
    dtype: torch.dtype = torch.float32, col_offset: int = 5, extra_cols: int = 3, seed: int = 0,
    rank_major_b: bool = False,
) -> Case:
    """Slot buffers hold adapters of `ranks` (one per slot) zero-padded to max_rank, as the
    adapter manager writes them; y has columns before and after the LoRA's out_slice.
    rank_major_b: lora_b is a transposed view of [S, R, out] storage, as CPU slots hold it."""
    gen = torch.Generator().manual_seed(seed)
    ranks = ranks or [max_rank] * num_slots
    lora_a = torch.zeros(num_slots, max_rank, in_features)
    lora_b = torch.zeros(num_slots, out_features, max_rank)
    for slot, rank in enumerate(ranks):
        lora_a[slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
        lora_b[slot, :, :rank] = torch.randn(out_features, rank, generator=gen) / rank**0.5
    num_tokens = sum(tokens_per_request)
    total_cols = col_offset + out_features + extra_cols
    return Case(
        y=torch.randn(num_tokens, total_cols, generator=gen).to(dtype),
        x=torch.randn(num_tokens, in_features, generator=gen).to(dtype),
        lora_a=lora_a.to(dtype),
        lora_b=lora_b.to(dtype).transpose(1, 2).contiguous().transpose(1, 2) if rank_major_b else lora_b.to(dtype),
        scaling=torch.rand(num_slots, generator=gen) * 2 + 0.25,
        meta=LoraBatchMeta.build(slots_per_request, tokens_per_request, max_rank, "cpu"),
        out_slice=slice(col_offset, col_offset + out_features),
        slots_per_request=slots_per_request,
        tokens_per_request=tokens_per_request,
    )


def float64_expected(case: Case) -> torch.Tensor:
    """Independent of the reference: per request, in float64, from the request lists."""
    y = case.y.double().clone()
    start = 0
    for slot, count in zip(case.slots_per_request, case.tokens_per_request, strict=True):
        if slot >= 0:
            rows = slice(start, start + count)
            h = case.x[rows].double() @ case.lora_a[slot].double().T
            delta = case.scaling[slot].double() * (h @ case.lora_b[slot].double().T)
            y[rows, case.out_slice] += delta
        start += count
    return y


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
             meta: LoraBatchMeta, out_slice: slice, *, backend: str | None = None) -> None:
    """One part as a layer serves a single-part projection (o_proj, down_proj): a `LoraProjection`
    of that part, on `backend` (None: the one QUIVER_LORA_BACKEND or the device picks)."""
    LoraProjection([(lora_a, lora_b, scaling, out_slice, None)], backend).add(y, x, meta)


def run(fn, case: Case) -> torch.Tensor:
    y = case.y.clone()
    fn(y, case.x, case.lora_a, case.lora_b, case.scaling, case.meta, case.out_slice)
    return y


def run_triton(case: Case, config: lora_triton.LaunchConfig = DEFAULT_LAUNCH) -> torch.Tensor:
    """add_lora_triton on TRITON_DEVICE (the metadata rebuilt there); the result back on CPU."""
    device = torch.device(TRITON_DEVICE)
    meta = LoraBatchMeta.build(case.slots_per_request, case.tokens_per_request, case.meta.max_rank, device)
    if case.meta.max_seg_len == 0:  # keep a hand-built meta's missing hint
        meta = LoraBatchMeta(meta.token_slots, meta.seg_indptr, meta.seg_slots, meta.max_rank,
                             meta.is_decode, meta.has_lora)
    y = case.y.to(device, copy=True)
    lora_triton.add_lora_triton(y, case.x.to(device), case.lora_a.to(device), case.lora_b.to(device),
                                case.scaling.to(device), meta, case.out_slice, config)
    return y.cpu()


def assert_matches(actual: torch.Tensor, case: Case, expected: torch.Tensor | None = None) -> None:
    exact = expected is None
    expected = float64_expected(case) if expected is None else expected.double()
    inside = case.out_slice
    assert actual.dtype == case.y.dtype
    # Columns outside the LoRA's slice are never touched, bit for bit.
    assert torch.equal(actual[:, : inside.start], case.y[:, : inside.start])
    assert torch.equal(actual[:, inside.stop :], case.y[:, inside.stop :])
    # Base-model tokens are never touched either.
    base_rows = case.meta.token_slots < 0
    assert torch.equal(actual[base_rows], case.y[base_rows])
    # Within the a-priori rounding bound of the float64 value; against a rounded reference, within
    # the sum of both sides' bounds.
    bound = lora_error_bound(case.y, case.x, case.lora_a, case.lora_b, case.scaling, case.meta.token_slots, inside)
    if not exact:
        bound = 2 * bound
    error = (actual[:, inside].double() - expected[:, inside]).abs()
    assert not torch.isnan(actual).any()
    assert (error <= bound).all(), f"max error over bound {(error / bound.clamp_min(1e-300)).max():.3g}"


# ---------------------------------------------------------------------------------------------
# Metadata


def test_meta_merges_adjacent_requests_of_one_slot_into_one_segment() -> None:
    meta = LoraBatchMeta.build([2, 2, -1, 0, 0, 2], [3, 1, 2, 1, 4, 2], max_rank=16, device="cpu")
    assert meta.token_slots.tolist() == [2, 2, 2, 2, -1, -1, 0, 0, 0, 0, 0, 2, 2]
    assert meta.seg_indptr.tolist() == [0, 4, 6, 11, 13]
    assert meta.seg_slots.tolist() == [2, -1, 0, 2]
    assert meta.token_slots.dtype == meta.seg_indptr.dtype == meta.seg_slots.dtype == torch.int32
    assert (meta.max_rank, meta.is_decode, meta.has_lora, meta.max_seg_len) == (16, False, True, 5)


def test_meta_decode_and_all_base() -> None:
    decode = LoraBatchMeta.build([1, -1, 3], [1, 1, 1], max_rank=8, device="cpu")
    assert decode.is_decode and decode.has_lora
    assert decode.token_slots.tolist() == [1, -1, 3]
    base = LoraBatchMeta.build([-1, -1], [5, 1], max_rank=8, device="cpu")
    assert not base.has_lora and not base.is_decode
    assert base.seg_slots.tolist() == [-1] and base.seg_indptr.tolist() == [0, 6]


def test_meta_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="slots for"):
        LoraBatchMeta.build([0], [1, 2], max_rank=8, device="cpu")
    with pytest.raises(ValueError, match=">= -1"):
        LoraBatchMeta.build([-2], [1], max_rank=8, device="cpu")


# ---------------------------------------------------------------------------------------------
# The reference against float64 math, including the paths the fast backends take.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_matches_float64(dtype: torch.dtype) -> None:
    case = make_case([3, 1, 4, 2], [1, -1, 0, 1], 24, 20, num_slots=3, max_rank=8,
                     ranks=[8, 3, 1], dtype=dtype, seed=1)
    assert_matches(run(add_lora_reference, case), case)


# ---------------------------------------------------------------------------------------------
# Vectorised torch (CPU path): every strategy, many shapes, against the reference.

TORCH_STRATEGIES = {
    "gather_rows": lambda y, x, a, b, s, m, sl: lora_torch.gather_rows(y[:, sl], x, a, b, s, m.token_slots),
    "group_by_slot": lambda y, x, a, b, s, m, sl: lora_torch.group_by_slot(y[:, sl], x, a, b, s, m.token_slots),
    "by_segment": lambda y, x, a, b, s, m, sl: lora_torch.by_segment(y[:, sl], x, a, b, s, m.seg_indptr, m.seg_slots),
    "add_lora_torch": lora_torch.add_lora_torch,
    # The C++ kernel on every batch (prefill rows too: its semantics are per row), and as served.
    "cpu_bgmv": lambda y, x, a, b, s, m, sl: cpu_ops.lora_bgmv(y[:, sl], x, a, b, s, m.token_slots),
    "add_lora_cpu": lora_torch.add_lora_cpu,
    "dispatcher": add_lora,  # LoraProjection: on CPU tensors "auto" is the C++ kernel path (see test below)
}
# The strategies and backends that run the C++ kernels: `make test` runs them once per vector ISA
# and leaves them out of its QUIVER_CPU_KERNELS=0 pass (pyproject's cpu_kernels marker).
_KERNEL_STRATEGIES = {"cpu_bgmv", "add_lora_cpu", "dispatcher"}
STRATEGIES = [pytest.param(name, marks=pytest.mark.cpu_kernels) if name in _KERNEL_STRATEGIES else name
              for name in TORCH_STRATEGIES]
BACKENDS = [pytest.param("cpu", marks=pytest.mark.cpu_kernels), "torch"]


@pytest.mark.cpu_kernels
def test_cpu_kernels_build_here() -> None:
    # make install compiles them; a machine with a C++ compiler must have them (no silent
    # fallback to the torch path in the tests that claim to cover the kernels).
    assert cpu_ops.available()
    from quiver_server.kernels.ops import lora_backend

    assert lora_backend(torch.device("cpu")) == "cpu"
@pytest.mark.cpu_kernels
def test_cpu_bgmv_rejects_bad_input() -> None:
    case = make_case([1, 1], [1, 0], 48, 24, num_slots=2, max_rank=16)
    y = case.y[:, case.out_slice]
    with pytest.raises(RuntimeError, match="not a slot"):
        cpu_ops.lora_bgmv(y, case.x, case.lora_a, case.lora_b, case.scaling,
                          torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="shapes do not fit"):
        cpu_ops.lora_bgmv(y, case.x[:, :40], case.lora_a, case.lora_b, case.scaling, case.meta.token_slots)
    with pytest.raises(RuntimeError, match="lora_b must be"):  # neither layout: every other rank
        wide = torch.zeros(2, 24, 32)
        cpu_ops.lora_bgmv(y, case.x, case.lora_a, wide[:, :, ::2], case.scaling, case.meta.token_slots)
@pytest.mark.cpu_kernels
def test_cpu_slots_hold_lora_b_rank_major(tmp_path) -> None:
    # The layout the C++ kernel's fast expand path reads (see adapters/slots.py).
    from quiver_server.kernels.ops import select_ops

    b = select_ops(torch.device("cpu")).lora_b_buffer(3, 40, 8, torch.float32)
    assert b.shape == (3, 40, 8) and b.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("rank_major_b", [False, True], ids=["b-out-major", "b-rank-major"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", range(6))
def test_torch_paths_match_reference(strategy: str, seed: int, rank_major_b: bool) -> None:
    rng = random.Random(seed)
    decode = seed % 2 == 0
    num_slots = rng.choice([1, 4, 32])
    max_rank = rng.choice([8, 16, 64, 128])
    num_requests = rng.randint(1, 24)
    tokens, slots = random_batch(rng, num_requests, 1 if decode else 40, num_slots)
    ranks = [rng.randint(1, max_rank) for _ in range(num_slots)]
    case = make_case(tokens, slots, rng.choice([64, 96, 256]), rng.choice([64, 72, 320]),
                     num_slots, max_rank, ranks, dtype=rng.choice(DTYPES), seed=seed,
                     rank_major_b=rank_major_b)
    if not case.meta.has_lora:
        case = make_case(tokens, [0] * len(tokens), 64, 64, num_slots, max_rank, ranks, seed=seed,
                         rank_major_b=rank_major_b)
    assert case.lora_b.transpose(1, 2).is_contiguous() == rank_major_b
    actual = run(TORCH_STRATEGIES[strategy], case)
    assert_matches(actual, case, expected=run(add_lora_reference, case))
    assert_matches(actual, case)


@pytest.mark.parametrize("rank_major_b", [False, True], ids=["b-out-major", "b-rank-major"])
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_torch_paths_prefill_mixed_segments(strategy: str, dtype: torch.dtype, rank_major_b: bool) -> None:
    # Segments of length 1 next to long ones, base tokens between adapters, a slot used twice.
    case = make_case([1, 17, 1, 1, 9, 1], [3, 0, -1, 3, 3, 1], 128, 48, num_slots=4, max_rank=16,
                     ranks=[16, 1, 7, 16], dtype=dtype, col_offset=48, seed=3, rank_major_b=rank_major_b)
    assert_matches(run(TORCH_STRATEGIES[strategy], case), case)


# ---------------------------------------------------------------------------------------------
# Triton kernels under the interpreter.


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_rank,ranks", [(16, [16, 5, 1]), (128, [128, 64, 3])])
def test_triton_bgmv_decode(dtype: torch.dtype, max_rank: int, ranks: list[int]) -> None:
    # Every slot, repeated slots and base rows; in/out not multiples of the tiles.
    slots = [2, -1, 0, 1, 2, -1, 0]
    case = make_case([1] * len(slots), slots, 72, 40, num_slots=3, max_rank=max_rank,
                     ranks=ranks, dtype=dtype, col_offset=24, seed=max_rank)
    assert case.meta.is_decode
    assert_matches(run_triton(case), case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("max_rank,ranks", [(16, [16, 5, 1]), (128, [128, 64, 3])])
def test_triton_sgmv_prefill(dtype: torch.dtype, max_rank: int, ranks: list[int]) -> None:
    # Segments of 1 token, a segment spanning two 64-row blocks, base segments in between.
    case = make_case([1, 70, 2, 1, 4], [1, 0, -1, 2, 0], 40, 72, num_slots=3, max_rank=max_rank,
                     ranks=ranks, dtype=dtype, col_offset=17, seed=max_rank + 1)
    assert not case.meta.is_decode
    assert_matches(run_triton(case), case)


@pytest.mark.parametrize("seed", range(4))
def test_triton_random_shapes_and_launch_configs(seed: int) -> None:
    # Column splits and tile sizes change which program computes what, never the result.
    rng = random.Random(100 + seed)
    decode = seed % 2 == 0
    num_slots = rng.choice([2, 5])
    max_rank = rng.choice([1, 8, 24, 32])
    tokens, slots = random_batch(rng, rng.randint(1, 5), 1 if decode else 40, num_slots)
    slots[0] = max(slots[0], 0)
    ranks = [rng.randint(1, max_rank) for _ in range(num_slots)]
    case = make_case(tokens, slots, rng.choice([16, 33, 80]), rng.choice([16, 50, 130]),
                     num_slots, max_rank, ranks, dtype=rng.choice(DTYPES),
                     col_offset=rng.choice([0, 9]), seed=seed)
    config = lora_triton.LaunchConfig(
        block_m=rng.choice([None, 16, 32]), block_k=rng.choice([None, 16, 32]),
        block_n=rng.choice([None, 16, 32]), splits=rng.choice([None, 1, 3]),
    )
    actual = run_triton(case, config)
    assert_matches(actual, case, expected=run(add_lora_reference, case))


def test_triton_sgmv_without_max_seg_len_hint() -> None:
    # A meta built by hand without max_seg_len: the grid falls back to T row blocks.
    case = make_case([3, 20], [0, 1], 32, 32, num_slots=2, max_rank=8, seed=7)
    meta = case.meta
    case.meta = LoraBatchMeta(meta.token_slots, meta.seg_indptr, meta.seg_slots,
                              meta.max_rank, meta.is_decode, meta.has_lora)
    assert_matches(run_triton(case), case)


# ---------------------------------------------------------------------------------------------
# Dispatcher: a single-part LoraProjection picks the backend and checks shapes
@pytest.mark.cpu_kernels
def test_all_base_batch_is_a_no_op_for_every_backend() -> None:
    case = make_case([3, 1], [-1, -1], 32, 16, num_slots=2, max_rank=8)
    for backend in ("cpu", "torch", "reference", "triton"):
        y = case.y.clone()
        add_lora(y, case.x, case.lora_a, case.lora_b, case.scaling, case.meta, case.out_slice, backend=backend)
        assert torch.equal(y, case.y)


def test_dispatcher_backends_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([2, 1, 5], [1, -1, 0], 48, 24, num_slots=2, max_rank=16, seed=11)
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "reference")
    assert torch.equal(run(add_lora, case), run(add_lora_reference, case))
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "auto")
    monkeypatch.setenv("QUIVER_CPU_KERNELS", "0")  # auto falls back to torch; forcing cpu is refused
    assert torch.equal(run(add_lora, case), run(lora_torch.add_lora_torch, case))
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "cpu")
    with pytest.raises(ValueError, match="C\\+\\+ CPU kernels are not available"):
        run(add_lora, case)
    monkeypatch.setenv("QUIVER_LORA_BACKEND", "bogus")
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        run(add_lora, case)


def test_dispatcher_rejects_mismatched_shapes() -> None:
    case = make_case([2, 1], [1, 0], 48, 24, num_slots=2, max_rank=16)
    y = case.y.clone()
    with pytest.raises(ValueError, match="out_features 24"):
        add_lora(y, case.x, case.lora_a, case.lora_b, case.scaling, case.meta, slice(0, 20))
    with pytest.raises(ValueError, match="dtypes differ"):
        add_lora(y, case.x.half(), case.lora_a, case.lora_b, case.scaling, case.meta, case.out_slice)
    with pytest.raises(ValueError, match="in_features"):
        add_lora(y, case.x[:, :40], case.lora_a, case.lora_b, case.scaling, case.meta, case.out_slice)


# ---------------------------------------------------------------------------------------------
# Several parts of one fused projection (q|k|v, gate|up) in one call.


@pytest.mark.parametrize("with_ranks", [False, True], ids=["padded", "slot-ranks"])
@pytest.mark.parametrize("rank_major_b", [False, True], ids=["b-out-major", "b-rank-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_parts_equal_one_reference_call_per_part(dtype, rank_major_b, backend, with_ranks) -> None:
    y, x, parts, meta = fused_parts(dtype, rank_major_b, num_rows=29, seed=7)
    expected = reference_per_part(y, x, parts, meta)
    if not with_ranks:
        parts = [(*part[:4], None) for part in parts]
    actual = y.clone()
    LoraProjection(parts, backend).add(actual, x, meta)
    # Columns outside every part and base rows are untouched, bit for bit.
    assert torch.equal(actual[:, :3], y[:, :3]) and torch.equal(actual[:, -5:], y[:, -5:])
    base_rows = meta.token_slots < 0
    assert torch.equal(actual[base_rows], y[base_rows])
    assert_within_parts_bound(actual, expected, y, x, parts, meta)


@pytest.mark.parametrize("step", ["decode", "prefill"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rank_major_b", [False, True], ids=["b-out-major", "b-rank-major"])
def test_slot_ranks_bound_what_the_kernel_reads(rank_major_b: bool, backend: str, step: str) -> None:
    """With slot_ranks the kernels must not read past a slot's rank: fill the padding with large
    values, and the result must still be the reference on the zero-padded buffers (a kernel that
    read the padding would be off by about 1e3). Decode rows take the one-call BGMV kernel on
    CPU, prefill segments the per-segment matmuls."""
    y, x, parts, meta = fused_parts(torch.float32, rank_major_b, num_rows=17, seed=3)
    if step == "prefill":
        lengths = [40, 33, 20, 30]
        meta = LoraBatchMeta.build([2, 4, -1, 0], lengths, 16, "cpu")
        gen = torch.Generator().manual_seed(5)
        y = torch.randn(sum(lengths), y.shape[1], generator=gen)
        x = torch.randn(sum(lengths), x.shape[1], generator=gen)
    expected = reference_per_part(y, x, parts, meta)
    polluted = []
    for lora_a, lora_b, scaling, out_slice, ranks in parts:
        a, b = lora_a.clone(), lora_b.clone()
        for slot, rank in enumerate(ranks.tolist()):
            a[slot, rank:] = 1e3
            b[slot, :, rank:] = 1e3
        polluted.append((a, b, scaling, out_slice, ranks))
    actual = y.clone()
    LoraProjection(polluted, backend).add(actual, x, meta)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # The same buffers without slot_ranks read the padding (the control).
    control = y.clone()
    LoraProjection([(*part[:4], None) for part in polluted], backend).add(control, x, meta)
    assert (control - expected).abs().max() > 1.0
@pytest.mark.cpu_kernels
def test_fused_parts_kernel_rejects_bad_input() -> None:
    y, x, parts, meta = fused_parts(torch.float32, True, num_rows=4, seed=1)
    a, b, s, _, r = zip(*parts, strict=True)
    a, b, r = list(a), list(b), list(r)
    slots = meta.token_slots
    with pytest.raises(RuntimeError, match="shapes do not fit"):  # a part past y's last column
        cpu_ops.lora_bgmv_parts(y, x, a, b, r, [0, 48, y.shape[1] - 10], s[0], slots)
    with pytest.raises(RuntimeError, match="one lora_a, lora_b and column per part"):
        cpu_ops.lora_bgmv_parts(y, x, a, b[:2], r, [3, 51, 75], s[0], slots)
    with pytest.raises(RuntimeError, match="slot_ranks: none, or one per part"):
        cpu_ops.lora_bgmv_parts(y, x, a, b, r[:2], [3, 51, 75], s[0], slots)
    too_big = r[1].clone()
    too_big[0] = 9  # the middle part's buffers hold rank 8
    with pytest.raises(RuntimeError, match="outside 0..8"):
        cpu_ops.lora_bgmv_parts(y, x, a, b, [r[0], too_big, r[2]], [3, 51, 75], s[0], slots)
    with pytest.raises(RuntimeError, match="slot_ranks must be contiguous int32"):
        cpu_ops.lora_bgmv_parts(y, x, a, b, [r[0], r[1].long(), r[2]], [3, 51, 75], s[0], slots)
    # The Python entry point checks the per-step shapes before the kernel sees them.
    with pytest.raises(ValueError, match="do not fit parts of in_features 64"):
        LoraProjection(parts, "cpu").add(y, x[:, :40].contiguous(), meta)
    with pytest.raises(ValueError, match="slot_ranks must be int32"):
        LoraProjection([(*parts[0][:4], r[0].long())], "cpu").add(y, x, meta)
    with pytest.raises(ValueError, match="in_features"):  # parts that disagree on x's width
        LoraProjection([parts[0], (a[1][:, :, :40], *parts[1][1:])], "cpu").add(y, x, meta)


# ---------------------------------------------------------------------------------------------
# The C++ SGMV kernel (prefill segments, CPU slots' rank-major lora_B).


def _sgmv_case(dtype: torch.dtype, in_features: int, widths: tuple[int, ...], seed: int):
    """Parts of `widths` over one x in rank-major slot buffers of max rank 16 holding ranks
    16, 8, 5 and 0 (slot 3 targets no part); segments of 70 rows (three 32-row tiles), 1 and 5
    rows (fewer than a 4-row block), base rows between adapters, one slot twice."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, max_rank = 4, 16
    scaling = torch.rand(num_slots, generator=gen) * 2 + 0.25
    parts, start = [], 2
    for width in widths:
        a = torch.zeros(num_slots, max_rank, in_features)
        b = torch.zeros(num_slots, max_rank, width)
        ranks = torch.tensor([16, 8, 5, 0], dtype=torch.int32)
        for slot, rank in enumerate(ranks.tolist()):
            a[slot, :rank] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            b[slot, :rank] = torch.randn(rank, width, generator=gen) / max(rank, 1)**0.5
        parts.append((a.to(dtype), b.to(dtype).transpose(1, 2), scaling, slice(start, start + width), ranks))
        start += width
    lengths, slots = [70, 1, 5, 33, 4, 6], [0, -1, 1, 2, 0, 3]
    meta = LoraBatchMeta.build(slots, lengths, max_rank, "cpu")
    y = torch.randn(sum(lengths), start + 3, generator=gen).to(dtype)
    x = torch.randn(sum(lengths), in_features, generator=gen).to(dtype)
    return y, x, parts, meta


@pytest.mark.cpu_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features,widths", [(64, (64, 128)), (72, (130, 8, 64))], ids=["blocks", "tails"])
def test_cpu_sgmv_matches_reference(dtype: torch.dtype, in_features: int, widths: tuple[int, ...]) -> None:
    # Widths and in_features on and off the kernel's vector blocks (16 floats, 64 outputs).
    y, x, parts, meta = _sgmv_case(dtype, in_features, widths, seed=in_features)
    assert not meta.is_decode and all(cpu_ops.rank_major(part[1]) for part in parts)
    expected = reference_per_part(y, x, parts, meta)
    actual = y.clone()
    a, b, s, slices, r = zip(*parts, strict=True)
    cpu_ops.lora_sgmv_parts(actual, x, list(a), list(b), list(r), [sl.start for sl in slices], s[0],
                            meta.seg_indptr, meta.seg_slots)
    assert torch.equal(actual[:, :2], y[:, :2]) and torch.equal(actual[:, -3:], y[:, -3:])
    untouched = (meta.token_slots < 0) | (meta.token_slots == 3)  # base rows; slot 3 has rank 0
    assert torch.equal(actual[untouched], y[untouched])
    assert_within_parts_bound(actual, expected, y, x, parts, meta)
    # As served: a fused projection's prefill on the CPU backend takes this kernel.
    served = y.clone()
    LoraProjection(parts, "cpu").add(served, x, meta)
    assert torch.equal(served, actual)
@pytest.mark.cpu_kernels
def test_cpu_sgmv_rejects_bad_input() -> None:
    y, x, parts, meta = _sgmv_case(torch.float32, 64, (64,), seed=2)
    a, b, s, _, r = parts[0]
    args = dict(y=y, x=x, lora_a=[a], lora_b=[b], slot_ranks=[r], columns=[2], scaling=s)
    with pytest.raises(RuntimeError, match="lora_b must be a transposed view"):
        cpu_ops.lora_sgmv_parts(**{**args, "lora_b": [b.contiguous()]}, seg_indptr=meta.seg_indptr,
                                seg_slots=meta.seg_slots)
    with pytest.raises(RuntimeError, match="run from 0 to the row count"):
        cpu_ops.lora_sgmv_parts(**args, seg_indptr=meta.seg_indptr - 1, seg_slots=meta.seg_slots)
    with pytest.raises(RuntimeError, match="not a slot"):
        cpu_ops.lora_sgmv_parts(**args, seg_indptr=meta.seg_indptr, seg_slots=meta.seg_slots + 4)
    with pytest.raises(RuntimeError, match="must not decrease"):
        bad = meta.seg_indptr.clone()
        bad[1] = bad[2] + 1  # [0, 72, 71, ...]
        cpu_ops.lora_sgmv_parts(**args, seg_indptr=bad, seg_slots=meta.seg_slots)
    assert torch.equal(y, _sgmv_case(torch.float32, 64, (64,), seed=2)[0])  # nothing was written
