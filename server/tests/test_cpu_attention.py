"""The C++ paged decode attention (`kernels/cpu/paged_attention.cpp`) and the torch path
(`attention_torch.decode_attention`: gather the blocks, SDPA with a mask) against float64 attention
within a stated rounding bound; the torch path is also held to transformers by the model parity
tests. Fragmented block tables, lengths on and off block
boundaries, grouped-query heads, sliding windows, soft-capped scores and 16-bit caches."""

from __future__ import annotations

import pytest
import torch

from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma

from quiver_server.engine.forward_batch import build_decode
from quiver_server.kernels import cpu_ops
from quiver_server.kernels.attention_torch import decode_attention as decode_attention_torch
from quiver_server.kernels.ops import select_ops

CPU = torch.device("cpu")

BLOCK = 16


def _case(lengths: list[int], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths) // BLOCK + 1
    num_blocks = len(lengths) * width + 7
    # Each sequence gets scattered blocks; rows are padded with unrelated (valid) block ids.
    table = torch.randperm(num_blocks, generator=gen)[: len(lengths) * width].view(len(lengths), width)
    k = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, head_dim, generator=gen).to(dtype)
    # build_decode takes the cached lengths before the new token (already written here).
    batch = build_decode([n - 1 for n in lengths], table, BLOCK, torch.device("cpu"))
    return q, k, v, batch


def _exact_and_bound(q, k, v, batch, lengths: list[int], scale: float, window: int | None,
                     softcap: float | None = None):
    """float64 attention of each sequence's keys, and per output element a bound on the error of
    a float32 computation of it in any summation order (then stored in q's dtype d):
    - a score s_j = scale q.k_j is off by at most eps_s = gamma(d + 1) * scale * |q|.|k_j|;
    - exp(s_j - max) then by a relative eps_s + u |s_j - max| + 4u (exp within 2 ulp; a common
      error in the max cancels in the normalisation), at most eps over the keys;
    - the normaliser and the weighted sum of L values add gamma(L) each, the division u,
      so |error| <= (2 gamma(L) + 2 eps + u) * sum_j p_j |v_j|, plus 2 u_d |o| for the store.
    With a soft cap c, s -> c tanh(s / c) has slope at most 1, so it does not grow eps_s, and
    adds its own rounding: within 4u c (the division, tanh within 2 ulp, the product)."""
    u = FLOAT32_UNIT_ROUNDOFF
    num_seqs, heads, head_dim = q.shape
    group = heads // k.shape[2]
    exact = torch.zeros(q.shape, dtype=torch.float64)
    bound = torch.zeros(q.shape, dtype=torch.float64)
    for s, length in enumerate(lengths):
        first = max(0, length - window) if window else 0
        positions = torch.arange(first, length)
        blocks = batch.block_tables[s, positions // BLOCK]
        keys = k[blocks, positions % BLOCK].double()  # [L, kv_heads, d]
        values = v[blocks, positions % BLOCK].double()
        for head in range(heads):
            qh, kh, vh = q[s, head].double(), keys[:, head // group], values[:, head // group]
            scores = scale * (kh @ qh)
            eps_scores = gamma(head_dim + 1) * scale * (kh.abs() @ qh.abs())
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
                eps_scores = eps_scores + 4 * u * softcap
            weights = torch.softmax(scores, dim=0)
            exact[s, head] = weights @ vh
            eps = (eps_scores + u * (scores.max() - scores) + 4 * u).max()
            spread = weights @ vh.abs()
            bound[s, head] = (2 * gamma(len(positions)) + 2 * eps + u) * spread
    return exact, bound + 2 * UNIT_ROUNDOFF[q.dtype] * exact.abs()


def test_kernels_are_built_and_chosen_on_cpu() -> None:
    assert cpu_ops.available()
    q, k, v, batch = _case([7, 40], 4, 2, 32, torch.float32, seed=4)
    kernel = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, 0.2, None)
    assert torch.equal(select_ops(CPU).decode_attention(q, k, v, batch, 0.2, None), kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,window",
    # Head sizes 64 and 128 take the register-tiled kernel (tiles of up to 4 query heads per KV
    # head: groups of 1, 2, 3, 4 and 6 cover whole and partial tiles), 48 and 32 the general one.
    [(8, 8, 64, None), (8, 2, 64, None), (4, 1, 128, None), (6, 3, 48, None), (8, 2, 64, 20), (4, 4, 32, 16),
     (9, 3, 64, None), (12, 2, 64, None), (6, 3, 128, None), (12, 2, 128, 20)],
)
def test_matches_the_torch_path(dtype, heads, kv_heads, head_dim, window) -> None:
    lengths = [1, 15, 16, 17, 32, 33, 100, 257, 2, 64]
    q, k, v, batch = _case(lengths, heads, kv_heads, head_dim, dtype, seed=heads * 7 + head_dim)
    scale = head_dim**-0.5
    exact, bound = _exact_and_bound(q, k, v, batch, lengths, scale, window)
    torch_path = decode_attention_torch(q.float(), k.float(), v.float(), batch, scale, window)
    got = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    for result in (got, torch_path):
        error = (result.double() - exact).abs()
        assert (error <= bound).all(), f"max error over bound {(error / bound).max():.3g}"


NARROW_CACHES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype,cache_dtype", [
    (dtype, cache) for dtype in (torch.float32, torch.bfloat16, torch.float16) for cache in NARROW_CACHES
    if cache != dtype  # a cache in q's own dtype: test_matches_the_torch_path
])
@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [(8, 2, 64, None), (6, 3, 128, 20), (6, 3, 48, None)])
def test_a_narrower_cache_is_read_as_torch_widens_it(dtype, cache_dtype, heads, kv_heads, head_dim, window) -> None:
    """`--kv-cache-dtype`: a bfloat16 or float8 cache under float32 or 16-bit queries, against
    float64 attention of the cache's values as torch converts them (the register kernel for head
    sizes 64 and 128, the general one for 48)."""
    lengths = [1, 15, 16, 17, 100, 257]
    q, k, v, batch = _case(lengths, heads, kv_heads, head_dim, torch.float32, seed=head_dim + heads)
    q, k, v = q.to(dtype), k.to(cache_dtype), v.to(cache_dtype)
    scale = head_dim**-0.5
    exact, bound = _exact_and_bound(q, k, v, batch, lengths, scale, window)
    got = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, scale, window)
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= bound).all()
    # The torch path widens the gathered blocks; both read the same values.
    torch_path = decode_attention_torch(q.float(), k, v, batch, scale, window)
    assert ((torch_path.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("head_dim", [64, 128, 32])
def test_every_float8_pattern_widens_to_its_value(cache_dtype, head_dim) -> None:
    """One key per sequence: attention returns its value row exactly (weight 1, float32 queries).
    The rows hold every byte pattern but NaN's (0x7F, 0xFF; e5m2's NaNs and infinities, which a
    clamped writer never stores), against torch's own conversion of the same bytes."""
    patterns = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = torch.isfinite(patterns.view(cache_dtype).float())
    values = patterns[finite]
    rows = -(-values.numel() // head_dim)
    padded = torch.cat((values, torch.zeros(rows * head_dim - values.numel(), dtype=torch.uint8)))
    v = padded.view(cache_dtype).view(rows, 1, 1, head_dim).expand(rows, BLOCK, 1, head_dim).contiguous()
    k = torch.zeros_like(v)
    q = torch.ones(rows, 1, head_dim)
    tables = torch.arange(rows, dtype=torch.long)[:, None]
    lens = torch.ones(rows, dtype=torch.long)
    got = cpu_ops.paged_decode_attention(q, k, v, tables, lens, 1.0, None)
    assert torch.equal(got[:, 0].flatten(), padded.view(cache_dtype).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(None, 2.0), (20, 0.5), (None, 50.0)])
def test_soft_capped_scores_match_the_torch_path(dtype, window, softcap) -> None:
    """Gemma 2's attention logit soft-capping: scores capped before the softmax, on both paths."""
    lengths = [1, 17, 33, 100, 257]
    q, k, v, batch = _case(lengths, 8, 2, 64, dtype, seed=int(softcap * 10))
    q = q * 4  # scores well past the small caps, so capping changes the weights
    scale = 64**-0.5
    exact, bound = _exact_and_bound(q, k, v, batch, lengths, scale, window, softcap)
    uncapped, _ = _exact_and_bound(q, k, v, batch, lengths, scale, window)
    assert ((uncapped - exact).abs() > 10 * bound).any()  # the cap matters in these cases
    torch_path = decode_attention_torch(q.float(), k.float(), v.float(), batch, scale, window, softcap)
    got = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, scale, window, softcap)
    assert torch.equal(select_ops(CPU).decode_attention(q, k, v, batch, scale, window, softcap), got)
    for result in (got, torch_path):
        error = (result.double() - exact).abs()
        assert (error <= bound).all(), f"max error over bound {(error / bound).max():.3g}"


@pytest.mark.parametrize("lengths,heads,kv_heads", [([300], 8, 2), ([1, 20, 33, 64, 100], 6, 3), ([17, 40], 4, 4)])
def test_few_sequences_split_over_their_kv_heads(lengths, heads, kv_heads) -> None:
    # Fewer sequences than the threads want items: the kernel splits each sequence's KV heads
    # into runs (unevenly when the count does not divide them), which must not change a result.
    q, k, v, batch = _case(lengths, heads, kv_heads, 64, torch.float32, seed=len(lengths))
    scale = 64**-0.5
    exact, bound = _exact_and_bound(q, k, v, batch, lengths, scale, None)
    got = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, scale, None)
    assert ((got.double() - exact).abs() <= bound).all()


def test_a_window_longer_than_the_sequence_sees_everything() -> None:
    q, k, v, batch = _case([5, 40], 4, 2, 32, torch.float32, seed=1)
    full = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, 0.2, None)
    wide = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, 0.2, 4096)
    assert torch.equal(full, wide)


def test_only_the_tables_blocks_are_read() -> None:
    # NaN in every block no sequence owns, and in the unwritten tail of each last block: a
    # kernel that reads past a sequence's length or outside its table returns NaN.
    lengths = [3, 18, 40]
    q, k, v, batch = _case(lengths, 4, 4, 32, torch.float32, seed=2)
    owned = set()
    for s, n in enumerate(lengths):
        for pos in range(n):
            owned.add((int(batch.block_tables[s, pos // BLOCK]), pos % BLOCK))
    for block in range(k.shape[0]):
        for offset in range(BLOCK):
            if (block, offset) not in owned:
                k[block, offset] = float("nan")
                v[block, offset] = float("nan")
    got = cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens, 0.2, None)
    assert not torch.isnan(got).any()


def test_bad_input_raises_instead_of_reading_out_of_bounds() -> None:
    q, k, v, batch = _case([4, 9], 4, 2, 32, torch.float32, seed=3)
    with pytest.raises(RuntimeError, match="outside"):
        cpu_ops.paged_decode_attention(q, k, v, batch.block_tables, batch.seq_lens * 100, 0.2, None)
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        cpu_ops.paged_decode_attention(q, k, v, batch.block_tables + k.shape[0], batch.seq_lens, 0.2, None)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        cpu_ops.paged_decode_attention(q[:, :3], k, v, batch.block_tables, batch.seq_lens, 0.2, None)
    with pytest.raises(RuntimeError, match="the cache must be in q's dtype"):
        cpu_ops.paged_decode_attention(q.double(), k, v, batch.block_tables, batch.seq_lens, 0.2, None)
    with pytest.raises(RuntimeError, match="the cache must be in q's dtype"):
        cpu_ops.paged_decode_attention(q, k.half(), v.half(), batch.block_tables, batch.seq_lens, 0.2, None)
    with pytest.raises(RuntimeError, match="K and V caches must share a dtype"):
        cpu_ops.paged_decode_attention(q, k, v.bfloat16(), batch.block_tables, batch.seq_lens, 0.2, None)
