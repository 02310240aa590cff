//! The router's shard messages as protobuf and back: the one place the two meet. Vectors are
//! moved, never copied, except where a message goes to several ranks.

use quiver_flags::AdapterSource;

use super::messages::{
    AdapterLoad, CachedBatch, Generation, Grammar, GrammarCompiled, GrammarKind, KvLayout,
    LoadedAdapter, MixedStep, PrefillEntry, PromptPosition, SamplingParams, ShardInfo, Step,
    TokenLogprob, WarmupLimits,
};
use super::{ShardError, ShardResult};
use crate::pb;

impl From<pb::InfoResponse> for ShardInfo {
    fn from(info: pb::InfoResponse) -> Self {
        Self {
            model_id: info.model_id,
            model_type: info.model_type,
            dtype: info.dtype,
            device: info.device,
            vocab_size: info.vocab_size,
            max_position_embeddings: info.max_position_embeddings,
            rank: info.rank,
            world_size: info.world_size,
            eos_token_ids: info.eos_token_ids,
            model_path: info.model_path,
            weight_bytes: info.weight_bytes,
            embedding_dim: info.embedding_dim,
            pooling: info.pooling,
            pooling_refusal: info.pooling_refusal,
            generation_refusal: info.generation_refusal,
        }
    }
}

impl From<WarmupLimits> for pb::WarmupRequest {
    fn from(limits: WarmupLimits) -> Self {
        Self {
            max_batch_prefill_tokens: limits.max_batch_prefill_tokens,
            max_total_tokens: limits.max_total_tokens,
            max_batch_size: limits.max_batch_size,
            max_batch_total_tokens: limits.max_batch_total_tokens,
            max_active_adapters: limits.max_active_adapters,
            max_lora_rank: limits.max_lora_rank,
            slot_ranks: limits.slot_ranks,
        }
    }
}

impl From<pb::WarmupResponse> for KvLayout {
    fn from(response: pb::WarmupResponse) -> Self {
        Self {
            block_size: response.block_size,
            num_blocks: response.num_blocks,
        }
    }
}

fn sampling(sampling: SamplingParams, draws_done: u32) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: sampling.temperature,
        top_p: sampling.top_p,
        top_k: sampling.top_k,
        min_p: sampling.min_p,
        repetition_penalty: sampling.repetition_penalty,
        seed: sampling.seed,
        draws_done,
        presence_penalty: sampling.presence_penalty,
        frequency_penalty: sampling.frequency_penalty,
        logit_bias: sampling.logit_bias.into_iter().collect(),
        top_logprobs: sampling.top_logprobs,
    }
}

impl From<Grammar> for pb::Grammar {
    fn from(grammar: Grammar) -> Self {
        let kind = match grammar.kind {
            GrammarKind::JsonSchema => pb::grammar::Kind::JsonSchema,
            GrammarKind::Regex => pb::grammar::Kind::Regex,
            GrammarKind::Lark => pb::grammar::Kind::Lark,
        };
        Self {
            kind: kind as i32,
            text: grammar.text,
            eos_token_ids: grammar.eos_token_ids,
        }
    }
}

impl From<PrefillEntry> for pb::Request {
    fn from(entry: PrefillEntry) -> Self {
        Self {
            id: entry.id,
            input_ids: entry.input_ids,
            blocks: entry.blocks,
            sampling: Some(sampling(entry.sampling, entry.draws_done)),
            max_new_tokens: entry.max_new_tokens,
            adapter_id: entry.adapter_id,
            prompt_logprobs: entry.prompt_logprobs,
            grammar_id: entry.grammar_id.unwrap_or(0),
            cached_tokens: entry.cached_tokens,
            prefill_until: entry.prefill_until,
            embed: entry.embed,
        }
    }
}

impl From<pb::TokenLogprob> for TokenLogprob {
    fn from(entry: pb::TokenLogprob) -> Self {
        Self {
            token_id: entry.token_id,
            logprob: entry.logprob,
        }
    }
}

impl From<pb::PromptPosition> for PromptPosition {
    fn from(position: pb::PromptPosition) -> Self {
        Self {
            logprob: position.logprob,
            rank: position.rank,
            top: position.top.into_iter().map(TokenLogprob::from).collect(),
        }
    }
}

impl From<pb::Generation> for Generation {
    fn from(generation: pb::Generation) -> Self {
        Self {
            request_id: generation.request_id,
            token_id: generation.token_id,
            logprob: generation.logprob,
            top_logprobs: generation
                .top_logprobs
                .into_iter()
                .map(TokenLogprob::from)
                .collect(),
            prompt_logprobs: generation
                .prompt_logprobs
                .into_iter()
                .map(PromptPosition::from)
                .collect(),
            embedding: generation.embedding,
        }
    }
}

impl From<pb::CachedBatch> for CachedBatch {
    fn from(batch: pb::CachedBatch) -> Self {
        Self {
            id: batch.id,
            request_ids: batch.request_ids,
        }
    }
}

impl From<CachedBatch> for pb::CachedBatch {
    fn from(batch: CachedBatch) -> Self {
        Self {
            id: batch.id,
            request_ids: batch.request_ids,
        }
    }
}

/// A Prefill's or a Decode's answer.
pub(super) fn step(
    generations: Vec<pb::Generation>,
    batch: Option<pb::CachedBatch>,
    forward_ns: u64,
    grammar_ns: u64,
) -> Step {
    Step {
        generations: generations.into_iter().map(Generation::from).collect(),
        batch: batch.map(CachedBatch::from),
        forward_ns,
        grammar_ns,
    }
}

/// The answer to a Decode that carried a Prefill. One without the prefill's answer comes from
/// a shard that ignored the prefill: its prompts' requests would never run, so the call fails.
pub(super) fn mixed_step(response: pb::DecodeResponse) -> ShardResult<MixedStep> {
    let Some(prefill) = response.prefill else {
        return Err(ShardError::Status {
            rank: 0,
            code: tonic::Code::Internal,
            message: "Decode carrying a prefill returned no prefill answer".to_string(),
        });
    };
    Ok(MixedStep {
        decode: step(
            response.generations,
            response.batch,
            response.forward_ns,
            response.grammar_ns,
        ),
        prefill: step(
            prefill.generations,
            prefill.batch,
            prefill.forward_ns,
            prefill.grammar_ns,
        ),
    })
}

impl From<AdapterLoad> for pb::LoadAdapterRequest {
    fn from(load: AdapterLoad) -> Self {
        Self {
            adapter_id: load.adapter_id,
            source: load.source.as_str().to_owned(),
            path: load.path,
            revision: load.revision,
        }
    }
}

impl From<pb::LoadAdapterResponse> for LoadedAdapter {
    fn from(response: pb::LoadAdapterResponse) -> Self {
        Self {
            path: response.path,
            rank: response.rank,
            scaling: response.scaling,
            target_modules: response.target_modules,
        }
    }
}

/// Whether rank 0 fetches the adapter a `LoadAdapterRequest` names (hub, S3) and the other
/// ranks read its copy (what the client asked for is checked before).
pub(super) fn is_remote(request: &pb::LoadAdapterRequest) -> bool {
    AdapterSource::parse(&request.source).is_ok_and(AdapterSource::is_remote)
}

impl From<pb::CompileGrammarResponse> for GrammarCompiled {
    fn from(response: pb::CompileGrammarResponse) -> Self {
        Self {
            error: Some(response.error).filter(|error| !error.is_empty()),
            compile_ns: response.compile_ns,
        }
    }
}
