//! The router's one front (TGI's `Infer` is the model): what a request's `model` runs with,
//! its validation (chat template and tokenization included), its grammar compiled on the
//! shards, its choices admitted and scheduled as one request, their token events turned into
//! text (detokenizer, stop strings) with the request metrics and the API key's accounting, and
//! the shutdown's cutoff. The HTTP handlers parse a request, call `Infer` and render what comes
//! back; none of them reaches the scheduler, the shard, the validator or the metrics itself.
//! Embeddings are in `embed.rs`, `/health` and `/metrics` in `status.rs`.

use std::sync::Arc;

use futures::stream::BoxStream;
use tracing::Instrument;

use super::cutoff::Cutoff;
use super::generation::{
    collect_choices, start_choices, ChoiceEvent, ChoiceOutput, ChoiceSettings,
};
use super::grammar::compile_grammar;
use super::key_meter::charge_when_done;
use super::models::{Models, ResolvedModel};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::openai::common::GenerationParams;
use crate::reasoning::ReasoningPlan;
use crate::scheduler::{Grammar, RequestScope, Scheduler};
use crate::shard::ShardBackend;
use crate::telemetry;
use crate::tenants::Caller;
use crate::tokenizer::TextTokenizer;
use crate::tool_calls::ToolPlan;
use crate::validation::{PromptSource, ResponseOptions, ValidPrompt, ValidRequest, Validator};

#[derive(Clone)]
pub struct Infer {
    pub(super) scheduler: Scheduler,
    pub(super) shard: Arc<dyn ShardBackend>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) cutoff: Cutoff,
    pub(super) validator: Arc<Validator>,
    models: Models,
    /// Why the model cannot generate (an embedding checkpoint without an LM head), if so.
    generation_refusal: Option<String>,
    /// Why the model serves no embeddings, if so.
    pub(super) embeddings_refusal: Option<String>,
}

/// What `Infer` is built from (by `crate::startup`).
pub struct InferParts {
    pub scheduler: Scheduler,
    pub shard: Arc<dyn ShardBackend>,
    pub metrics: Arc<Metrics>,
    pub validator: Validator,
    pub models: Models,
    pub generation_refusal: Option<String>,
    pub embeddings_refusal: Option<String>,
}

/// A generation request admitted: its choices' event streams, in choice order, and what its
/// answer is shaped from.
pub struct Started {
    pub choices: Vec<BoxStream<'static, ChoiceEvent>>,
    pub setup: ResponseSetup,
    /// Counted once per prompt, as OpenAI bills them.
    pub prompt_tokens: u32,
    /// Choices generated per prompt (`best_of`, else `n`).
    pub choices_per_prompt: u32,
}

/// What an endpoint needs to shape one request's answer besides the generations.
pub struct ResponseSetup {
    /// What the response reports as `model`.
    pub model: String,
    pub options: ResponseOptions,
    /// The request's tokenizer (an adapter's own one if it has one): spells logprob tokens.
    pub tokenizer: TextTokenizer,
    /// One per prompt; choice `i` answers prompt `i / options.n`.
    pub prompts: Vec<ValidPrompt>,
    /// Chat with `tools`: how replies are read for calls.
    pub tools: Option<ToolPlan>,
    /// Chat with a thinking model: how replies are split into reasoning and content.
    pub reasoning: Option<ReasoningPlan>,
}

impl ResponseSetup {
    pub fn prompt(&self, index: u32) -> Option<&ValidPrompt> {
        self.prompts.get((index / self.options.n.max(1)) as usize)
    }

    /// The ids, when the client asked for them.
    pub fn token_ids(&self, ids: impl FnOnce() -> Vec<u32>) -> Option<Vec<u32>> {
        self.options.return_token_ids.then(ids)
    }
}

impl Infer {
    pub fn new(parts: InferParts) -> Self {
        Self {
            scheduler: parts.scheduler,
            shard: parts.shard,
            metrics: parts.metrics,
            cutoff: Cutoff::default(),
            validator: Arc::new(parts.validator),
            models: parts.models,
            generation_refusal: parts.generation_refusal,
            embeddings_refusal: parts.embeddings_refusal,
        }
    }

    /// What a request's `model` can name, and the run-time adapter loads.
    pub fn models(&self) -> &Models {
        &self.models
    }

    /// The batching loop: its load (tests wait for it to drain) and the shutdown's drain.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
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

    /// Resolves the request's `model`, validates it (the chat template and tokenization as one
    /// span), compiles its grammar on the shards (one they cannot use is the client's 400,
    /// named by its field), admits every choice as one request, and returns their event
    /// streams, charged to `caller` when the last one ends.
    pub async fn generate<F: PromptSource>(
        &self,
        caller: &Caller,
        fields: F,
        params: GenerationParams,
    ) -> Result<Started, ApiError> {
        self.check_available()?;
        let ResolvedModel {
            adapter_id,
            adapter_rank,
            assets,
        } = self
            .models
            .resolve(
                caller,
                params.model.as_deref(),
                params.adapter_source.as_deref(),
            )
            .await?;
        self.check_generates()?;
        let valid = self
            .validator
            .validate(&assets, &adapter_id, fields, &params)
            .instrument(telemetry::span("validate"))
            .await?;
        let settings = choice_settings(&valid);
        let ValidRequest {
            mut choices,
            prompt_tokens,
            options,
            prompts,
            grammar,
            tools,
            reasoning,
            cache_salt,
        } = valid;
        let choices_per_prompt = (choices.len() / prompts.len().max(1)) as u32;
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
            &assets.tokenizer,
            choices,
            &settings,
        )?;
        Ok(Started {
            choices: charge_when_done(caller, prompt_tokens, streams),
            setup: ResponseSetup {
                model: self.models.response_model(params.model),
                options,
                tokenizer: assets.tokenizer.clone(),
                prompts,
                tools,
                reasoning,
            },
            prompt_tokens,
            choices_per_prompt,
        })
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
}

/// Whose request it is: the caller's tenant, and a prefix-cache scope no client can widen: the
/// key's group, narrowed by `cache_salt`. Group names have no U+001F, so the separator keeps
/// every (group, salt) pair apart from every group alone.
pub(super) fn request_scope(caller: &Caller, cache_salt: Option<&str>) -> RequestScope {
    let group = caller.prefix_cache_group();
    RequestScope {
        tenant: caller.tenant().to_owned(),
        cache_scope: match cache_salt {
            Some(salt) => format!("{group}\u{1f}{salt}"),
            None => group.to_owned(),
        },
    }
}

/// How each choice's events are produced: the stop strings, the logprobs asked for, and what
/// the tool-call parser and the reasoning split need of the text.
fn choice_settings(valid: &ValidRequest) -> ChoiceSettings {
    let options = &valid.options;
    ChoiceSettings {
        stop: options.stop.clone(),
        prompt_logprobs: options.logprobs.shard_prompt_logprobs().is_some(),
        drop_generation: options.logprobs.drop_generation,
        keep_special_tokens: valid
            .tools
            .as_ref()
            .is_some_and(ToolPlan::keeps_special_tokens)
            || valid
                .reasoning
                .as_ref()
                .is_some_and(ReasoningPlan::keeps_special_tokens),
        reasoning: valid.reasoning.as_ref().map(ReasoningPlan::splitter),
    }
}
