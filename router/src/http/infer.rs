//! The one front the serving handlers go through (TGI's `Infer` is the model): a request's
//! grammar compiled on the shards, its choices or inputs admitted and scheduled as one request,
//! their events turned into text with the request metrics and the API key's accounting, and the
//! shutdown's cutoff applied. The chat, completions, Responses and embeddings handlers shape
//! requests and answers; none of them reaches the scheduler, the shard or the metrics itself.

use std::sync::Arc;

use futures::stream::BoxStream;

use super::cutoff::Cutoff;
use super::generation::{
    collect_choices, start_choices, ChoiceEvent, ChoiceOutput, ChoiceSettings,
};
use super::grammar::compile_grammar;
use super::key_meter::charge_when_done;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::scheduler::{
    EventReceiver, FinishReason, GenerationRequest, Grammar, RequestScope, Scheduler,
};
use crate::shard::ShardBackend;
use crate::tenants::Caller;
use crate::tokenizer::TextTokenizer;
use crate::validation::OutputGrammar;

#[derive(Clone)]
pub struct Infer {
    scheduler: Scheduler,
    shard: Arc<dyn ShardBackend>,
    metrics: Arc<Metrics>,
    cutoff: Cutoff,
    /// Why the model cannot generate (an embedding checkpoint without an LM head), if so.
    generation_refusal: Option<String>,
}

/// One generation request's work, as validation left it.
pub struct Generation {
    /// "" for the base model.
    pub adapter_id: String,
    /// The adapter's LoRA rank (0 for the base model), set on every choice.
    pub adapter_rank: u32,
    /// One per choice, in choice order.
    pub choices: Vec<GenerationRequest>,
    /// The constraint every choice carries, with the field it came from.
    pub grammar: Option<OutputGrammar>,
    /// Charged to the key, counted once per prompt.
    pub prompt_tokens: u32,
    /// vLLM's `cache_salt`: narrows the prefix-cache scope the caller's key gives.
    pub cache_salt: Option<String>,
}

impl Infer {
    pub fn new(
        scheduler: Scheduler,
        shard: Arc<dyn ShardBackend>,
        metrics: Arc<Metrics>,
        cutoff: Cutoff,
    ) -> Self {
        Self {
            scheduler,
            shard,
            metrics,
            cutoff,
            generation_refusal: None,
        }
    }

    /// Refuses every generation with `reason` (the model serves embeddings only).
    pub fn refusing_generation(mut self, reason: Option<String>) -> Self {
        self.generation_refusal = reason;
        self
    }

    /// 503 at once while the shard is known gone, before a request costs anything.
    pub fn check_available(&self) -> Result<(), ApiError> {
        match self.shard.is_unavailable() {
            true => Err(ApiError::shard_gone()),
            false => Ok(()),
        }
    }

    /// 400 for a model that serves embeddings only (no LM head), before a generation request
    /// is validated: no template or prompt check can make it answerable.
    pub fn check_generates(&self) -> Result<(), ApiError> {
        match &self.generation_refusal {
            Some(reason) => Err(ApiError::BadRequestBody {
                message: format!("this model serves no generation: {reason}"),
                param: Some("model".to_owned()),
                code: "generation_unavailable",
            }),
            None => Ok(()),
        }
    }

    /// The shutdown's cutoff, which a streamed answer watches.
    pub fn cutoff(&self) -> &Cutoff {
        &self.cutoff
    }

    /// Compiles the request's grammar on the shards (one they cannot use is the client's 400,
    /// named by its field), admits every choice as one request, and returns their event
    /// streams in choice order, charged to `caller` when the last one ends.
    pub async fn generate(
        &self,
        caller: &Caller,
        generation: Generation,
        tokenizer: &TextTokenizer,
        settings: &ChoiceSettings,
    ) -> Result<Vec<BoxStream<'static, ChoiceEvent>>, ApiError> {
        let Generation {
            adapter_id,
            adapter_rank,
            mut choices,
            grammar,
            prompt_tokens,
            cache_salt,
        } = generation;
        let scope = request_scope(caller, cache_salt.as_deref());
        for choice in &mut choices {
            choice.scope = scope.clone();
            choice.adapter_rank = adapter_rank;
        }
        if let Some(source) = &grammar {
            // The choices' EOS ids end the output once the grammar is complete.
            let eos_token_ids = choices
                .first()
                .map(|choice| choice.eos_token_ids.clone())
                .unwrap_or_default();
            let pin = self.scheduler.pin_grammar(Grammar {
                kind: source.kind,
                text: source.text.clone(),
                eos_token_ids,
            });
            compile_grammar(self.shard.as_ref(), &adapter_id, source, &pin).await?;
            for choice in &mut choices {
                choice.grammar = Some(pin.clone());
            }
        }
        let streams = start_choices(
            &self.scheduler,
            &self.shard,
            &self.metrics,
            tokenizer,
            choices,
            settings,
        )?;
        Ok(charge_when_done(caller, prompt_tokens, streams))
    }

    /// Every choice run to its end, unless the shutdown's grace period ends first.
    pub async fn finish(
        &self,
        choices: Vec<BoxStream<'static, ChoiceEvent>>,
    ) -> Result<Vec<ChoiceOutput>, ApiError> {
        tokio::select! {
            outputs = collect_choices(choices) => outputs,
            () = self.cutoff.fired() => {
                self.cutoff.record_cut();
                Err(ApiError::GracePeriodOver)
            }
        }
    }

    /// The embedding of each input (token ids), in input order, on `adapter_id` (of LoRA rank
    /// `adapter_rank`): admitted as one request, each input one whole Prefill that holds no
    /// batch slot. Its tokens are charged to `caller` once admitted, as a generation's prompt is.
    pub async fn embed(
        &self,
        caller: &Caller,
        adapter_id: &str,
        adapter_rank: u32,
        inputs: Vec<Vec<u32>>,
    ) -> Result<Vec<Vec<f32>>, ApiError> {
        let tokens: u64 = inputs.iter().map(|ids| ids.len() as u64).sum();
        let count = inputs.len() as u64;
        let scope = request_scope(caller, None);
        let requests = inputs
            .into_iter()
            .map(|ids| GenerationRequest {
                scope: scope.clone(),
                ..GenerationRequest::embedding(ids, adapter_id, adapter_rank)
            })
            .collect();
        let receivers = self.scheduler.submit_all(requests)?;
        caller.charge(tokens, 0);
        Metrics::add(&self.metrics.prompt_tokens_total, tokens);
        Metrics::add(&self.metrics.embedding_tokens_total, tokens);
        let vectors = tokio::select! {
            vectors = collect_embeddings(receivers) => vectors,
            () = self.cutoff.fired() => {
                self.cutoff.record_cut();
                return Err(ApiError::GracePeriodOver);
            }
        };
        match vectors {
            Ok(vectors) => {
                Metrics::add(&self.metrics.embedding_inputs_total, count);
                Ok(vectors)
            }
            Err(error) => {
                Metrics::add(&self.metrics.requests_failed_total, 1);
                self.check_available()?;
                Err(error)
            }
        }
    }
}

/// Whose request it is: the caller's tenant, and a prefix-cache scope no client can widen: the
/// key's group, narrowed by `cache_salt`. Group names have no U+001F, so the separator keeps
/// every (group, salt) pair apart from every group alone.
fn request_scope(caller: &Caller, cache_salt: Option<&str>) -> RequestScope {
    let group = caller.prefix_cache_group();
    RequestScope {
        tenant: caller.tenant().to_owned(),
        cache_scope: match cache_salt {
            Some(salt) => format!("{group}\u{1f}{salt}"),
            None => group.to_owned(),
        },
    }
}

/// Each input's embedding, in input order; the first failure fails the request (dropping the
/// other receivers cancels what has not run yet).
async fn collect_embeddings(receivers: Vec<EventReceiver>) -> Result<Vec<Vec<f32>>, ApiError> {
    let mut vectors = Vec::with_capacity(receivers.len());
    for mut receiver in receivers {
        match receiver.recv().await {
            Some(Ok(event)) if event.finish == Some(FinishReason::Embedded) => {
                vectors.push(event.embedding);
            }
            Some(Ok(_)) | None => {
                return Err(ApiError::Internal(
                    "the scheduler ended an embedding request without its embedding".to_owned(),
                ))
            }
            Some(Err(error)) => return Err(error.into()),
        }
    }
    Ok(vectors)
}
