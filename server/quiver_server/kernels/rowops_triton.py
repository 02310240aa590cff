"""Fused row ops in Triton: each op is one launch and one pass over its rows, float32
arithmetic, inputs in float32, bfloat16 or float16, with the rounding points of the torch code it
replaces (`torch_ops`, `layers/norm.py`, `layers/activation.py`, `layers/attention.write_kv`).
rd(v) below is v rounded to the input dtype (to nearest, ties to even: a no-op in float32).

- `rms_norm(x, weight, eps, residual=None, residual_scale=1.0, gemma=False)`, grid (T,), one
  program per row:
      h = x                                                      (no residual)
      h = rd(residual + rd(x * residual_scale)); residual := h   (with one, written in place)
      inv = 1 / sqrt(sum(h * h) / D + eps)                        (float32)
      out = rd(w * rd(h * inv))                                   (Llama: torch_ops.rms_norm)
      out = rd((h * inv) * (1 + w))                               (gemma: GemmaRMSNorm, 1 + w in float32)
  The residual form is vLLM's fused_add_rms_norm with the decoder's `_residual` (x is the block's
  output, residual the stream): both outputs, one read of each input.
- `rotary_and_write_kv(qk, v, cos, sin, k_cache, v_cache, slot_mapping)`, grid
  (T, head tiles): qk [T, heads + kv_heads, D] (q heads then k heads, any strides: the views of a
  fused qkv output), rotary_dim R = cos.shape[-1] <= D:
      x1, x2 = x[:R/2], x[R/2:R]  for every q and k head
      x[:R/2]  = rd(rd(x1 * cos[:R/2]) + rd(-x2 * sin[:R/2]))     (in place; columns R: untouched)
      x[R/2:R] = rd(rd(x2 * cos[R/2:]) + rd(x1 * sin[R/2:]))
      k_cache[slot // B, slot % B] = rotated k (all D columns), v_cache[...] = v, slot =
      slot_mapping[t]; a token with slot < 0 (a padding row of a CUDA-graph batch) writes nothing.
      A narrower cache (`--kv-cache-dtype`) gets both rounded to its dtype, float8 clamped first.
  `rotary_(x, cos, sin)` is the same rotation without the cache write.
- `gated_activation(gate_up, kind)`, grid (T, column tiles): [T, 2I] = [gate | up] ->
  rd(rd(act(gate)) * up) [T, I], act = silu: g / (1 + exp(-g)), or gelu_tanh:
  0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh built from exp (`triton_math.tanh`).
- `greedy_logprob(logits)`, grid (B,): float32 [B, V] -> (the first index of the row's maximum,
  as torch.argmax: a NaN counts as the maximum; its log-softmax). One pass: every lane of a
  BLOCK_V tile keeps a running maximum, the first index where it was reached and
  sum exp(l - lane max), updated with one exp per logit; the lanes merge at the end, and
  logprob = -log(sum exp(l - M)) (NaN where M is infinite or the row holds a NaN, as torch).

No host synchronisation: grids and block sizes come from shapes only, so every launch can be
captured in a CUDA graph. The float32 rounding points hold on a GPU too: the launches keep the
compiler from fusing a product and a sum into an FMA (`enable_fp_fusion=False`), so rotary and
the residual add give torch's bits in float32 as well; divisions and square roots are the IEEE
ones (`div_rn`, `sqrt_rn`), not the approximate defaults. Sums (of squares, of exps) run in
another order than torch's and exp/tanh are other approximations: there the tests hold both to a
float64 bound. Under Triton's CPU interpreter a float32 -> bfloat16 conversion truncates
(3.9.0) and a float8 one drops a rounding's carry, so there rd rounds by hand (`BF16_BY_BITS`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from quiver_server.kernels.triton_math import tanh
from quiver_server.engine.kv_cache_dtype import cache_fits, float8_limit

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ACTIVATIONS = ("silu", "gelu_tanh")
# torch's gelu(approximate="tanh") constants: sqrt(2) * (2 / sqrt(pi)) * 0.5 and the cubic's.
GELU_BETA = math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5
GELU_KAPPA = 0.044715
# Elements of one program's tile for the column-tiled kernels (rotary, activation).
TILE_ELEMENTS = 2048
GREEDY_BLOCK_V = 4096


@triton.jit
def _float8_grid(x, MANTISSA: tl.constexpr, MIN_NORMAL: tl.constexpr, QUANTUM: tl.constexpr):
    """float32 x (within the format's range) rounded to nearest even on a float8 format's grid,
    in float32: MANTISSA bits above MIN_NORMAL, steps of QUANTUM below it (its subnormals)."""
    bits = x.to(tl.uint32, bitcast=True)
    drop: tl.constexpr = 23 - MANTISSA
    normal = (((bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) >> drop) << drop).to(tl.float32, bitcast=True)
    # 1.5 * 2^23 added and taken away rounds a float32 below 2^22 to an integer, ties to even; on
    # the magnitude, with x's sign bit put back (what rounds to zero stays -0 where x < 0).
    magnitude = ((tl.abs(x) * (1.0 / QUANTUM) + 12582912.0) - 12582912.0) * QUANTUM
    subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < MIN_NORMAL, subnormal, normal)


@triton.jit
def _rounded(x, dtype: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """float32 x rounded to `dtype` to nearest even, as a tensor of `dtype` (float8: x within
    its range)."""
    if BF16_BY_BITS and dtype == tl.bfloat16:
        # The interpreter's conversion truncates: round the float32 bits, then convert exactly.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        rounded = tl.where(x != x, x, bits.to(tl.float32, bitcast=True)).to(dtype)
    elif BF16_BY_BITS and dtype == tl.float8e4nv:
        # The interpreter's float8 conversion loses a rounding's carry into the exponent (1.95
        # becomes 1) and rounds ties away: round on the grid first, then convert exactly.
        rounded = _float8_grid(x, 3, 2.0**-6, 2.0**-9).to(dtype)
    elif BF16_BY_BITS and dtype == tl.float8e5:
        rounded = _float8_grid(x, 2, 2.0**-14, 2.0**-16).to(dtype)
    else:
        rounded = x.to(dtype)
    return rounded


@triton.jit
def _stored(x, cache_dtype: tl.constexpr, CONVERT: tl.constexpr, FP8_MAX: tl.constexpr, BF16_BY_BITS: tl.constexpr):
    """x (the model's dtype) as the KV cache stores it: itself, or rounded to a narrower cache
    dtype, clamped to FP8_MAX first for float8 (`kv_cache_dtype.to_cache`)."""
    if CONVERT:
        f = x.to(tl.float32)
        if FP8_MAX > 0:
            f = tl.minimum(tl.maximum(f, -FP8_MAX), FP8_MAX)
        stored = _rounded(f, cache_dtype, BF16_BY_BITS)
    else:
        stored = x
    return stored


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    width, eps, residual_scale,
    stride_xt, stride_xd, stride_rt, stride_rd, stride_w, stride_ot,
    BLOCK_D: tl.constexpr, ADD_RESIDUAL: tl.constexpr, GEMMA: tl.constexpr, BF16_BY_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < width
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_xt + cols * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        branch = _rounded(h * residual_scale, dtype, BF16_BY_BITS).to(tl.float32)
        residual_ptrs = residual_ptr + row * stride_rt + cols * stride_rd
        stream = tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)
        summed = _rounded(stream + branch, dtype, BF16_BY_BITS)
        tl.store(residual_ptrs, summed, mask=mask)
        h = summed.to(tl.float32)
    mean = tl.div_rn(tl.sum(h * h, axis=0), width)
    inverse = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    w = tl.load(weight_ptr + cols * stride_w, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        out = (h * inverse) * (1.0 + w)
    else:
        out = w * _rounded(h * inverse, dtype, BF16_BY_BITS).to(tl.float32)
    tl.store(out_ptr + row * stride_ot + cols, _rounded(out, dtype, BF16_BY_BITS), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    heads, kv_heads, head_dim, half, block_size,
    stride_xt, stride_xh, stride_xd, stride_ct, stride_cd, stride_st, stride_sd,
    stride_vt, stride_vh, stride_vd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_wb, stride_ws, stride_wh, stride_wd,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_KV: tl.constexpr, PASS_THROUGH: tl.constexpr, BF16_BY_BITS: tl.constexpr,
    CONVERT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < heads + kv_heads
    i = tl.arange(0, BLOCK_R)
    i_mask = i < half
    dtype: tl.constexpr = x_ptr.dtype.element_ty

    cos1 = tl.load(cos_ptr + token * stride_ct + i * stride_cd, mask=i_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_ct + (i + half) * stride_cd, mask=i_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_st + i * stride_sd, mask=i_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_st + (i + half) * stride_sd, mask=i_mask, other=0.0).to(tl.float32)
    tile_mask = h_mask[:, None] & i_mask[None, :]
    first = x_ptr + token * stride_xt + h[:, None].to(tl.int64) * stride_xh + i[None, :] * stride_xd
    second = first + half * stride_xd
    x1 = tl.load(first, mask=tile_mask, other=0.0).to(tl.float32)
    x2 = tl.load(second, mask=tile_mask, other=0.0).to(tl.float32)
    # Every product rounded to the dtype before the sum, as torch's x * cos + rotate_half(x) * sin.
    a = _rounded(x1 * cos1[None, :], dtype, BF16_BY_BITS).to(tl.float32)
    b = _rounded(-x2 * sin1[None, :], dtype, BF16_BY_BITS).to(tl.float32)
    c = _rounded(x2 * cos2[None, :], dtype, BF16_BY_BITS).to(tl.float32)
    d = _rounded(x1 * sin2[None, :], dtype, BF16_BY_BITS).to(tl.float32)
    out1 = _rounded(a + b, dtype, BF16_BY_BITS)
    out2 = _rounded(c + d, dtype, BF16_BY_BITS)
    tl.store(first, out1, mask=tile_mask)
    tl.store(second, out2, mask=tile_mask)

    if WRITE_KV:
        slot = tl.load(slots_ptr + token).to(tl.int64)
        # Compared as a vector: the interpreter broadcasts a scalar bool to int64 (3.9.0).
        written = slot + tl.zeros((BLOCK_H,), tl.int64) >= 0
        page = slot // block_size
        offset = slot % block_size
        # k heads (h >= heads) of this tile: the rotated columns, then the passed-through ones.
        k_head = (h - heads).to(tl.int64)
        k_rows = h_mask & (h >= heads) & written
        k_base = k_cache_ptr + page * stride_kb + offset * stride_ks + k_head[:, None] * stride_kh
        k_mask = k_rows[:, None] & i_mask[None, :]
        cache_dtype: tl.constexpr = k_cache_ptr.dtype.element_ty
        tl.store(k_base + i[None, :] * stride_kd, _stored(out1, cache_dtype, CONVERT, FP8_MAX, BF16_BY_BITS),
                 mask=k_mask)
        tl.store(k_base + (i[None, :] + half) * stride_kd,
                 _stored(out2, cache_dtype, CONVERT, FP8_MAX, BF16_BY_BITS), mask=k_mask)
        if PASS_THROUGH:
            p = 2 * half + tl.arange(0, BLOCK_P)
            p_mask = k_rows[:, None] & (p < head_dim)[None, :]
            tail = tl.load(x_ptr + token * stride_xt + h[:, None].to(tl.int64) * stride_xh + p[None, :] * stride_xd,
                           mask=p_mask, other=0.0)
            tl.store(k_base + p[None, :] * stride_kd, _stored(tail, cache_dtype, CONVERT, FP8_MAX, BF16_BY_BITS),
                     mask=p_mask)
        # v heads with the tile's indices (there are fewer v heads than q + k heads: all covered).
        v_head = h.to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        v_mask = ((h < kv_heads) & written)[:, None] & (cols < head_dim)[None, :]
        values = tl.load(v_ptr + token * stride_vt + v_head[:, None] * stride_vh + cols[None, :] * stride_vd,
                         mask=v_mask, other=0.0)
        tl.store(v_cache_ptr + page * stride_wb + offset * stride_ws + v_head[:, None] * stride_wh
                 + cols[None, :] * stride_wd, _stored(values, cache_dtype, CONVERT, FP8_MAX, BF16_BY_BITS),
                 mask=v_mask)


@triton.jit
def _gated_activation_kernel(
    gate_up_ptr, out_ptr, width, stride_gt, stride_gd, stride_ot,
    BLOCK: tl.constexpr, GELU: tl.constexpr, BETA: tl.constexpr, KAPPA: tl.constexpr,
    BF16_BY_BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    base = gate_up_ptr + row * stride_gt
    gate = tl.load(base + cols * stride_gd, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + (cols + width) * stride_gd, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = BETA * (gate + KAPPA * (gate * gate * gate))
        act = 0.5 * gate * (1.0 + tanh(inner))
    else:
        act = tl.div_rn(gate, 1.0 + tl.exp(-gate))
    out = _rounded(act, dtype, BF16_BY_BITS).to(tl.float32) * up
    tl.store(out_ptr + row * stride_ot + cols, _rounded(out, dtype, BF16_BY_BITS), mask=mask)


@triton.jit
def _greedy_kernel(
    logits_ptr, tokens_ptr, logprobs_ptr, vocab, stride_lb, stride_lv,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_V)
    lane_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK_V,), tl.float32)  # sum of exp(l - lane_max) over the lane's logits
    lane_first = tl.zeros((BLOCK_V,), tl.int32)  # where lane_max was first reached
    first_nan = tl.full((BLOCK_V,), 2**31 - 1, tl.int32)
    base = logits_ptr + row * stride_lb
    for start in range(0, vocab, BLOCK_V):
        index = start + lanes
        logit = tl.load(base + index.to(tl.int64) * stride_lv, mask=index < vocab, other=float("-inf"))
        is_nan = logit != logit
        first_nan = tl.minimum(first_nan, tl.where(is_nan, index, 2**31 - 1))
        logit = tl.where(is_nan, float("-inf"), logit)
        # One exp per logit: exp(-|l - m|) rescales the sum when l is a new maximum, else is l's
        # term. Infinities never meet in a subtraction (no NaN): a -inf logit adds 0, a lane
        # whose maximum is -inf has an empty sum, one whose maximum is +inf an undefined result.
        shift = tl.where(tl.abs(lane_max) == float("inf"), 0.0, lane_max)
        e = tl.exp(-tl.abs(tl.where(logit == float("-inf"), float("-inf"), logit - shift)))
        higher = logit > lane_max
        lane_sum = tl.where(higher, lane_sum * e + 1.0, lane_sum + e)
        lane_first = tl.where(higher, index, lane_first)
        lane_max = tl.where(higher, logit, lane_max)
    top = tl.max(lane_max, axis=0)
    token = tl.min(tl.where(lane_max == top, lane_first, 2**31 - 1), axis=0)
    nan_at = tl.min(first_nan, axis=0)
    undefined = (nan_at < vocab) | (tl.abs(top) == float("inf"))
    top = tl.where(undefined, 0.0, top)
    weights = tl.where(lane_max == float("-inf"), 0.0, tl.exp(lane_max - top))
    total = tl.sum(lane_sum * weights, axis=0)
    logprob = tl.where(undefined, float("nan"), -tl.log(tl.where(undefined, 1.0, total)))
    tl.store(tokens_ptr + row, tl.where(nan_at < vocab, nan_at, token).to(tl.int64))
    tl.store(logprobs_ptr + row, logprob)


def _bf16_by_bits(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"  # Triton's CPU interpreter (see the module docstring)


def _check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def _warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    residual_scale: float = 1.0,
    gemma: bool = False,
) -> torch.Tensor:
    """RMSNorm of the rows of x [T, D] (any strides); returns a new contiguous [T, D] in x's dtype.

    weight [D]: in x's dtype for the Llama form; any float dtype for `gemma` (the checkpoint's w,
    scaled by 1 + w in float32). residual [T, D] in x's dtype: the fused add, residual :=
    rd(residual + rd(x * residual_scale)) in place (the new residual stream), and the norm of
    that sum is returned. Semantics in the module docstring."""
    _check_dtype("x", x)
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm takes x [T, D] and weight [D], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not gemma and weight.dtype != x.dtype:
        raise ValueError(f"weight must be in x's dtype {x.dtype}, got {weight.dtype}")
    if gemma and not weight.dtype.is_floating_point:
        raise ValueError(f"weight must be a float tensor, got {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {tuple(x.shape)} in {x.dtype}, got {tuple(residual.shape)} "
                         f"in {residual.dtype}")
    rows, width = x.shape
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    stream = x if residual is None else residual  # unused without a residual
    block_d = triton.next_power_of_2(width)
    _rms_norm_kernel[(rows,)](
        x, stream, weight, out, float(width), eps, residual_scale,
        *x.stride(), *stream.stride(), weight.stride(0), out.stride(0),
        BLOCK_D=block_d, ADD_RESIDUAL=residual is not None, GEMMA=gemma, BF16_BY_BITS=_bf16_by_bits(x),
        num_warps=_warps(block_d), enable_fp_fusion=False,
    )
    return out


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_heads: int,
    kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    _check_dtype("x", x)
    tokens, all_heads, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape[0] != tokens or t.shape[-1] != rotary_dim or t.numel() != tokens * rotary_dim:
            raise ValueError(f"{name} must be [T, 1, R] or [T, R] with T = {tokens}, got {tuple(t.shape)}")
        if t.dtype != x.dtype:
            raise ValueError(f"{name} must be in x's dtype {x.dtype}, got {t.dtype}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary dim {rotary_dim} must be even and within the head dim {head_dim}")
    if tokens == 0:
        return
    half = rotary_dim // 2
    block_r = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(all_heads), max(1, TILE_ELEMENTS // block_r))
    pass_through = head_dim - rotary_dim
    cache_strides: tuple[int, ...]
    if kv is None:
        v, k_cache, v_cache, slots = x, x, x, x  # unused: no cache write
        block_size = 1
        cache_strides = (0,) * 8
    else:
        v, k_cache, v_cache, slots = kv
        block_size = k_cache.shape[1]
        cache_strides = (*k_cache.stride(), *v_cache.stride())
    convert = k_cache.dtype != x.dtype
    _rotary_kernel[(tokens, triton.cdiv(all_heads, block_h))](
        x, cos, sin, v, k_cache, v_cache, slots,
        all_heads - kv_heads, kv_heads, head_dim, half, block_size,
        *x.stride(), cos.stride(0), cos.stride(-1), sin.stride(0), sin.stride(-1),
        *v.stride(), *cache_strides,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=triton.next_power_of_2(max(pass_through, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim), WRITE_KV=kv is not None,
        PASS_THROUGH=kv is not None and pass_through > 0, BF16_BY_BITS=_bf16_by_bits(x),
        CONVERT=convert, FP8_MAX=float8_limit(k_cache.dtype), num_warps=4, enable_fp_fusion=False,
    )


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] (any strides) with its leading R = cos.shape[-1] columns of every head
    rotated in place by cos, sin [T, 1, R] (x's dtype); the other columns are untouched.
    Returns x. Full rotary when R = D (`torch_ops.rotary`), partial otherwise."""
    if x.dim() != 3:
        raise ValueError(f"x must be [T, heads, D], got {tuple(x.shape)}")
    _rotate(x, cos, sin, 0, None)
    return x


def rotary_and_write_kv(
    qk: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """One launch for `Attention.store_kv` after the projection: qk [T, heads + kv_heads, D]
    (q heads, then k heads; any strides) rotated in place as `rotary_` does, and the rotated k
    heads and v [T, kv_heads, D] stored into k_cache / v_cache [num_blocks, block_size, kv_heads,
    D] (any strides; qk's dtype, or a narrower one that `kv_cache_dtype.to_cache` rounds to) at
    slot_mapping [T] (int32 or int64, flat slots as `write_kv`; < 0: not written). Returns qk;
    q = qk[:, :heads], k = qk[:, heads:]."""
    if qk.dim() != 3 or v.dim() != 3:
        raise ValueError(f"qk and v must be [T, heads, D], got {tuple(qk.shape)} and {tuple(v.shape)}")
    tokens, all_heads, head_dim = qk.shape
    kv_heads = v.shape[1]
    if v.shape != (tokens, kv_heads, head_dim) or kv_heads >= all_heads:
        raise ValueError(f"v {tuple(v.shape)} does not fit qk {tuple(qk.shape)}")
    expected_cache = (kv_heads, head_dim)
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != expected_cache):
        raise ValueError(f"caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)} must be [blocks, block_size, "
                         f"{kv_heads}, {head_dim}]")
    if qk.dtype != v.dtype or not cache_fits(qk.dtype, k_cache, v_cache):
        raise ValueError(f"qk and v must share a dtype, and the caches be in it, bfloat16 or float8; got {qk.dtype}, "
                         f"{v.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if slot_mapping.shape != (tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{tokens}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    _rotate(qk, cos, sin, kv_heads, (v, k_cache, v_cache, slot_mapping))
    return qk


def gated_activation(gate_up: torch.Tensor, kind: str) -> torch.Tensor:
    """[T, 2I] = [gate | up] (any strides) -> act(gate) * up, a new contiguous [T, I] in
    gate_up's dtype; kind "silu" or "gelu_tanh" (`layers/activation.py` names)."""
    _check_dtype("gate_up", gate_up)
    if kind not in ACTIVATIONS:
        raise ValueError(f"unknown activation {kind!r}, expected one of {ACTIVATIONS}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or width == 0:
        return out
    block = min(triton.next_power_of_2(width), TILE_ELEMENTS)
    _gated_activation_kernel[(rows, triton.cdiv(width, block))](
        gate_up, out, width, *gate_up.stride(), out.stride(0),
        BLOCK=block, GELU=kind == "gelu_tanh", BETA=GELU_BETA, KAPPA=GELU_KAPPA,
        BF16_BY_BITS=_bf16_by_bits(gate_up), num_warps=4, enable_fp_fusion=False,
    )
    return out


def greedy_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [B, V] (V > 0, any strides) -> (torch.argmax per row [B] int64, its
    log-softmax [B] float32), as `torch_ops.greedy_logprob`."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.shape[1] == 0:
        raise ValueError(f"logits must be float32 [B, V] with V > 0, got {logits.dtype} {tuple(logits.shape)}")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return tokens, logprobs
    block_v = min(triton.next_power_of_2(vocab), GREEDY_BLOCK_V)
    _greedy_kernel[(rows,)](
        logits, tokens, logprobs, vocab, *logits.stride(), BLOCK_V=block_v, num_warps=_warps(block_v),
    )
    return tokens, logprobs
