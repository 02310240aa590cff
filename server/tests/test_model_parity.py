"""Every family's forward pass on the paged KV cache against transformers, in float32.

One flattened batch of prompts of different lengths (no padding), with block tables scattered
over the cache, must give every prompt the logits transformers gives it alone; decode steps
that read K/V back from the blocks must give the logits of transformers' full forward pass.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
import transformers
from device import TEST_DEVICE
from tiny_models import build_tiny_model

from quiver_server.engine.forward_batch import build_decode, build_prefill
from quiver_server.engine.kv_cache import BLOCK_SIZE, KVCacheSpec, PagedKVCache
from quiver_server.layers.rotary import RopeConfig, inverse_frequencies
from quiver_server.models import load_model
from quiver_server.weights import load_config

ATOL = 1e-4
DEVICE = TEST_DEVICE
PROMPT_LENGTHS = (5, 17, 33)  # inside one block, across one boundary, across two
DECODE_STEPS = 4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# case id -> (architecture, build_tiny_model keyword arguments)
CASES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "llama-tied-embeddings": ("llama", {"tie_word_embeddings": True}),
    "llama-sharded-checkpoint": ("llama", {"max_shard_size": "100KB"}),
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0}}),
    "llama-rope-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0,
                                                         "factor": 2.0}}),
    "mistral-sliding-window": ("mistral", {"sliding_window": 6}),
    "qwen2-sliding-window-layer": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen3": ("qwen3", {}),
    "qwen3-attention-bias-sliding-window": (
        "qwen3", {"attention_bias": True, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3-moe": ("qwen3_moe", {}),
    "qwen3-moe-normalized-dense-layer": ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("mixtral", {}),
    "mixtral-sliding-window": ("mixtral", {"sliding_window": 6}),
    # Caps small enough to bend the tiny model's scores and logits.
    "gemma2": ("gemma2", {"sliding_window": 6, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    "gemma2-tied": ("gemma2", {"tie_word_embeddings": True, "sliding_window": 6}),
    "gemma3": ("gemma3_text", {
        "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
    }),
    # transformers' Gemma 3 applies the final cap but never attn_logit_softcapping (nor do we).
    "gemma3-softcap-tied": ("gemma3_text", {"tie_word_embeddings": True, "attn_logit_softcapping": 2.0,
                                            "final_logit_softcapping": 3.0}),
    "phi3": ("phi3", {}),
    "phi3-sliding-window": ("phi3", {"sliding_window": 6}),
    "phi4-mini-partial-rotary": ("phi3", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
    # The 33-token prompt passes original_max_position_embeddings: LongRoPE's long factors.
    "phi3-longrope": ("phi3", {"max_position_embeddings": 1024, "original_max_position_embeddings": 24,
                               "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                                   "long_factor": [2.0 + 0.5 * i for i in range(8)],
                                                   "original_max_position_embeddings": 24}}),
    "granite": ("granite", {"embedding_multiplier": 2.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5,
                            "logits_scaling": 2.0, "attention_bias": True, "mlp_bias": True}),
    "llama-rope-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 256}}),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    arch, kwargs = CASES[request.param]
    seed = list(CASES).index(request.param)
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), arch, seed=seed, **kwargs)
    # Eager attention: transformers' SDPA path drops attention soft-capping (Gemma 3 with a cap).
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    return path, reference


def _prompts(seed: int, vocab: int = 300) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _scattered_block_tables(num_sequences: int, blocks_each: int, seed: int) -> torch.Tensor:
    """Each sequence gets blocks spread over the cache, in no particular order."""
    ids = list(range(num_sequences * blocks_each))
    random.Random(seed).shuffle(ids)
    return torch.tensor([ids[i::num_sequences] for i in range(num_sequences)], dtype=torch.long)


@torch.inference_mode()
def test_prefill_then_decode_logits_match_transformers(case: tuple[Path, transformers.PreTrainedModel]) -> None:
    path, reference = case
    model = load_model(path, load_config(path), torch.float32, DEVICE)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK_SIZE)
    blocks_each = spec.blocks_for_tokens(max(PROMPT_LENGTHS) + DECODE_STEPS)
    kv_cache = PagedKVCache(spec, blocks_each * len(PROMPT_LENGTHS), DEVICE)
    table = _scattered_block_tables(len(PROMPT_LENGTHS), blocks_each, seed=1)
    prompts = _prompts(seed=2)

    # Prefill all prompts as one flat batch; ask for the logits of every position.
    lens = [len(p) for p in prompts]
    batch = build_prefill(lens, table, BLOCK_SIZE, DEVICE)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(sum(lens), device=DEVICE))
    ours = model(torch.tensor([t for p in prompts for t in p], device=DEVICE), batch, kv_cache).cpu().split(lens)
    for prompt, logits in zip(prompts, ours, strict=True):
        expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)

    # Decode: feed a fixed token per sequence; each step reads all earlier K/V from the blocks.
    sequences = [list(p) for p in prompts]
    for step in range(DECODE_STEPS):
        fed = [(7 * step + 11 * i + 3) % cfg.vocab_size for i in range(len(sequences))]
        batch = build_decode([len(s) for s in sequences], table.to(DEVICE), BLOCK_SIZE, DEVICE)
        logits = model(torch.tensor(fed, device=DEVICE), batch, kv_cache).cpu()
        for i, token in enumerate(fed):
            sequences[i].append(token)
            expected = reference(torch.tensor([sequences[i]])).logits[0, -1]
            torch.testing.assert_close(logits[i], expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope_config",
    [
        {"rope_theta": 10000.0},
        {"rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", **{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}},
        {"rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
        {"rope_theta": 1000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        {"rope_parameters": LLAMA3_ROPE},
    ],
    ids=["legacy-default", "legacy-llama3", "legacy-linear", "legacy-dynamic", "rope-parameters-llama3"],
)
def test_rope_frequencies_match_transformers_for_both_config_layouts(rope_config: dict) -> None:
    """Hub configs use the old top-level rope_theta/rope_scaling; transformers 5 writes
    rope_parameters. Both must give transformers' own inverse frequencies."""
    raw = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 1024,
        **rope_config,
    }
    hf_config = transformers.LlamaConfig.from_dict(raw)
    expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config).inv_freq
    ours = inverse_frequencies(RopeConfig.from_hf(raw), head_dim=16)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_unsupported_rope_type_is_named() -> None:
    with pytest.raises(ValueError, match="mrope"):
        RopeConfig.from_hf({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}})


@torch.inference_mode()
def test_prefill_after_a_cached_prefix_matches_transformers_with_its_cache(
    case: tuple[Path, transformers.PreTrainedModel],
) -> None:
    """A prompt prefilled in two passes (the second over a prefix already in the paged cache, as
    prefix caching and chunked prefill run it) gives the logits transformers gives the same
    second chunk over its own KV cache of the first. (With LongRoPE the two differ from one
    full pass by design, in both.)"""
    path, reference = case
    model = load_model(path, load_config(path), torch.float32, DEVICE)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, BLOCK_SIZE)
    prompt = _prompts(seed=3)[2]  # 33 tokens
    first = 20  # the split falls inside a block
    blocks = spec.blocks_for_tokens(len(prompt))
    kv_cache = PagedKVCache(spec, blocks + 2, DEVICE)
    table = _scattered_block_tables(1, blocks, seed=4) + 2
    model(torch.tensor(prompt[:first], device=DEVICE), build_prefill([first], table, BLOCK_SIZE, DEVICE), kv_cache)
    rest = len(prompt) - first
    batch = build_prefill([rest], table, BLOCK_SIZE, DEVICE, context_lens=[first])
    batch = dataclasses.replace(batch, logits_indices=torch.arange(rest, device=DEVICE))
    ours = model(torch.tensor(prompt[first:], device=DEVICE), batch, kv_cache).cpu()

    past = reference(torch.tensor([prompt[:first]]), use_cache=True).past_key_values
    expected = reference(torch.tensor([prompt[first:]]), past_key_values=past, use_cache=True).logits[0]
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
