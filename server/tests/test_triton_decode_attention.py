"""The Triton paged decode attention (`kernels/paged_decode_triton.py`) against float64 attention
within a stated rounding bound, and against the torch path (`attention_torch.decode_attention`,
itself held to transformers by the model parity tests): grouped-query ratios 1 to 8, head dims
that are and are not powers of two, block sizes 8/16/32, lengths on and off block boundaries,
scattered block tables wider than needed, sliding windows, soft-capped scores, split-K forced
on and off, float32/bfloat16/float16, and NaN wherever the kernel must not read.

Triton runs compiled on a GPU when there is one, else in Triton's CPU interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports triton), where every launch runs
program by program in numpy: cases are a few sequences of at most ~1000 keys.
"""

from __future__ import annotations

import os

import pytest
import torch
from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # running this file alone, without conftest

from quiver_server.engine.forward_batch import build_decode  # noqa: E402
from quiver_server.kernels import cuda_device, paged_decode_triton  # noqa: E402
from quiver_server.kernels.attention_torch import decode_attention as decode_attention_torch  # noqa: E402
from quiver_server.kernels.paged_decode_triton import (  # noqa: E402
    MAX_SPLITS,
    choose_num_splits,
    paged_decode_attention,
    plan_decode,
    workspace_numel,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LENGTHS = [1, 15, 16, 17, 33, 100, 300]


def test_triton_runs_interpreted_without_a_gpu() -> None:
    # If this fails, triton was imported before TRITON_INTERPRET was set (see conftest.py).
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(paged_decode_triton._attend_split_kernel, InterpretedFunction)


class Case:
    """Random q and caches; each sequence owns scattered blocks, and every table row is padded
    with two more valid block ids than it needs (tables are often wider than a batch needs)."""

    def __init__(self, lengths: list[int], heads: int, kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        width = -(-max(max(lengths), 1) // block_size) + 2
        num_blocks = len(lengths) * width + 5
        self.lengths, self.block_size = lengths, block_size
        self.table = torch.randperm(num_blocks, generator=gen)[: len(lengths) * width].view(len(lengths), width)
        self.k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        self.v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
        self.q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
        self.seq_lens = torch.tensor(lengths, dtype=torch.long)

    def positions(self, seq: int, window: int | None) -> torch.Tensor:
        n = self.lengths[seq]
        return torch.arange(max(0, n - window) if window else 0, n)

    def fill_unread_with_nan(self, window: int | None) -> None:
        """NaN in every cache row no sequence may attend to: blocks outside the tables, the
        table's spare columns, the unwritten tail of last blocks, keys before a window."""
        readable = torch.zeros(self.k.shape[:2], dtype=torch.bool)
        for seq in range(len(self.lengths)):
            positions = self.positions(seq, window)
            readable[self.table[seq, positions // self.block_size], positions % self.block_size] = True
        self.k[~readable] = float("nan")
        self.v[~readable] = float("nan")

    def triton(self, scale: float, window: int | None = None, softcap: float | None = None,
               num_splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
        out = paged_decode_attention(self.q.to(DEVICE), self.k.to(DEVICE), self.v.to(DEVICE), self.table.to(DEVICE),
                                     self.seq_lens.to(DEVICE), scale, window, softcap, num_splits=num_splits,
                                     block_n=block_n)
        assert out.dtype == self.q.dtype and out.shape == self.q.shape
        return out.cpu()

    def torch_path(self, scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        batch = build_decode([n - 1 for n in self.lengths], self.table, self.block_size, torch.device("cpu"))
        return decode_attention_torch(self.q.float(), self.k.float(), self.v.float(), batch, scale, window, softcap)

    def exact_and_bound(self, scale: float, window: int | None = None, softcap: float | None = None,
                        splits: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 attention, and per output element a bound on the error of the kernel's float32
        computation in any summation order, stored in q's dtype d (unit roundoff u_d). As in
        test_cpu_attention, with the online softmax and split-K added:
        - a score s_j = scale q.k_j is off by eps_s = gamma(d + 1) scale |q|.|k_j|; a soft cap c
          (slope <= 1) adds its own rounding, within 8 u c for the exp-based tanh, the division
          and the product;
        - key j's weight exp(s_j - m) * alpha... * w_k: the running maxima m come from the scores
          themselves, so |s_j - m| <= max - s_j; the subtraction and the exp (2 ulp) cost
          u (max - s_j) + 4u, and the split's merge weight w_k = exp(m_k - max) as much again;
          the rescale factors alpha multiply both the sum and the normaliser of a split, so
          their errors cancel; in all eps = eps_s + 2 u (max - s_j) + 8u, at most over j;
        - the weighted sum of the L values and the normaliser: each term meets at most one
          product, L additions, two roundings per key tile (rescale and add, <= L tiles), one
          merge product and `splits` merge additions: gamma(3L + splits + 2) each, the
          division u, so |error| <= (2 gamma(3L + splits + 2) + 2 eps + u) sum_j p_j |v_j|;
        - the store to d: 2 u_d |o| (a whole ulp: the interpreter may truncate)."""
        u = FLOAT32_UNIT_ROUNDOFF
        num_seqs, heads, head_dim = self.q.shape
        group = heads // self.k.shape[2]
        exact = torch.zeros(self.q.shape, dtype=torch.float64)
        bound = torch.zeros(self.q.shape, dtype=torch.float64)
        for seq in range(num_seqs):
            positions = self.positions(seq, window)
            if len(positions) == 0:
                continue
            blocks = self.table[seq, positions // self.block_size]
            keys = self.k[blocks, positions % self.block_size].double()  # [L, kv_heads, d]
            values = self.v[blocks, positions % self.block_size].double()
            for head in range(heads):
                qh, kh, vh = self.q[seq, head].double(), keys[:, head // group], values[:, head // group]
                scores = scale * (kh @ qh)
                eps_scores = gamma(head_dim + 1) * scale * (kh.abs() @ qh.abs())
                if softcap:
                    scores = softcap * torch.tanh(scores / softcap)
                    eps_scores = eps_scores + 8 * u * softcap
                weights = torch.softmax(scores, dim=0)
                exact[seq, head] = weights @ vh
                eps = (eps_scores + 2 * u * (scores.max() - scores) + 8 * u).max()
                spread = weights @ vh.abs()
                bound[seq, head] = (2 * gamma(3 * len(positions) + splits + 2) + 2 * eps + u) * spread
        return exact, bound + 2 * UNIT_ROUNDOFF[self.q.dtype] * exact.abs()


def assert_within(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    error = (result.double() - exact).abs()
    assert (error <= bound).all(), f"max error over bound {(error / bound).max():.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,window",
    [
        (4, 4, 64, 16, None),  # no grouping
        (8, 4, 128, 16, None),  # 2 query heads per KV head
        (8, 2, 64, 32, None),  # 4, and 32-token blocks
        (8, 1, 48, 16, None),  # 8, and a head dim padded to 64
        (6, 2, 80, 8, 20),  # 3 (not a power of two), d = 80, 8-token blocks, a window across blocks
        (4, 2, 96, 16, 16),  # a window of exactly one block
    ],
)
def test_matches_float64_and_the_torch_path(dtype, heads, kv_heads, head_dim, block_size, window) -> None:
    case = Case(LENGTHS, heads, kv_heads, head_dim, block_size, dtype, seed=heads * 7 + head_dim + block_size)
    scale = head_dim**-0.5
    whole = case.triton(scale, window, num_splits=1)
    split = case.triton(scale, window, num_splits=3)
    exact, bound = case.exact_and_bound(scale, window, splits=3)
    for result in (whole, split, case.torch_path(scale, window)):
        assert_within(result, exact, bound)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.float16, torch.float8_e5m2),
])
@pytest.mark.parametrize("head_dim,window", [(64, None), (80, 20)])
def test_a_narrower_cache_is_read_as_torch_widens_it(dtype, cache_dtype, head_dim, window) -> None:
    """`--kv-cache-dtype`: bfloat16 or float8 caches under float32 or 16-bit queries, against
    float64 attention of the cache's values as torch converts them, whole and split."""
    case = Case(LENGTHS, 8, 2, head_dim, 16, dtype, seed=head_dim + 3)
    case.k, case.v = case.k.to(cache_dtype), case.v.to(cache_dtype)
    scale = head_dim**-0.5
    exact, bound = case.exact_and_bound(scale, window, splits=3)
    for splits in (1, 3):
        assert_within(case.triton(scale, window, num_splits=splits), exact, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 2.0), (20, 0.5), (None, 50.0)])
def test_soft_capped_scores(dtype, window, softcap) -> None:
    """Gemma 2's attention logit soft-capping: scores capped before the softmax."""
    case = Case([1, 17, 33, 100, 257], 8, 2, 64, 16, dtype, seed=int(softcap * 10))
    case.q = case.q * 4  # scores well past the small caps, so capping changes the weights
    scale = 64**-0.5
    exact, bound = case.exact_and_bound(scale, window, softcap, splits=2)
    uncapped, _ = case.exact_and_bound(scale, window)
    assert ((uncapped - exact).abs() > 10 * bound).any()  # the cap matters in these cases
    for result in (case.triton(scale, window, softcap, num_splits=1), case.triton(scale, window, softcap, num_splits=2),
                   case.torch_path(scale, window, softcap)):
        assert_within(result, exact, bound)


def test_split_k_at_long_context() -> None:
    # One long sequence and a short one, two KV heads: too few programs for the (interpreter's
    # 4 or a GPU's) SMs, so the plan splits; 7 splits leave the short sequence empty ranges.
    case = Case([1000, 40], 8, 2, 64, 16, torch.float32, seed=11)
    scale = 64**-0.5
    chosen = plan_decode(2, 8, 2, 64, case.table.shape[1] * 16, cuda_device.sm_count(DEVICE)).num_splits
    assert chosen > 1
    exact, bound = case.exact_and_bound(scale, splits=7)
    results = [case.triton(scale, num_splits=n) for n in (1, None, 7)]
    results.append(case.triton(scale, num_splits=4, block_n=16))  # many tiles: many rescales per split
    for result in results:
        assert_within(result, exact, bound)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("block_size,window", [(16, None), (16, 1), (16, 20), (8, 16), (16, 4096)])
def test_never_reads_outside_the_tables_or_the_window(num_splits, block_size, window) -> None:
    # NaN in every cache row no sequence may attend to: a kernel that reads a block outside its
    # table, a spare table column, a last block's unwritten tail or a key before its window
    # returns NaN (0 * NaN is NaN, so even a masked-out weight would not hide the read).
    case = Case([3, 16, 18, 40, 70], 4, 2, 32, block_size, torch.float32, seed=block_size + (window or 0))
    case.fill_unread_with_nan(window)
    got = case.triton(0.2, window, num_splits=num_splits)
    exact, bound = case.exact_and_bound(0.2, window, splits=num_splits)
    assert_within(got, exact, bound)


def test_a_window_longer_than_the_sequence_sees_everything() -> None:
    case = Case([5, 40], 4, 2, 32, 16, torch.float32, seed=1)
    assert torch.equal(case.triton(0.2, None, num_splits=2), case.triton(0.2, 4096, num_splits=2))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_empty_padding_rows_get_zeros_and_leave_real_rows_unchanged(num_splits) -> None:
    # A CUDA-graph batch pads to its bucket with rows of length 0: they must not read anything
    # (their table rows point at NaN blocks) and must not disturb the real rows.
    case = Case([20, 0, 37, 0], 4, 2, 32, 16, torch.float32, seed=5)
    case.fill_unread_with_nan(None)
    got = case.triton(0.2, num_splits=num_splits)
    assert torch.equal(got[1], torch.zeros_like(got[1])) and torch.equal(got[3], torch.zeros_like(got[3]))
    exact, bound = case.exact_and_bound(0.2, splits=num_splits)
    assert_within(got, exact, bound)


def test_strided_inputs_int32_metadata_and_a_given_workspace() -> None:
    # q as the query part of a fused qkv projection (rows strided), caches as halves of one KV
    # tensor, int32 tables and lengths, and a workspace reused from the caller.
    case = Case([9, 50, 130], 8, 2, 64, 16, torch.bfloat16, seed=7)
    qkv = torch.randn(3, 8 + 4, 64).to(torch.bfloat16).to(DEVICE)
    qkv[:, :8] = case.q.to(DEVICE)
    kv = torch.stack([case.k, case.v], dim=1).to(DEVICE)  # [blocks, 2, block_size, kv_heads, d]
    q, k, v = qkv[:, :8], kv[:, 0], kv[:, 1]  # views on the device: a copy there would be contiguous
    assert not q.is_contiguous() and not k.is_contiguous()
    table, lens = case.table.to(DEVICE, torch.int32), case.seq_lens.to(DEVICE, torch.int32)
    workspace = torch.full((workspace_numel(3, 8, 64, 3) + 10,), float("nan"), device=DEVICE)
    got = paged_decode_attention(q, k, v, table, lens, 0.125, None, None, num_splits=3, workspace=workspace).cpu()
    assert torch.equal(got, case.triton(0.125, num_splits=3))
    exact, bound = case.exact_and_bound(0.125, splits=3)
    assert_within(got, exact, bound)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(q, k, v, table, lens, 0.125, num_splits=3, workspace=workspace[:100])


def test_split_count_follows_the_programs_and_the_length() -> None:
    sm_count = 132
    assert choose_num_splits(64, 8, 32768, sm_count) == 1  # 512 programs fill the GPU
    assert choose_num_splits(1, 8, 32768, sm_count) == 32  # 8 programs: split as far as allowed
    assert choose_num_splits(4, 8, 32768, sm_count) == 9  # cdiv(264, 32)
    assert choose_num_splits(1, 8, 1024, sm_count) == 4  # at least 256 keys a split
    assert choose_num_splits(1, 8, 100, sm_count) == 1
    assert choose_num_splits(1, 1, 10**6, sm_count) == MAX_SPLITS
    assert workspace_numel(4, 32, 128, 1) == 0 and workspace_numel(4, 32, 128, 3) == 4 * 32 * 3 * 130
    plan = plan_decode(4, 28, 4, 80, 4096, sm_count, num_splits=1)  # Qwen-like GQA 7, d = 80
    assert (plan.num_splits, plan.block_g, plan.block_d) == (1, 16, 128)


def test_bad_input_raises() -> None:
    case = Case([4, 9], 4, 2, 32, 16, torch.float32, seed=3)
    q, k, v, table, lens = case.q, case.k, case.v, case.table, case.seq_lens
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_decode_attention(q[:, :3], k, v, table, lens, 0.2)
    with pytest.raises(ValueError, match="caches in its dtype, bfloat16 or float8"):
        paged_decode_attention(q.double(), k, v, table, lens, 0.2)
    with pytest.raises(ValueError, match="caches in its dtype, bfloat16 or float8"):
        paged_decode_attention(q, k.half(), v.half(), table, lens, 0.2)
    with pytest.raises(ValueError, match="caches in its dtype, bfloat16 or float8"):
        paged_decode_attention(q, k, v.bfloat16(), table, lens, 0.2)
    with pytest.raises(ValueError, match="cache shapes"):
        paged_decode_attention(q[..., :16], k, v, table, lens, 0.2)
    with pytest.raises(ValueError, match="sequences"):
        paged_decode_attention(q, k, v, table[:1], lens, 0.2)
