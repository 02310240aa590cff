"""Plain data passed between the gRPC service and the engine (no protobuf, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 disables
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    # Draws the generator made before a preemption (see shard.proto); skipped when resuming.
    draws_done: int = 0


@dataclass(frozen=True)
class RequestSpec:
    """One request entering a prefill.

    `blocks` is the block table the router allocated: enough KV blocks, in order, for
    len(input_ids) + max_new_tokens tokens.
    """

    id: int
    input_ids: list[int]
    blocks: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    adapter_id: str = ""  # "" is the base model


@dataclass(frozen=True)
class TokenOut:
    request_id: int
    token_id: int
    logprob: float


@dataclass(frozen=True)
class StepResult:
    """What one prefill or decode step produced, and the cached batch it leaves."""

    generations: list[TokenOut]
    batch_id: int
    request_ids: list[int]
    forward_ns: int = 0


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    model_type: str
    dtype: str
    device: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    model_path: str
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter the shard holds (LoadAdapterResponse)."""

    path: str  # local directory it was read from (the router reads its tokenizer/template there)
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    target_modules: list[str]  # our names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
