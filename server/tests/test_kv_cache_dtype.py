"""`--kv-cache-dtype`: a float32 model over a bfloat16 or float8 KV cache against transformers
with its own cache rounding K and V the same way (clamped to the format's largest finite value,
rounded to nearest by torch's cast), so that every attention reads the rounded values, the
newest tokens' included. Prefill, a prefill over a cached prefix and decode steps; several
families (grouped heads, q/k norms, soft caps and sliding windows, partial rotary)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
import transformers
from device import TEST_DEVICE
from tiny_models import build_tiny_model
from transformers import DynamicCache

from quiver_server.engine.engine import Engine
from quiver_server.engine.forward_batch import build_decode, build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.models import load_model
from quiver_server.weights import load_config

DEVICE = TEST_DEVICE
ATOL = 1e-4
PROMPT_LENGTHS = (5, 17, 33)
DECODE_STEPS = 3

CASES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "phi4-mini-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
}
KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache in `dtype` holds of x: float8 saturates at its largest finite value."""
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype).to(x.dtype)


class RoundingCache(DynamicCache):
    """transformers' cache, storing (and handing attention) K and V rounded to `dtype`."""

    def __init__(self, config: transformers.PreTrainedConfig, dtype: torch.dtype) -> None:
        super().__init__(config=config)
        self.kv_dtype = dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().update(_rounded(key_states, self.kv_dtype), _rounded(value_states, self.kv_dtype),
                              layer_idx, *args, **kwargs)


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    arch, kwargs = CASES[request.param]
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=40 + list(CASES).index(request.param),
                            **kwargs)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    return path, reference


def _reference_logits(reference: transformers.PreTrainedModel, tokens: list[int],
                      dtype: torch.dtype | None) -> torch.Tensor:
    cache = RoundingCache(reference.config, dtype) if dtype is not None else DynamicCache(config=reference.config)
    return reference(torch.tensor([tokens]), past_key_values=cache, use_cache=True).logits[0]


def _prompts(seed: int, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@torch.inference_mode()
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_prefill_cached_prefix_and_decode_match_transformers_with_a_rounding_cache(
    case: tuple[Path, transformers.PreTrainedModel], kv_dtype: str,
) -> None:
    path, reference = case
    dtype = KV_DTYPES[kv_dtype]
    model = load_model(path, load_config(path), torch.float32, DEVICE)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, BLOCK_SIZE)
    prompts = _prompts(seed=5)
    blocks_each = spec.blocks_for_tokens(max(PROMPT_LENGTHS) + DECODE_STEPS)
    kv_cache = PagedKVCache(spec, blocks_each * (len(prompts) + 1), DEVICE)
    assert kv_cache.k[0].dtype == dtype
    ids = list(range(blocks_each * (len(prompts) + 1)))
    random.Random(6).shuffle(ids)
    table = torch.tensor([ids[i::len(prompts) + 1] for i in range(len(prompts) + 1)], dtype=torch.long)

    lens = [len(p) for p in prompts]
    batch = build_prefill(lens, table[: len(prompts)], BLOCK_SIZE, DEVICE)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(sum(lens), device=DEVICE))
    ours = model(torch.tensor([t for p in prompts for t in p], device=DEVICE), batch, kv_cache).cpu().split(lens)
    rounding_matters = 0.0
    for prompt, logits in zip(prompts, ours, strict=True):
        expected = _reference_logits(reference, prompt, dtype)
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
        exact = _reference_logits(reference, prompt, None)
        rounding_matters = max(rounding_matters, float((expected - exact).abs().max()))
    # The rounding changes transformers' logits far beyond the tolerance: the cache dtype counts.
    assert rounding_matters > 10 * ATOL

    # The longest prompt again in two passes, the second over the first's K/V in the cache.
    prompt, first = prompts[2], 20
    own = table[len(prompts) : len(prompts) + 1]
    model(torch.tensor(prompt[:first], device=DEVICE), build_prefill([first], own, BLOCK_SIZE, DEVICE), kv_cache)
    rest = build_prefill([len(prompt) - first], own, BLOCK_SIZE, DEVICE, context_lens=[first])
    rest = dataclasses.replace(rest, logits_indices=torch.arange(len(prompt) - first, device=DEVICE))
    chunked = model(torch.tensor(prompt[first:], device=DEVICE), rest, kv_cache).cpu()
    torch.testing.assert_close(chunked, _reference_logits(reference, prompt, dtype)[first:], atol=ATOL, rtol=0)

    sequences = [list(p) for p in prompts]
    for step in range(DECODE_STEPS):
        fed = [(7 * step + 11 * i + 3) % cfg.vocab_size for i in range(len(sequences))]
        batch = build_decode([len(s) for s in sequences], table[: len(prompts)].to(DEVICE), BLOCK_SIZE, DEVICE)
        logits = model(torch.tensor(fed, device=DEVICE), batch, kv_cache).cpu()
        for i, token in enumerate(fed):
            sequences[i].append(token)
            expected = _reference_logits(reference, sequences[i], dtype)[-1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


def test_the_engine_sizes_its_cache_in_the_dtype_and_refuses_unknown_names(
    case: tuple[Path, transformers.PreTrainedModel],
) -> None:
    path, _ = case
    plain = Engine(str(path), "tiny", dtype="float32", device=str(DEVICE), cpu_kv_cache_gib=0.01)
    fp8 = Engine(str(path), "tiny", dtype="float32", device=str(DEVICE), cpu_kv_cache_gib=0.01, kv_cache_dtype="fp8")
    assert fp8.kv_spec.dtype == torch.float8_e4m3fn and plain.kv_spec.dtype == torch.float32
    assert fp8.kv_spec.bytes_per_block() * 4 == plain.kv_spec.bytes_per_block()
    if DEVICE.type == "cpu":  # CUDA sizes its cache from free memory, not from --cpu-kv-cache-gib
        plain_blocks, fp8_blocks = plain.warmup(64, 64, 4)[1], fp8.warmup(64, 64, 4)[1]
        assert 4 * plain_blocks <= fp8_blocks < 4 * (plain_blocks + 1)  # the same bytes, floored
        assert fp8.kv_cache is not None and fp8.kv_cache.k[0].dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="int8"):
        Engine(str(path), "tiny", dtype="float32", device=str(DEVICE), kv_cache_dtype="int8")


def test_the_shard_cli_offers_exactly_the_dtypes_the_engine_resolves() -> None:
    from quiver_server import cli
    from quiver_server.engine import kv_cache_dtype

    assert cli.KV_CACHE_DTYPES == kv_cache_dtype.CHOICES
    cpu = torch.device("cpu")
    assert kv_cache_dtype.resolve("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert kv_cache_dtype.resolve("fp8", torch.float32, cpu) == torch.float8_e4m3fn
    assert kv_cache_dtype.resolve("fp8_e5m2", torch.bfloat16, cpu) == torch.float8_e5m2
    with pytest.raises(ValueError, match="float64"):
        kv_cache_dtype.resolve("bfloat16", torch.float64, cpu)
