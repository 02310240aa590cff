"""The fused Triton row ops (`kernels/rowops_triton.py`) against the torch ops they replace (the
shard's `KernelOps`, `layers/norm.py`, `layers/activation.py`, `write_kv`, `torch_ops`) and,
where float32 arithmetic cannot be expected to agree bit for bit (sums in another order, exp and
tanh from other formulas), against float64 within a stated rounding bound that torch's own
result meets too: RMSNorm (Llama and Gemma forms, with and without the fused residual add),
rotary with the paged KV write (full and partial rotary, scattered and padding slots, strided
views of a fused qkv output and of a joint KV tensor), SiLU and GELU-tanh gating, and greedy
argmax with its log-softmax (ties, masked and very negative logits, NaN and infinities).
Ragged row counts, widths that are not powers of two, float32/bfloat16/float16.

Triton runs compiled on a GPU when there is one, else in Triton's CPU interpreter
(TRITON_INTERPRET=1, set by conftest.py before anything imports triton): every launch runs
program by program in numpy, so the cases are a few dozen rows.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from float_error import FLOAT32_UNIT_ROUNDOFF, UNIT_ROUNDOFF, gamma

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # running this file alone, without conftest

from quiver_server.kernels import rowops_triton, torch_ops  # noqa: E402
from quiver_server.kernels.ops import KernelOps  # noqa: E402
from quiver_server.kernels.rowops_triton import (  # noqa: E402
    GREEDY_BLOCK_V,
    gated_activation,
    greedy_logprob,
    rms_norm,
    rotary_,
    rotary_and_write_kv,
)
from quiver_server.kernels.torch_ops import gelu_tanh_and_mul  # noqa: E402
from quiver_server.layers.attention import write_kv  # noqa: E402
from quiver_server.layers.norm import GemmaRMSNorm, RMSNorm  # noqa: E402
from quiver_server.layers.rotary import RopeConfig, RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
U = FLOAT32_UNIT_ROUNDOFF
TORCH_OPS = KernelOps(torch.device("cpu"), "torch", None)  # the plain-torch reference ops


def test_triton_runs_interpreted_without_a_gpu() -> None:
    # If this fails, triton was imported before TRITON_INTERPRET was set (see conftest.py).
    if DEVICE.type == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        assert isinstance(rowops_triton._rms_norm_kernel, InterpretedFunction)


def strided(t: torch.Tensor, pad: int = 3) -> torch.Tensor:
    """t's values in a view whose rows are `pad` columns apart from dense (a slice of a wider tensor)."""
    wide = torch.full((*t.shape[:-1], t.shape[-1] + pad), float("nan"), dtype=t.dtype)
    wide[..., : t.shape[-1]] = t
    return wide[..., : t.shape[-1]]


def assert_within(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    error = (result.double().cpu() - exact).abs()
    assert (error <= bound).all(), f"max error over bound {(error / bound).max():.3g}"


def subnormal_ulp(dtype: torch.dtype) -> float:
    """The spacing of dtype's subnormals: the absolute error of a rounding below the normal range."""
    return torch.finfo(dtype).tiny * 2 * UNIT_ROUNDOFF[dtype]


def same_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of equal elements. Two 16-bit results with the same rounding points differ only
    where float32 values a few ulp apart round to different 16-bit ones (a few percent of them
    here); dropping one rounding point (the 16-bit act or normed x before the product) changes
    about a quarter of them (measured for all three ops in bfloat16 and float16)."""
    return (a.cpu() == b.cpu()).double().mean().item()


# ---- RMSNorm -------------------------------------------------------------------------------


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """The model's own norm layer on the torch ops."""
    layer = (GemmaRMSNorm if gemma else RMSNorm)(x.shape[1], eps, TORCH_OPS)
    with torch.no_grad():
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        return layer(x)


def norm_exact_and_bound(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> tuple[torch.Tensor, ...]:
    """float64 RMSNorm and a bound on a float32 computation stored in x's dtype d: the inverse
    root has relative error <= gamma(D + 4) (D squares summed in any order, the division, eps,
    the root and the reciprocal); then Llama's x * inv rounded to d, times w rounded to d, or
    Gemma's (x * inv) * fl(1 + w) rounded to d: two float32 roundings and two to d, u_d each
    (or a subnormal ulp each, below float16's normal range)."""
    h = x.double()
    scale = 1.0 + weight.double() if gemma else weight.double()
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * scale
    relative = gamma(x.shape[1] + 4) + 2 * U + 2 * UNIT_ROUNDOFF[x.dtype]
    return exact, 1.01 * (relative * exact.abs() + subnormal_ulp(x.dtype) * (1 + scale.abs()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 80), (7, 1000), (33, 64)])
@pytest.mark.parametrize("gemma", [False, True])
def test_rms_norm_matches_the_norm_layers_and_float64(dtype, rows, width, gemma) -> None:
    gen = torch.Generator().manual_seed(rows * width + gemma)
    x = strided((torch.randn(rows, width, generator=gen) * 3).to(dtype))
    # Gemma's checkpoints store w near 0 (the scale is 1 + w) in the model's dtype.
    weight = (torch.randn(width, generator=gen) * (0.3 if gemma else 1.0)).to(dtype)
    got = rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-6, gemma=gemma)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    want = norm_reference(x, weight, 1e-6, gemma)
    exact, bound = norm_exact_and_bound(x, weight, 1e-6, gemma)
    assert_within(got, exact, bound)
    assert_within(want, exact, bound)
    if dtype != torch.float32:
        assert same_fraction(got, want) > 0.9  # the same rounding points as torch (see below)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual_scale", [1.0, 0.22])
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_residual_add_writes_the_stream_back_and_norms_it(dtype, residual_scale, gemma) -> None:
    # The decoder's `x = x + block_out * m; h = norm(x)` (m: Granite's residual multiplier):
    # the stream is updated in place, bit for bit torch's, and its norm returned.
    gen = torch.Generator().manual_seed(int(residual_scale * 100) + gemma)
    rows, width = 11, 80
    block_out = (torch.randn(rows, width, generator=gen) * 2).to(dtype)
    stream = (torch.randn(rows, width, generator=gen) * 5).to(dtype)
    weight = (torch.randn(width, generator=gen) * 0.5).to(dtype)
    expected_stream = stream + block_out * residual_scale if residual_scale != 1.0 else stream + block_out
    # The stream as a strided slice of a wider buffer: its neighbour columns must stay NaN.
    wide = torch.full((rows, width + 3), float("nan"), dtype=dtype, device=DEVICE)
    wide[:, :width] = stream.to(DEVICE)
    got = rms_norm(block_out.to(DEVICE), weight.to(DEVICE), 1e-5, residual=wide[:, :width],
                   residual_scale=residual_scale, gemma=gemma)
    assert torch.equal(wide[:, :width].cpu(), expected_stream)
    assert torch.isnan(wide[:, width:]).all()
    # The norm of the new stream, exactly as the kernel normalises a row without the add.
    assert torch.equal(got, rms_norm(expected_stream.to(DEVICE), weight.to(DEVICE), 1e-5, gemma=gemma))
    exact, bound = norm_exact_and_bound(expected_stream, weight, 1e-5, gemma)
    assert_within(got, exact, bound)


def test_rms_norm_of_no_rows_and_bad_input() -> None:
    assert rms_norm(torch.empty(0, 80, device=DEVICE), torch.ones(80, device=DEVICE), 1e-6).shape == (0, 80)
    x, w = torch.randn(3, 16), torch.randn(16)
    with pytest.raises(ValueError, match="x's dtype"):
        rms_norm(x, w.half(), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, w, 1e-6, residual=torch.randn(3, 16).half())
    with pytest.raises(ValueError, match=r"\[T, D\]"):
        rms_norm(x[None], w, 1e-6)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        rms_norm(x.double(), w.double(), 1e-6)


# ---- rotary and the KV write ---------------------------------------------------------------


class RotaryCase:
    """A fused qkv projection output [T, heads + 2 kv_heads, D] (its q/k and v parts strided
    views), cos/sin of scattered positions from the model's RotaryEmbedding, and caches of
    random values with the tokens' slots scattered over them (one token a padding row, -1)."""

    def __init__(self, tokens: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads = heads, kv_heads
        self.qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
        rope = RopeConfig(theta=10000.0, partial_rotary_factor=rotary_dim / head_dim)
        assert rope.rotary_dim(head_dim) == rotary_dim
        positions = torch.randint(0, 4000, (tokens,), generator=gen)
        self.cos, self.sin = RotaryEmbedding(rope, head_dim, torch.device("cpu")).cos_sin(positions, dtype)
        num_blocks = tokens // block_size + 4
        self.slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        if tokens:
            self.slots[tokens // 2] = -1
        # K and V as the halves of one joint tensor: strided caches, as a combined KV allocation gives.
        self.kv = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, generator=gen).to(dtype)

    def parts(self, qkv: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        split = self.heads + self.kv_heads
        return qkv[:, :split], qkv[:, split:], kv[:, 0], kv[:, 1]

    def triton(self, slot_dtype: torch.dtype = torch.long,
               cache_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cache_dtype: caches narrower than the model's (`--kv-cache-dtype`), holding the
        initial values as rounded (`rounded_to`)."""
        kv = self.kv if cache_dtype is None else rounded_to(self.kv, cache_dtype)
        qkv, kv = self.qkv.clone().to(DEVICE), kv.clone().to(DEVICE)
        qk, v, k_cache, v_cache = self.parts(qkv, kv)
        assert qk.numel() == 0 or not (qk.is_contiguous() or k_cache.is_contiguous())
        returned = rotary_and_write_kv(qk, v, self.cos.to(DEVICE), self.sin.to(DEVICE), k_cache, v_cache,
                                       self.slots.to(DEVICE, slot_dtype))
        assert returned is qk
        return qkv.cpu(), kv.cpu()

    def torch_path(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What `Attention.store_kv` does with the torch ops (padding rows left out of write_kv)."""
        qkv, kv = self.qkv.clone(), self.kv.clone()
        qk, v, k_cache, v_cache = self.parts(qkv, kv)
        full = self.cos.shape[-1] == qk.shape[-1]
        rotated = (TORCH_OPS.rotary if full else TORCH_OPS.partial_rotary)(qk, self.cos, self.sin)
        qk.copy_(rotated)
        real = self.slots >= 0
        k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()  # write_kv views them flat
        write_kv(k_cache, v_cache, qk[real, self.heads :], v[real], self.slots[real])
        return qkv, torch.stack((k_cache, v_cache), dim=1)


def rounded_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache in `dtype` holds it: rounded to nearest, float8 saturated at its largest value."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e4m3fn),
    (torch.float16, torch.float8_e5m2),
])
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (80, 48)])
def test_rotary_and_kv_write_round_into_a_narrower_cache(dtype, cache_dtype, head_dim, rotary_dim) -> None:
    """`--kv-cache-dtype`: q and k turn as in the model's own dtype; the cache receives the
    turned k and v rounded to its dtype, clamped where they pass float8's range."""
    case = RotaryCase(9, 4, 2, head_dim, rotary_dim, 16, dtype, seed=head_dim + rotary_dim)
    case.qkv *= 150  # values past e4m3's 448 (and e5m2's range is not reached in float16)
    qkv, kv = case.triton(cache_dtype=cache_dtype)
    want_qkv, want_kv = case.torch_path()
    assert torch.equal(qkv, want_qkv)
    assert kv.dtype == cache_dtype
    bits = {1: torch.uint8, 2: torch.int16}[kv.element_size()]  # equality that tells -0 from 0
    assert torch.equal(kv.view(bits), rounded_to(want_kv, cache_dtype).view(bits))
    if cache_dtype == torch.float8_e4m3fn:
        assert (want_kv.abs() > 448).any() and kv.float().abs().max() == 448


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim,block_size",
    [
        (4, 2, 64, 64, 16),  # full rotary
        (6, 2, 80, 80, 8),  # a head dim that is not a power of two (half = 40)
        (4, 1, 128, 96, 16),  # Phi-4-mini's partial rotary (factor 0.75)
        (8, 2, 80, 48, 8),  # partial, both parts off powers of two
    ],
)
def test_rotary_and_kv_write_match_store_kv_bit_for_bit(dtype, heads, kv_heads, head_dim, rotary_dim,
                                                        block_size) -> None:
    case = RotaryCase(9, heads, kv_heads, head_dim, rotary_dim, block_size, dtype, seed=heads + head_dim + rotary_dim)
    qkv, kv = case.triton()
    want_qkv, want_kv = case.torch_path()
    # q and k rotated in place (the unrotated tail of each head and v untouched), every real
    # token's k and v in its slot, and every other cache slot (the padding row's included) as it was.
    assert torch.equal(qkv, want_qkv)
    assert torch.equal(kv, want_kv)
    assert not torch.equal(kv, case.kv)


def test_rotary_kv_write_takes_int32_slots_and_no_tokens() -> None:
    case = RotaryCase(5, 4, 2, 32, 32, 4, torch.bfloat16, seed=3)
    (qkv, kv), (want_qkv, want_kv) = case.triton(torch.int32), case.torch_path()
    assert torch.equal(qkv, want_qkv) and torch.equal(kv, want_kv)
    empty = RotaryCase(0, 4, 2, 32, 32, 4, torch.float32, seed=4)
    assert torch.equal(empty.triton()[1], empty.kv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_alone_matches_the_torch_ops(dtype, rotary_dim) -> None:
    gen = torch.Generator().manual_seed(rotary_dim)
    x = torch.randn(7, 5, 64, generator=gen).to(dtype)
    rope = RopeConfig(partial_rotary_factor=rotary_dim / 64)
    cos, sin = RotaryEmbedding(rope, 64, torch.device("cpu")).cos_sin(torch.arange(100, 107), dtype)
    want = (TORCH_OPS.rotary if rotary_dim == 64 else TORCH_OPS.partial_rotary)(x.clone(), cos, sin)
    got = x.to(DEVICE)
    assert rotary_(got, cos.to(DEVICE), sin.to(DEVICE)) is got
    assert torch.equal(got.cpu(), want)


def test_rotary_bad_input_raises() -> None:
    case = RotaryCase(3, 4, 2, 32, 32, 4, torch.float32, seed=5)
    qk, v, k_cache, v_cache = case.parts(case.qkv, case.kv)
    with pytest.raises(ValueError, match="cos must be"):
        rotary_and_write_kv(qk, v, case.cos[:2], case.sin, k_cache, v_cache, case.slots)
    with pytest.raises(ValueError, match="even"):
        rotary_(qk, case.cos[..., :31], case.sin[..., :31])
    with pytest.raises(ValueError, match="caches"):
        rotary_and_write_kv(qk, v, case.cos, case.sin, k_cache[..., :16], v_cache[..., :16], case.slots)
    with pytest.raises(ValueError, match="share a dtype"):
        rotary_and_write_kv(qk, v, case.cos, case.sin, k_cache.half(), v_cache.half(), case.slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_and_write_kv(qk, v, case.cos, case.sin, k_cache, v_cache, case.slots.float())


# ---- gated activations ---------------------------------------------------------------------


def activation_exact_and_bound(gate_up: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 act(gate) * up, and a bound on a float32 act rounded to the dtype d, times up,
    rounded to d (u_d twice, or a subnormal ulp each). The float32 act (exp with range
    reduction, the tanh built from exp, torch's vectorised ones alike) is within
    - silu g / (1 + exp(-g)): (|g| + 8) u relative (exp within (4 + |g|) u relative; 1 + e and
      the division u each);
    - gelu 0.5 g (1 + tanh(b (g + k g^3))): the inner value within 4u relative, so tanh within
      2u + 12u absolute (its slope times that, and the exp form's own roundings), 1 + t within
      14u absolute and the products 2u relative: 8u |g| + 2u |act| in all, doubled here."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    if kind == "silu":
        act = F.silu(gate)
        act_error = (gate.abs() + 8) * U * act.abs()
    else:
        act = F.gelu(gate, approximate="tanh")
        act_error = 16 * U * gate.abs() + 4 * U * act.abs()
    u_d = UNIT_ROUNDOFF[gate_up.dtype]
    exact = act * up
    tiny = subnormal_ulp(gate_up.dtype)
    return exact, 1.01 * (act_error * up.abs() + 2 * u_d * exact.abs() + tiny * (1 + up.abs()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,width", [(1, 80), (9, 1000)])
def test_gated_activation_matches_the_mlp_and_float64(dtype, kind, rows, width) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * 3
    gate_up[0, :8] = torch.tensor([-30.0, -12.0, -5.0, -1e-3, 0.0, 1e-4, 9.0, 40.0])  # tails and zero
    gate_up = strided(gate_up.to(dtype))
    got = gated_activation(gate_up.to(DEVICE), kind)
    assert got.dtype == dtype and got.shape == (rows, width)
    want = torch_ops.silu_and_mul(gate_up) if kind == "silu" else gelu_tanh_and_mul(gate_up)
    exact, bound = activation_exact_and_bound(gate_up, kind)
    assert_within(got, exact, bound)
    assert_within(want, exact, bound)
    if dtype != torch.float32:
        assert same_fraction(got, want) > 0.9  # the same rounding points as torch (see below)


def test_gated_activation_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="unknown activation"):
        gated_activation(torch.randn(2, 8), "relu")
    with pytest.raises(ValueError, match=r"\[T, 2I\]"):
        gated_activation(torch.randn(2, 7), "silu")
    assert gated_activation(torch.randn(0, 8, device=DEVICE), "silu").shape == (0, 4)


# ---- greedy argmax and its log-softmax -----------------------------------------------------


def greedy_exact_and_bound(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 log_softmax at `tokens`, and per row a bound on the kernel's float32 -log(sum exp)
    whose terms are summed lane by lane (a chain of <= 2 roundings and one exp per tile of
    BLOCK_V logits) and the lanes in any order (gamma(BLOCK_V)). A term exp(l - m) has its
    argument rounded against the lane's running maximum m and rescaled as m grows, and the lane
    weighed by exp(m - max): u (max - l) in all, u E[max - l] under the softmax weights; log turns
    the sum's relative error into an absolute one, and the result's rounding adds u |logprob|."""
    exact = logits.double()
    tiles = math.ceil(logits.shape[1] / GREEDY_BLOCK_V)
    weights = torch.softmax(exact, dim=-1)
    distance = exact.max(dim=-1, keepdim=True).values - exact
    mean_distance = (weights * distance.nan_to_num(posinf=0.0)).sum(dim=-1)
    logprob = exact.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(exact, dim=-1)
    chain = min(logits.shape[1], GREEDY_BLOCK_V) + 4 * tiles + 8
    return logprob, 1.01 * U * (chain + mean_distance + logprob.abs())


@pytest.mark.parametrize("vocab", [1000, 32003])
def test_greedy_matches_argmax_and_log_softmax(vocab) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen) * 6
    logits[1, 17] = logits[1, vocab - 5] = logits[1].max() + 1.0  # a tie across tiles: the first wins
    logits[2, :] = -7.0  # all equal: index 0
    logits[3, ::3] = float("-inf")  # masked tokens (a grammar's mask)
    logits[4, -1] = logits[4].max() + 2.0  # the maximum in the last, partial tile
    logits[5] *= 30  # a peaked row: most terms far below the maximum
    logits[6] = logits[6] - 1e4  # very negative logits
    logits[7, :] = -1e30
    logits[7, 900:905] = torch.tensor([-3.0, 2.0, 2.0, -1.0, 1.5])  # a few live tokens, a tie
    logits[8, 5] = logits[8, 5 + 512] = logits[8].max() + 0.5  # a tie within one tile, lanes apart
    logits = strided(logits)
    tokens, logprobs = greedy_logprob(logits.to(DEVICE))
    assert tokens.dtype == torch.long and logprobs.dtype == torch.float32
    want_tokens, want_logprobs = torch_ops.greedy_logprob(logits)
    assert torch.equal(tokens.cpu(), want_tokens)
    assert tokens[1] == 17 and tokens[2] == 0 and tokens[4] == vocab - 1 and tokens[7] == 901 and tokens[8] == 5
    exact, bound = greedy_exact_and_bound(logits, want_tokens)
    assert_within(logprobs, exact, bound)
    # torch computes logits[t] - logsumexp(logits): two roundings at the logits' magnitude (the
    # kernel's -log(sum) has none, so it is the more accurate one on the row near -1e4).
    magnitude = logits.abs().max(dim=-1).values.double()
    assert_within(want_logprobs, exact, bound + 2 * U * magnitude)


def test_greedy_ties_in_one_lane_and_a_vocabulary_of_one() -> None:
    vocab = 3 * GREEDY_BLOCK_V + 10
    logits = torch.zeros(2, vocab)
    for index in (7 + 2 * GREEDY_BLOCK_V, 7 + GREEDY_BLOCK_V, 9):  # lane 7 twice, then an earlier lane
        logits[0, index] = 5.0
    logits[1, 7 + GREEDY_BLOCK_V] = logits[1, 7 + 2 * GREEDY_BLOCK_V] = 5.0  # lane 7 only: its first
    tokens, _ = greedy_logprob(logits.to(DEVICE))
    assert tokens.tolist() == [9, 7 + GREEDY_BLOCK_V]
    tokens, logprobs = greedy_logprob(torch.tensor([[3.5], [-2.0]], device=DEVICE))
    assert tokens.tolist() == [0, 0] and logprobs.tolist() == [0.0, 0.0]


def test_greedy_non_finite_rows_match_torch() -> None:
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(4))
    logits[0, 40] = float("nan")  # torch.argmax picks the NaN
    logits[1, :] = float("-inf")
    logits[2, 7] = float("inf")
    logits[3, 50] = float("nan")
    logits[3, 60] = float("inf")
    logits[4, 280] = logits[4, 10] = float("nan")
    tokens, logprobs = greedy_logprob(logits.to(DEVICE))
    want_tokens, want_logprobs = torch_ops.greedy_logprob(logits)
    assert torch.equal(tokens.cpu(), want_tokens), (tokens, want_tokens)
    assert tokens.tolist() == [40, 0, 7, 50, 10]
    assert torch.isnan(logprobs).all() and torch.isnan(want_logprobs).all()
    with pytest.raises(ValueError, match="float32"):
        greedy_logprob(logits.double())


# ---- no host synchronisation ---------------------------------------------------------------


def test_no_launch_reads_a_device_value_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch's grid and blocks come from shapes: on a GPU, CUDA's sync debug mode errors
    on any synchronising call; on CPU, reading a tensor's value on the host fails here."""
    qk = torch.randn(4, 6, 32, device=DEVICE)
    v = torch.randn(4, 2, 32, device=DEVICE)
    cos, sin = torch.randn(4, 1, 32, device=DEVICE), torch.randn(4, 1, 32, device=DEVICE)
    cache = torch.zeros(4, 8, 2, 32, device=DEVICE)
    slots = torch.tensor([0, 9, -1, 20], device=DEVICE)
    x, w = torch.randn(3, 80, device=DEVICE), torch.randn(80, device=DEVICE)

    def launch_all() -> None:
        rms_norm(x, w, 1e-6, residual=x.clone())
        rotary_and_write_kv(qk, v, cos, sin, cache, cache.clone(), slots)
        gated_activation(torch.randn(3, 64, device=DEVICE), "gelu_tanh")
        greedy_logprob(torch.randn(3, 100, device=DEVICE))

    if DEVICE.type == "cuda":
        launch_all()  # compile first: the first launch of a kernel may synchronise
        torch.cuda.set_sync_debug_mode("error")
        try:
            launch_all()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return

    def host_read(*args: object, **kwargs: object) -> None:
        raise AssertionError("a launch read a tensor's value on the host")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, host_read)
    launch_all()
