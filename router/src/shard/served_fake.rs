//! A `FakeShard` served over gRPC, as the Python shard serves its engine: the shard's side of
//! the wire (protobuf in, the router's types to the fake, protobuf out), for the client tests.

use std::sync::Arc;

use quiver_flags::AdapterSource;
use tonic::{Request, Response, Status};

use super::{
    AdapterLoad, CachedBatch, FakeShard, Generation, Grammar, GrammarKind, PrefillEntry,
    PromptPosition, SamplingParams, ShardBackend, ShardError, ShardInfo, Step, TokenLogprob,
    WarmupLimits,
};
use crate::pb;
use crate::pb::shard_server::Shard;

pub(super) struct Served(pub(super) Arc<FakeShard>);

fn to_status(error: ShardError) -> Status {
    Status::new(error.code(), error.message())
}

type Answer<T> = Result<Response<T>, Status>;

fn answer<T, U: From<T>>(result: Result<T, ShardError>) -> Answer<U> {
    result
        .map(|value| Response::new(U::from(value)))
        .map_err(to_status)
}

#[tonic::async_trait]
impl Shard for Served {
    async fn info(&self, _: Request<pb::InfoRequest>) -> Answer<pb::InfoResponse> {
        answer(self.0.info().await)
    }
    async fn health(&self, _: Request<pb::HealthRequest>) -> Answer<pb::HealthResponse> {
        answer(self.0.health().await.map(|()| pb::HealthResponse {}))
    }
    async fn warmup(&self, r: Request<pb::WarmupRequest>) -> Answer<pb::WarmupResponse> {
        let r = r.into_inner();
        let limits = WarmupLimits {
            max_batch_prefill_tokens: r.max_batch_prefill_tokens,
            max_total_tokens: r.max_total_tokens,
            max_batch_size: r.max_batch_size,
            max_batch_total_tokens: r.max_batch_total_tokens,
            max_active_adapters: r.max_active_adapters,
            max_lora_rank: r.max_lora_rank,
            slot_ranks: r.slot_ranks,
        };
        let layout = self.0.warmup(limits).await;
        answer(layout.map(|kv| pb::WarmupResponse {
            block_size: kv.block_size,
            num_blocks: kv.num_blocks,
        }))
    }
    async fn prefill(&self, r: Request<pb::PrefillRequest>) -> Answer<pb::PrefillResponse> {
        let r = r.into_inner();
        let requests = r.requests.into_iter().map(prefill_entry).collect();
        let step = self.0.prefill(r.batch_id, requests).await;
        answer(step.map(|step| {
            let (generations, batch, forward_ns, grammar_ns) = step_parts(step);
            pb::PrefillResponse {
                generations,
                batch,
                forward_ns,
                grammar_ns,
            }
        }))
    }
    async fn decode(&self, r: Request<pb::DecodeRequest>) -> Answer<pb::DecodeResponse> {
        let r = r.into_inner();
        let batches = r.batches.into_iter().map(Into::into).collect();
        let Some(prefill) = r.prefill else {
            return answer(
                self.0
                    .decode(batches)
                    .await
                    .map(|step| decode_response(step, None)),
            );
        };
        let requests = prefill.requests.into_iter().map(prefill_entry).collect();
        let mixed = self
            .0
            .decode_with_prefill(batches, prefill.batch_id, requests);
        answer(mixed.await.map(|mixed| {
            let (generations, batch, forward_ns, grammar_ns) = step_parts(mixed.prefill);
            let prefill = pb::PrefillResponse {
                generations,
                batch,
                forward_ns,
                grammar_ns,
            };
            decode_response(mixed.decode, Some(prefill))
        }))
    }
    async fn filter_batch(
        &self,
        r: Request<pb::FilterBatchRequest>,
    ) -> Answer<pb::FilterBatchResponse> {
        let r = r.into_inner();
        let kept = self.0.filter_batch(r.batch_id, r.request_ids).await;
        answer(kept.map(|batch| pb::FilterBatchResponse {
            batch: batch.map(pb::CachedBatch::from),
        }))
    }
    async fn clear_cache(
        &self,
        r: Request<pb::ClearCacheRequest>,
    ) -> Answer<pb::ClearCacheResponse> {
        let cleared = self.0.clear_cache(r.into_inner().batch_id).await;
        answer(cleared.map(|()| pb::ClearCacheResponse {}))
    }
    async fn load_adapter(
        &self,
        r: Request<pb::LoadAdapterRequest>,
    ) -> Answer<pb::LoadAdapterResponse> {
        let r = r.into_inner();
        let source = AdapterSource::parse(&r.source)
            .map_err(|_| Status::invalid_argument(format!("unknown source {:?}", r.source)))?;
        let load = AdapterLoad {
            adapter_id: r.adapter_id,
            source,
            path: r.path,
            revision: r.revision,
        };
        answer(
            self.0
                .load_adapter(load)
                .await
                .map(|loaded| pb::LoadAdapterResponse {
                    path: loaded.path,
                    rank: loaded.rank,
                    scaling: loaded.scaling,
                    target_modules: loaded.target_modules,
                }),
        )
    }
    async fn activate_adapter(
        &self,
        r: Request<pb::ActivateAdapterRequest>,
    ) -> Answer<pb::ActivateAdapterResponse> {
        let r = r.into_inner();
        let hit = self.0.activate_adapter(r.adapter_id, r.slot).await;
        answer(hit.map(|host_cache_hit| pb::ActivateAdapterResponse { host_cache_hit }))
    }
    async fn prefetch_adapter(
        &self,
        r: Request<pb::PrefetchAdapterRequest>,
    ) -> Answer<pb::PrefetchAdapterResponse> {
        let hit = self.0.prefetch_adapter(r.into_inner().adapter_id).await;
        answer(hit.map(|host_cache_hit| pb::PrefetchAdapterResponse { host_cache_hit }))
    }
    async fn unload_adapter(
        &self,
        r: Request<pb::UnloadAdapterRequest>,
    ) -> Answer<pb::UnloadAdapterResponse> {
        let unloaded = self.0.unload_adapter(r.into_inner().adapter_id).await;
        answer(unloaded.map(|()| pb::UnloadAdapterResponse {}))
    }
    async fn release_grammars(
        &self,
        r: Request<pb::ReleaseGrammarsRequest>,
    ) -> Answer<pb::ReleaseGrammarsResponse> {
        let released = self.0.release_grammars(r.into_inner().grammar_ids).await;
        answer(released.map(|()| pb::ReleaseGrammarsResponse {}))
    }
    async fn compile_grammar(
        &self,
        r: Request<pb::CompileGrammarRequest>,
    ) -> Answer<pb::CompileGrammarResponse> {
        let r = r.into_inner();
        let grammar = r
            .grammar
            .map(grammar)
            .ok_or_else(|| Status::invalid_argument("CompileGrammar without a grammar"))?;
        let compiled = self
            .0
            .compile_grammar(r.adapter_id, grammar, r.grammar_id)
            .await;
        answer(compiled.map(|c| pb::CompileGrammarResponse {
            error: c.error.unwrap_or_default(),
            compile_ns: c.compile_ns,
        }))
    }
}

impl From<ShardInfo> for pb::InfoResponse {
    fn from(info: ShardInfo) -> Self {
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

pub(super) fn grammar(grammar: pb::Grammar) -> Grammar {
    let kind = match grammar.kind() {
        pb::grammar::Kind::Regex => GrammarKind::Regex,
        pb::grammar::Kind::Lark => GrammarKind::Lark,
        pb::grammar::Kind::JsonSchema | pb::grammar::Kind::Unspecified => GrammarKind::JsonSchema,
    };
    Grammar {
        kind,
        text: grammar.text,
        eos_token_ids: grammar.eos_token_ids,
    }
}

pub(super) fn prefill_entry(request: pb::Request) -> PrefillEntry {
    let sampling = request.sampling.unwrap_or_default();
    PrefillEntry {
        id: request.id,
        input_ids: request.input_ids,
        blocks: request.blocks,
        sampling: SamplingParams {
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: sampling.top_k,
            min_p: sampling.min_p,
            repetition_penalty: sampling.repetition_penalty,
            seed: sampling.seed,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            // A map on the wire: ordered here so that a round trip compares equal.
            logit_bias: {
                let mut bias: Vec<(u32, f32)> = sampling.logit_bias.into_iter().collect();
                bias.sort_by_key(|(token, _)| *token);
                bias
            },
            top_logprobs: sampling.top_logprobs,
        },
        draws_done: sampling.draws_done,
        max_new_tokens: request.max_new_tokens,
        adapter_id: request.adapter_id,
        prompt_logprobs: request.prompt_logprobs,
        grammar_id: Some(request.grammar_id).filter(|&id| id != 0),
        cached_tokens: request.cached_tokens,
        prefill_until: request.prefill_until,
        embed: request.embed,
    }
}

fn token_logprob(entry: TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: entry.token_id,
        logprob: entry.logprob,
    }
}

fn generation(generation: Generation) -> pb::Generation {
    pb::Generation {
        request_id: generation.request_id,
        token_id: generation.token_id,
        logprob: generation.logprob,
        top_logprobs: generation
            .top_logprobs
            .into_iter()
            .map(token_logprob)
            .collect(),
        prompt_logprobs: generation
            .prompt_logprobs
            .into_iter()
            .map(|position: PromptPosition| pb::PromptPosition {
                logprob: position.logprob,
                top: position.top.into_iter().map(token_logprob).collect(),
                rank: position.rank,
            })
            .collect(),
        embedding: generation.embedding,
    }
}

pub(super) fn decode_response(
    step: Step,
    prefill: Option<pb::PrefillResponse>,
) -> pb::DecodeResponse {
    let (generations, batch, forward_ns, grammar_ns) = step_parts(step);
    pb::DecodeResponse {
        generations,
        batch,
        forward_ns,
        grammar_ns,
        prefill,
    }
}

pub(super) fn step_parts(step: Step) -> (Vec<pb::Generation>, Option<pb::CachedBatch>, u64, u64) {
    (
        step.generations.into_iter().map(generation).collect(),
        step.batch.map(|batch: CachedBatch| batch.into()),
        step.forward_ns,
        step.grammar_ns,
    )
}
