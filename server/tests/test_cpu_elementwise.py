"""The fused C++ row ops (`kernels/cpu/elementwise.cpp`) against transformers' own modules:
LlamaRMSNorm, apply_rotary_pos_emb and SiLU(gate) * up, in float32 (bit-for-bit where the
arithmetic is the same) and in 16-bit dtypes (to one rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama import modeling_llama

from quiver_server.kernels import cpu_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def kernels_loaded() -> None:
    # The ops exist once the extension is loaded (built if needed); a failed build fails here.
    assert cpu_ops.available()


def _ulps(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (33, 512), (300, 96)])
def test_rms_norm_matches_transformers(dtype, rows, dim) -> None:
    gen = torch.Generator().manual_seed(rows + dim)
    reference = modeling_llama.LlamaRMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(dim, generator=gen))
    reference = reference.to(dtype)
    x = (torch.randn(rows, dim, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        want = reference(x)
    got = cpu_ops.rms_norm(x, reference.weight.detach(), 1e-5)
    assert got.dtype == dtype
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= _ulps(dtype) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_mlp_activation(dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(37, 2 * 176, generator=gen) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = cpu_ops.silu_and_mul(gate_up)
    scale = want.float().abs().max().item()
    assert got.shape == want.shape and got.dtype == dtype
    assert (got.float() - want.float()).abs().max().item() <= 2 * _ulps(dtype) * scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_transformers_in_place_on_a_fused_qkv(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim = 19, 4, 2, 32
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    # transformers' layout: [batch, heads, seq, dim], cos/sin [batch, seq, dim].
    q_ref = qkv[:, :heads].transpose(0, 1)[None]
    k_ref = qkv[:, heads:heads + kv_heads].transpose(0, 1)[None]
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(q_ref, k_ref, cos[None], sin[None])
    v_before = qkv[:, heads + kv_heads:].clone()
    cpu_ops.rotary_(qkv[:, :heads + kv_heads], cos, sin)
    tolerance = 0.0 if dtype == torch.float32 else 2 * _ulps(dtype)
    torch.testing.assert_close(qkv[:, :heads], want_q[0].transpose(0, 1), atol=tolerance * 4, rtol=tolerance)
    torch.testing.assert_close(qkv[:, heads:heads + kv_heads], want_k[0].transpose(0, 1), atol=tolerance * 4,
                               rtol=tolerance)
    assert torch.equal(qkv[:, heads + kv_heads:], v_before)  # V is not rotated


def test_bad_shapes_raise() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up"):
        cpu_ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_ops.rotary_(torch.randn(2, 3, 8), torch.randn(2, 6), torch.randn(2, 6))
