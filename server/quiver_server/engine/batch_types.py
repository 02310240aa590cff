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
    # Draws the generator made before a preemption (see shard.proto); skipped when resuming. The
    # last `draws_done` prompt tokens are then generated tokens for the OpenAI penalties.
    draws_done: int = 0
    # OpenAI's penalties over the generated tokens; 0 disables.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # token id -> value added to its logit before sampling.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Most likely tokens of the raw distribution reported with each token (0..20).
    top_logprobs: int = 0


GRAMMAR_KINDS = ("json_schema", "regex", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    """A constraint on a request's output (shard.proto's Grammar)."""

    kind: str  # one of GRAMMAR_KINDS ("" when the router left it unspecified: refused)
    text: str  # a JSON schema document, a regex, or an llguidance Lark grammar
    eos_token_ids: tuple[int, ...]  # the tokens that end the request once the output is complete


@dataclass(frozen=True)
class RequestSpec:
    """One request entering a prefill, or one chunk of its prompt.

    `blocks` is the block table the router allocated: enough KV blocks, in order, for
    len(input_ids) + max_new_tokens tokens. The prefill computes input_ids[cached_tokens:until]
    (`until`: prefill_until, or the whole prompt when 0); the first `cached_tokens` already
    have their K/V in `blocks`. Only a request whose prompt is then complete (`is_final`) is
    sampled and kept; a chunk comes back later with cached_tokens = its prefill_until.
    """

    id: int
    input_ids: list[int]
    blocks: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    adapter_id: str = ""  # "" is the base model
    # Alternatives per prompt position to report; None: no prompt logprobs (last-row logits only).
    prompt_logprobs: int | None = None
    # Constrains every generated token: the id `Grammars.pin` pinned it under; 0: free.
    grammar_id: int = 0
    # Leading prompt tokens whose K/V is already in `blocks` (prefix cache, earlier chunks).
    cached_tokens: int = 0
    # Chunked prefill: compute up to here only (exclusive); 0 = the whole prompt.
    prefill_until: int = 0
    # An embedding request: its whole prompt is computed and pooled, nothing is sampled or kept.
    embed: bool = False

    @property
    def until(self) -> int:
        """End (exclusive) of the prompt tokens this prefill computes."""
        return self.prefill_until or len(self.input_ids)

    @property
    def is_final(self) -> bool:
        """This prefill completes the prompt: the request is sampled and kept."""
        return self.until >= len(self.input_ids)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class PromptPosition:
    """A prompt token's logprob given the tokens before it, and the top alternatives there."""

    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)
    # 1 + how many tokens are strictly more likely here (vLLM reports a prompt token's rank).
    rank: int = 0


@dataclass(frozen=True)
class TokenOut:
    request_id: int
    token_id: int
    logprob: float  # raw log_softmax at token_id
    top_logprobs: list[TokenLogprob] = field(default_factory=list)  # most likely first
    prompt_logprobs: list[PromptPosition] = field(default_factory=list)  # prefill, when asked
    embedding: list[float] = field(default_factory=list)  # an `embed` request's pooled vector


@dataclass(frozen=True)
class StepResult:
    """What one prefill or decode step produced, and the cached batch it leaves."""

    generations: list[TokenOut]
    batch_id: int
    request_ids: list[int]
    forward_ns: int = 0
    # Part of forward_ns the engine waited on or spent with grammar masks (the fill's overlap with
    # the forward pass and the matchers' background advance are not in it).
    grammar_ns: int = 0


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
    weight_bytes: int = 0  # of the model's weights on this rank (`weight_bytes.held_weight_bytes`)
    embedding_dim: int = 0  # width of a pooled embedding (the hidden size)
    pooling: str = ""  # how embeddings are pooled, in words (`pooling.Pooling.describe`)
    pooling_refusal: str = ""  # non-empty: why this model serves no embeddings
    # Non-empty: why this model generates nothing (it has no LM head). InfoResponse has no field
    # for it yet, so the router learns it from the refused Prefill's message.
    generation_refusal: str = ""


@dataclass(frozen=True)
class AdapterInfo:
    """A LoRA adapter the shard holds (LoadAdapterResponse)."""

    path: str  # local directory it was read from (the router reads its tokenizer/template there)
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    target_modules: list[str]  # our names: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
