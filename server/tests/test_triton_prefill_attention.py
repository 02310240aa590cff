"""The Triton paged prefill attention (`kernels/prefill_triton.py`) against float64 attention
within a stated rounding bound, and the torch path (`layers.attention.prefill_attention`, the
semantics the server has today) held to the same bound on the same batches.

Batches are ragged and mixed as the engine makes them: fresh prompts, prompts after a cached
prefix ending on and off a block boundary, chunks continuing a prompt, one-token chunks; block
tables are scattered permutations padded with blocks no sequence owns; the new tokens' K/V are
written with `write_kv` from `build_prefill`'s slot mapping, as the model does before attention.

Triton runs compiled on a GPU when there is one, else on CPU tensors in Triton's interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports triton), program by program in
numpy: the cases are small.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # running this file alone, without conftest

from quiver_server.engine.forward_batch import ForwardBatch, build_prefill  # noqa: E402
from quiver_server.kernels import prefill_triton  # noqa: E402
from quiver_server.kernels.prefill_triton import LaunchConfig, PrefillTiles, paged_prefill_attention  # noqa: E402
from quiver_server.layers.attention import prefill_attention, write_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DEFAULT_TILES = LaunchConfig()
SMALL_TILES = LaunchConfig(block_m=16, block_n=16)  # many query tiles and key steps per sequence

# Fresh prompts (37, 5), a prefix ending on a block boundary (32 + 20), a one-token chunk after
# 40, a chunk off the boundary (21 + 24) and a long prefix (64 + 16) whose keys fill unmasked steps.
LENS = [37, 5, 20, 1, 24, 16]
CONTEXTS = [0, 0, 32, 40, 21, 64]


def test_triton_runs_interpreted_without_a_gpu() -> None:
    # If this fails, triton was imported before TRITON_INTERPRET was set (see conftest.py).
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(prefill_triton._paged_prefill_kernel, InterpretedFunction)


@dataclass
class Case:
    q: torch.Tensor  # [T, heads, d]
    new_k: torch.Tensor  # [T, kv_heads, d], already written to the caches
    new_v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, d]
    v_cache: torch.Tensor
    table: torch.Tensor  # [B, nb] long
    batch: ForwardBatch
    lens: list[int]
    contexts: list[int]

    def keys(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 K and V [context + len, kv_heads, d] of a sequence, read through its table."""
        block_size = self.k_cache.shape[1]
        pos = torch.arange(self.contexts[seq] + self.lens[seq], device=self.table.device)
        blocks = self.table[seq, pos // block_size]
        return (self.k_cache[blocks, pos % block_size].double().cpu(),
                self.v_cache[blocks, pos % block_size].double().cpu())


def make_case(
    lens: list[int], contexts: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
    block_size: int, seed: int, fused_q: bool = False, nan_outside: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> Case:
    """nan_outside: NaN in every cache slot no sequence may read (blocks outside the tables, the
    unwritten tail of each last block, and the prefix before the earliest key a window of that
    size lets the sequence's first new token see); 0 = no window. cache_dtype: caches narrower
    than q (`--kv-cache-dtype`); the new tokens' K/V are written into them rounded."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(contexts, lens, strict=True)]
    owned = [-(-t // block_size) for t in totals]
    width = max(owned) + 1  # every row padded with blocks nobody owns
    num_blocks = sum(owned) + width + 3
    order = torch.randperm(num_blocks, generator=gen)
    spare = order[sum(owned):]
    table = spare[torch.randint(len(spare), (len(lens), width), generator=gen)]
    used = 0
    for s, count in enumerate(owned):
        table[s, :count] = order[used : used + count]
        used += count
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype or dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype or dtype)
    if nan_outside is not None:
        readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for s, total in enumerate(totals):
            first = max(0, contexts[s] - nan_outside + 1) if nan_outside else 0
            pos = torch.arange(first, total)
            readable[table[s, pos // block_size], pos % block_size] = True
        k_cache[~readable] = float("nan")
        v_cache[~readable] = float("nan")
    num_rows = sum(lens)
    new_k = torch.randn(num_rows, kv_heads, head_dim, generator=gen).to(dtype)
    new_v = torch.randn(num_rows, kv_heads, head_dim, generator=gen).to(dtype)
    if fused_q:  # q as the engine gets it: a column view of a fused q|k|v projection
        qkv = torch.randn(num_rows, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
        q = qkv[:, :heads]
    else:
        q = torch.randn(num_rows, heads, head_dim, generator=gen).to(dtype)
    batch = build_prefill(lens, table, block_size, DEVICE, context_lens=contexts)
    k_cache, v_cache, table = k_cache.to(DEVICE), v_cache.to(DEVICE), table.to(DEVICE)
    new_k, new_v, q = new_k.to(DEVICE), new_v.to(DEVICE), q.to(DEVICE)
    write_kv(k_cache, v_cache, new_k, new_v, batch.slot_mapping)
    return Case(q, new_k, new_v, k_cache, v_cache, table, batch, lens, contexts)


def exact_and_bound(
    case: Case, scale: float, window: int | None, softcap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of every new token, and per output element a bound on the error of a
    float32 computation of it in any summation order with the kernel's steps, stored in q's
    dtype d (unit roundoff u_d; a conversion counts a whole ulp, 2 u_d: the interpreter may
    truncate):
    - a score s_t = scale q.k_t is off by at most gamma(d + 1) scale |q|.|k_t| (16-bit products
      are exact in float32); a soft cap c tanh(s / c) has slope <= 1, so keeps that, and adds its
      own rounding: the division (u |s|) and tanh from exp2 with a division and the product, 16 u c;
    - exp2(log2(e) s_t - m) is then off by a relative eps_t = that score error + 2u (|s_t| + |m|)
      (the products by log2(e), its rounding a common factor on every score) + u |s_t - m| +
      4u (exp2 within 2 ulp; the same computed rescale factors multiply numerator and normaliser,
      so their errors cancel); eps = max_t eps_t;
    - the normaliser and the weighted sum of L values, rescaled once per key step, add
      gamma(L + 2 steps + 2) each, the division u, and P rounded to V's dtype before the P @ V
      dot 2 u_d (16-bit only), so |error| <= (2 gamma + 2 eps + u + 2 u_d) * sum_t p_t |v_t|,
      plus 2 u_d |o| for the store."""
    u = FLOAT32_UNIT_ROUNDOFF
    u_d = UNIT_ROUNDOFF[case.q.dtype]
    p_rounding = 2 * u_d if case.q.dtype != torch.float32 else 0.0
    heads, head_dim = case.q.shape[1:]
    group = heads // case.k_cache.shape[2]
    exact = torch.zeros(case.q.shape, dtype=torch.float64)
    bound = torch.zeros(case.q.shape, dtype=torch.float64)
    row = 0
    for s, (length, context) in enumerate(zip(case.lens, case.contexts, strict=True)):
        q_pos = torch.arange(context, context + length)[:, None]
        k_pos = torch.arange(context + length)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        # Slots no row may see can hold NaN (test_only_slots_a_sequence_may_see_are_read).
        seen = visible.any(dim=0)[:, None, None]
        keys, values = (torch.where(seen, x, 0.0).repeat_interleave(group, 1) for x in case.keys(s))  # [L, heads, d]
        q = case.q[row : row + length].double().cpu()  # [n, heads, d]
        scores = scale * torch.einsum("nhd,lhd->hnl", q, keys)
        eps_scores = gamma(head_dim + 1) * scale * torch.einsum("nhd,lhd->hnl", q.abs(), keys.abs())
        if softcap:
            eps_scores = eps_scores + 16 * u * softcap + u * scores.abs()
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        exact[row : row + length] = torch.einsum("hnl,lhd->nhd", weights, values)
        top = scores.amax(dim=-1, keepdim=True)
        eps_t = eps_scores + 2 * u * (scores.abs() + top.abs()) + u * (top - scores) + 4 * u
        eps = eps_t.masked_fill(~visible, 0).amax(dim=-1)  # [heads, n]
        steps = math.ceil((context + length) / 16) + 1
        sums = 2 * gamma(context + length + 2 * steps + 2) + u + p_rounding
        spread = torch.einsum("hnl,lhd->nhd", weights, values.abs())
        bound[row : row + length] = (sums + 2 * eps.T[:, :, None]) * spread
        row += length
    return exact, bound + 2 * u_d * exact.abs()


def check(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    error = (result.double().cpu() - exact).abs()
    assert (error <= bound).all(), f"max error over bound {(error / bound).max():.3g}"


def torch_path(case: Case, scale: float, window: int | None, softcap: float | None = None) -> torch.Tensor:
    """Today's torch prefill in float32 on the same (upcast) inputs."""
    return prefill_attention(case.q.float(), case.new_k.float(), case.new_v.float(), case.batch, scale, window,
                             case.k_cache.float(), case.v_cache.float(), softcap)


def run_kernel(case: Case, scale: float, window: int | None = None, softcap: float | None = None,
               config: LaunchConfig = DEFAULT_TILES) -> torch.Tensor:
    out = paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.table, case.lens, case.contexts,
                                  scale, window, softcap, config=config)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,config,fused_q",
    [
        (4, 4, 64, 16, DEFAULT_TILES, False),  # GQA 1, the server's block size, default tiles
        (4, 2, 128, 32, SMALL_TILES, True),  # GQA 2, another block size, q a view of fused qkv
        (8, 2, 48, 16, SMALL_TILES, False),  # GQA 4, a head_dim padded to 64
    ],
)
def test_ragged_batch_matches_float64_and_the_torch_path(
    dtype, heads, kv_heads, head_dim, block_size, config, fused_q
) -> None:
    case = make_case(LENS, CONTEXTS, heads, kv_heads, head_dim, dtype, block_size,
                     seed=heads * 7 + head_dim, fused_q=fused_q)
    scale = head_dim**-0.5
    exact, bound = exact_and_bound(case, scale, None)
    check(run_kernel(case, scale, config=config), exact, bound)
    check(torch_path(case, scale, None), exact, bound)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.float16, torch.float8_e5m2),
])
@pytest.mark.parametrize("window", [None, 8])
def test_a_narrower_cache_is_read_as_torch_widens_it(dtype, cache_dtype, window) -> None:
    """`--kv-cache-dtype`: every key, the new tokens' included, is read as the cache holds it
    (float64 attention of the cache's values as torch converts them), on the kernel and on the
    torch path, which rounds the new tokens' k/v as stored."""
    case = make_case(LENS, CONTEXTS, 4, 2, 64, dtype, 16, seed=11, cache_dtype=cache_dtype)
    assert case.k_cache.dtype == cache_dtype
    scale = 64**-0.5
    exact, bound = exact_and_bound(case, scale, window)
    check(run_kernel(case, scale, window, config=SMALL_TILES), exact, bound)
    check(prefill_attention(case.q.float(), case.new_k.float(), case.new_v.float(), case.batch, scale, window,
                            case.k_cache, case.v_cache), exact, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,config", [(8, SMALL_TILES), (17, DEFAULT_TILES), (20, SMALL_TILES)])
def test_sliding_window_shorter_than_the_sequences(dtype, window, config) -> None:
    case = make_case(LENS, CONTEXTS, 4, 2, 64, dtype, 16, seed=window)
    scale = 64**-0.5
    exact, bound = exact_and_bound(case, scale, window)
    full, _ = exact_and_bound(case, scale, None)
    assert ((full - exact).abs() > 10 * bound).any()  # the window matters in these cases
    check(run_kernel(case, scale, window, config=config), exact, bound)
    check(torch_path(case, scale, window), exact, bound)


def test_a_window_longer_than_the_sequences_sees_everything() -> None:
    case = make_case(LENS, CONTEXTS, 4, 2, 64, torch.float32, 16, seed=5)
    full = run_kernel(case, 0.125)
    assert torch.equal(full, run_kernel(case, 0.125, window=4096))


@pytest.mark.parametrize("window", [None, 5, 21])
def test_every_alignment_of_a_tile_to_the_key_steps(window) -> None:
    # Contexts of every residue modulo the key step (16) and tiles of 1 to 4 tokens: each way the
    # masked head, unmasked middle and masked tail of a tile's keys can meet a step boundary.
    lens = [1 + r % 4 for r in range(16)]
    contexts = [16 + 3 * r for r in range(16)]
    case = make_case(lens, contexts, 4, 2, 32, torch.float32, 16, seed=11)
    exact, bound = exact_and_bound(case, 0.2, window)
    check(run_kernel(case, 0.2, window, config=SMALL_TILES), exact, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 2.0), (12, 0.5), (None, 50.0)])
def test_soft_capped_scores(dtype, window, softcap) -> None:
    """Gemma 2's attention logit soft-capping: scores capped before the softmax."""
    case = make_case(LENS, CONTEXTS, 4, 2, 64, dtype, 16, seed=int(softcap * 10))
    case.q = case.q * 4  # scores well past the small caps, so capping changes the weights
    scale = 64**-0.5
    exact, bound = exact_and_bound(case, scale, window, softcap)
    uncapped, _ = exact_and_bound(case, scale, window)
    assert ((uncapped - exact).abs() > 10 * bound).any()
    check(run_kernel(case, scale, window, softcap, config=SMALL_TILES), exact, bound)
    check(torch_path(case, scale, window, softcap), exact, bound)


@pytest.mark.parametrize("block_size,window", [(16, None), (16, 8), (5, None), (5, 11)])
def test_only_slots_a_sequence_may_see_are_read(block_size, window) -> None:
    # NaN in every block outside the tables (their padding points there too), in the unwritten
    # tail of each last block and, with a window, in the prefix before it: a kernel that reads
    # any of them returns NaN. Block size 5: not a power of two, keys steps cross blocks.
    case = make_case(LENS, CONTEXTS, 4, 2, 32, torch.float32, block_size, seed=block_size,
                     nan_outside=window or 0)
    exact, bound = exact_and_bound(case, 0.2, window)
    assert exact.isfinite().all()
    for config in (DEFAULT_TILES, SMALL_TILES):
        check(run_kernel(case, 0.2, window, config=config), exact, bound)
    case.table = case.table.int()  # int32 tables read the same blocks
    check(run_kernel(case, 0.2, window), exact, bound)


def test_tiles_cover_every_row_once_heaviest_first() -> None:
    lens, contexts = [37, 5, 0, 20, 1], [0, 3, 9, 32, 40]
    tiles = PrefillTiles.build(lens, contexts, 8, 2, 64, torch.float16, torch.device("cpu"), SMALL_TILES)
    assert tiles.plan.group_pad == 4 and tiles.plan.block_q == 4  # 16 rows: 4 tokens x 4 heads
    seen = torch.zeros(sum(lens), dtype=torch.int32)
    starts = torch.tensor(lens).cumsum(0) - torch.tensor(lens)
    for seq, row0, pos0, rows in tiles.table.tolist():
        assert 1 <= rows <= tiles.plan.block_q
        assert pos0 == contexts[seq] + row0 - starts[seq]
        assert row0 + rows <= starts[seq] + lens[seq]
        seen[row0 : row0 + rows] += 1
    assert (seen == 1).all()
    work = (tiles.table[:, 2] + tiles.table[:, 3]).tolist()
    assert work == sorted(work, reverse=True)
    # Without context lengths every sequence starts at 0; an empty batch has no tiles.
    fresh = PrefillTiles.build([3, 2], [], 4, 4, 64, torch.float32, torch.device("cpu"))
    assert sorted(fresh.table.tolist()) == [[0, 0, 0, 3], [1, 3, 0, 2]]
    assert PrefillTiles.build([], [], 4, 4, 64, torch.float32, torch.device("cpu")).table.shape == (0, 4)


def test_short_batches_get_short_tiles() -> None:
    plan = prefill_triton.plan_prefill(32, 8, 128, torch.bfloat16, 3, True)
    assert plan.block_m == 16 and plan.block_q == 4  # not 128 rows for 3 tokens
    long = prefill_triton.plan_prefill(32, 8, 128, torch.bfloat16, 4000, True)
    assert long.block_m == 128 and long.block_n == 64


def test_bad_input_raises() -> None:
    case = make_case([4, 9], [0, 5], 4, 2, 32, torch.float32, 16, seed=3)
    with pytest.raises(ValueError, match="rows"):
        paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.table, [4, 8], [0, 5], 0.2)
    with pytest.raises(ValueError, match="in q's dtype, bfloat16 or float8"):
        paged_prefill_attention(case.q.double(), case.k_cache, case.v_cache, case.table, [4, 9], [0, 5], 0.2)
    with pytest.raises(ValueError, match="in q's dtype, bfloat16 or float8"):
        paged_prefill_attention(case.q, case.k_cache.half(), case.v_cache.half(), case.table, [4, 9], [0, 5], 0.2)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_prefill_attention(case.q[:, :3], case.k_cache, case.v_cache, case.table, [4, 9], [0, 5], 0.2)
    with pytest.raises(ValueError, match="context lengths"):
        paged_prefill_attention(case.q, case.k_cache, case.v_cache, case.table, [4, 9], [0], 0.2)
