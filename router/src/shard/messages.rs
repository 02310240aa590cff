//! What the router and a shard say to each other, in the router's own types. `ShardBackend`
//! speaks these; only the gRPC client (`wire.rs`) turns them into the protobuf messages of
//! `proto/quiver/v1/shard.proto`, whose comments define each field's contract.

use quiver_flags::AdapterSource;

/// Static facts about the loaded model (one rank's).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardInfo {
    pub model_id: String,
    /// config.json's model_type, e.g. "llama".
    pub model_type: String,
    /// "float32" | "bfloat16" | "float16".
    pub dtype: String,
    /// "cpu" | "cuda:0" ...
    pub device: String,
    pub vocab_size: u32,
    pub max_position_embeddings: u32,
    pub rank: u32,
    pub world_size: u32,
    pub eos_token_ids: Vec<u32>,
    /// Local directory the weights were loaded from (the router reads the tokenizer there).
    pub model_path: String,
    /// Bytes of weights this rank holds, in the layout that serves them.
    pub weight_bytes: u64,
    /// Width of an embedding.
    pub embedding_dim: u32,
    /// How embeddings are pooled, in words.
    pub pooling: String,
    /// Why the model cannot embed; empty when it can.
    pub pooling_refusal: String,
    /// Why the model cannot generate (no LM head); empty when it can.
    pub generation_refusal: String,
}

/// What the router will ask of the shard, so that it sizes its KV cache and adapter slots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmupLimits {
    pub max_batch_prefill_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_size: u32,
    /// 0: as many blocks as memory allows.
    pub max_batch_total_tokens: u32,
    pub max_active_adapters: u32,
    pub max_lora_rank: u32,
    /// Each slot's largest rank, in slot order (`--lora-rank-classes`); empty: every slot holds
    /// `max_lora_rank`.
    pub slot_ranks: Vec<u32>,
}

/// The KV cache the shard allocated: blocks `0..num_blocks` of `block_size` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: u32,
    pub num_blocks: u32,
}

/// Sampling settings of one request, already validated.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 disables.
    pub top_k: u32,
    pub min_p: f32,
    pub repetition_penalty: f32,
    /// Always set: the client's seed, or one drawn by the router.
    pub seed: u64,
    /// OpenAI's penalties over the generated tokens; 0 disables.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Added to these tokens' logits before sampling (ids checked against the vocabulary).
    pub logit_bias: Vec<(u32, f32)>,
    /// Most likely alternatives reported with each generated token (0..=20).
    pub top_logprobs: u32,
}

impl Default for SamplingParams {
    /// Greedy, nothing disabled turned on.
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            top_logprobs: 0,
        }
    }
}

/// The language `Grammar::text` is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarKind {
    /// A JSON schema (a JSON document); `{"type": "object"}` is JSON mode.
    JsonSchema,
    /// A regular expression the whole output must match.
    Regex,
    /// A grammar in llguidance's Lark dialect.
    Lark,
}

/// A constraint on a request's output (structured output, tool calls).
#[derive(Debug, Clone, PartialEq)]
pub struct Grammar {
    pub kind: GrammarKind,
    pub text: String,
    /// The tokens that end the request once the output is complete (its tokenizer's EOS ids).
    pub eos_token_ids: Vec<u32>,
}

/// One request of a Prefill: its prompt, or the chunk `cached_tokens..prefill_until` of it.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillEntry {
    pub id: u64,
    pub input_ids: Vec<u32>,
    /// Block table covering the prompt and `max_new_tokens`.
    pub blocks: Vec<u32>,
    pub sampling: SamplingParams,
    /// Tokens a preempted request generated before it resumed: its generator skips as many
    /// draws.
    pub draws_done: u32,
    pub max_new_tokens: u32,
    /// "" is the base model; otherwise an adapter active in a slot.
    pub adapter_id: String,
    pub prompt_logprobs: Option<u32>,
    /// The id its grammar is pinned under on the shards (`compile_grammar`); `None`: free.
    pub grammar_id: Option<u64>,
    /// Leading prompt tokens whose KV is already in `blocks`.
    pub cached_tokens: u32,
    /// 0: the prompt's last chunk; else compute up to here and sample nothing.
    pub prefill_until: u32,
    /// Pool the prompt into an embedding; nothing is kept for it.
    pub embed: bool,
}

/// A token and its log-probability under the model's raw distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// One prompt position after the first: the prompt token's logprob and rank, and the most
/// likely alternatives there.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptPosition {
    pub logprob: f32,
    pub rank: u32,
    pub top: Vec<TokenLogprob>,
}

/// The token a step chose for one request, or an embed request's embedding.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    pub request_id: u64,
    pub token_id: u32,
    pub logprob: f32,
    /// Most likely first.
    pub top_logprobs: Vec<TokenLogprob>,
    /// Prefill only, when asked: one entry per prompt token after the first.
    pub prompt_logprobs: Vec<PromptPosition>,
    /// An embed request's pooled embedding; empty otherwise.
    pub embedding: Vec<f32>,
}

/// A batch the shard keeps between steps, and its requests in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CachedBatch {
    pub id: u64,
    pub request_ids: Vec<u64>,
}

/// What a Prefill or a Decode returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Step {
    pub generations: Vec<Generation>,
    /// The batch the shard now keeps; `None` when it keeps nothing for this step.
    pub batch: Option<CachedBatch>,
    /// Time in the forward pass and sampling, and the part of it spent on grammar masks.
    pub forward_ns: u64,
    pub grammar_ns: u64,
}

/// What a Decode carrying a Prefill returns (a mixed step: one forward pass for both).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MixedStep {
    /// The decode's tokens, and the decoded batch with the prefill's finished prompts joined
    /// after its own requests; its times are the whole step's.
    pub decode: Step,
    /// The prefill's answer as a Prefill would give it; its `batch` lists the requests that
    /// joined the decoded batch (no batch of its id is kept), its times are 0.
    pub prefill: Step,
}

/// Where a shard reads an adapter from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterLoad {
    /// The id as the client sent it in `model`.
    pub adapter_id: String,
    pub source: AdapterSource,
    /// A local directory: the one resolved inside `--adapter-root`, or rank 0's download of a
    /// hub adapter. Empty for a hub adapter rank 0 downloads.
    pub path: String,
    /// A hub revision; empty for the default.
    pub revision: String,
}

/// An adapter a shard holds in host memory.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedAdapter {
    /// Local directory holding it (the router reads its tokenizer/template there).
    pub path: String,
    pub rank: u32,
    pub scaling: f32,
    /// Target modules, in our names (q_proj … down_proj).
    pub target_modules: Vec<String>,
}

/// The answer to a grammar compile.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GrammarCompiled {
    /// Why the grammar was refused, in words fit for the client; `None` when it compiled.
    pub error: Option<String>,
    /// Time spent compiling (0 when it was cached).
    pub compile_ns: u64,
}
