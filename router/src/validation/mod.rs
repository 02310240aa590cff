//! OpenAI request bodies → `GenerationRequest`s the scheduler accepts, plus how to answer.
//!
//! Everything a client can get wrong is caught here and named (`param`), before any token
//! reaches the scheduler: parameter ranges, message shapes, the chat template raising, prompt
//! and completion lengths against the served limits, token ids against the vocabulary.

mod bounds;
mod controls;
mod embeddings;
mod error;
mod limits;
mod logprob_budget;
mod logprobs;
mod messages;
mod params;
mod prompt;
mod sources;
mod structured;
mod template_kwargs;
mod tokens;
mod tool_turns;

pub use bounds::{PromptLimits, RequestBounds, MAX_PROMPTS};
pub use controls::{
    ControlLimits, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_SEQUENCE_BYTES, MAX_STOP_TOKEN_IDS,
};
pub use error::ValidationError;
pub use limits::{Limits, RequestedLimits};
pub use logprob_budget::{default_max_logprob_entries, LogprobEntries};
pub use logprobs::{LogprobFields, LogprobOptions, MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS};
pub use sources::PromptSource;
pub use structured::OutputGrammar;
pub use tokens::{tokenize_ids, vocabulary_ids};

use logprob_budget::check_logprob_entries;
use logprobs::{apply_logprobs, check_best_of_bound};
use params::{check_params, CheckedParams};

use crate::openai::common::GenerationParams;
use crate::reasoning::{reasoning_parser_for, ReasoningParserFlag, ReasoningPlan};
use crate::scheduler::{GenerationRequest, SamplingParams};
use crate::template::ChatTemplate;
use crate::tokenizer::TextTokenizer;
use crate::tool_calls::{parser_for, tool_system_prompt, ToolCallParser, ToolPlan};

/// Upper bound on `n`, so one request cannot queue an unbounded number of choices.
pub const MAX_N: u32 = 128;

/// What a model needs to turn text into tokens and back. One for the base model; an adapter
/// that ships its own tokenizer or template has its own (`crate::adapters`).
#[derive(Debug, Clone)]
pub struct ModelAssets {
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    /// The template is an adapter's own, not the base model's: its tool-call and reasoning
    /// formats come before `--tool-call-parser` and `--reasoning-parser`, which name the base
    /// model's (`tool_calls::parser_for`).
    pub adapters_own_template: bool,
}

/// How the response is shaped; everything the HTTP layer needs besides the generations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ResponseOptions {
    pub stream: bool,
    pub include_usage: bool,
    pub return_token_ids: bool,
    /// Ends a choice when it appears in the text; never emitted.
    pub stop: Vec<String>,
    /// Choices returned per prompt. `choices` holds `best_of` per prompt (at least `n`), of
    /// which the `n` with the highest cumulative logprob are returned.
    pub n: u32,
    pub logprobs: LogprobOptions,
}

/// A request that passed validation.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    /// One per choice, in choice-index order (prompt-major, then `n`).
    pub choices: Vec<GenerationRequest>,
    /// Prompt tokens counted once per prompt (not per `n`), as OpenAI bills them.
    pub prompt_tokens: u32,
    pub options: ResponseOptions,
    /// Per prompt: its ids, and with `echo` the text echoed before the completion (the prompt
    /// as sent, or the decoded ids).
    pub prompts: Vec<ValidPrompt>,
    /// The constraint every choice carries (the shards compile it before admission), with the
    /// field it came from.
    pub grammar: Option<OutputGrammar>,
    /// Chat with `tools`: how replies are constrained and read for calls.
    pub tools: Option<ToolPlan>,
    /// Chat with a thinking model: how replies are split into reasoning and content.
    pub reasoning: Option<ReasoningPlan>,
    /// vLLM's `cache_salt`, if sent.
    pub cache_salt: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ValidPrompt {
    pub ids: Vec<u32>,
    pub echo: Option<String>,
}

/// Checks requests against the served limits and the model's vocabulary.
#[derive(Debug, Clone)]
pub struct Validator {
    pub limits: Limits,
    pub vocab_size: u32,
    /// Token ids that end a choice with `finish_reason: "stop"`: the model's and its
    /// tokenizer's. An adapter's own tokenizer adds its stop ids to these.
    pub eos_token_ids: Vec<u32>,
    /// `--max-stop-sequences`.
    pub max_stop_sequences: u32,
    /// Choices per request and the share of the KV cache one request may reserve.
    pub bounds: RequestBounds,
    /// `--max-logprob-entries`: what one response's logprobs may hold.
    pub max_logprob_entries: u64,
    /// `--tool-call-parser`; unset, each model's (or adapter's) chat template decides.
    pub tool_call_parser: Option<ToolCallParser>,
    /// `--reasoning-parser`; unset, each model's (or adapter's) chat template decides.
    pub reasoning_parser: Option<ReasoningParserFlag>,
}

impl Validator {
    /// Checks the parameters, builds the prompts the way the endpoint's fields say, then checks
    /// each prompt against the limits and the vocabulary.
    pub async fn validate<F: PromptSource>(
        &self,
        assets: &ModelAssets,
        adapter_id: &str,
        mut fields: F,
        params: &GenerationParams,
    ) -> Result<ValidRequest, ValidationError> {
        let logprob_fields = fields.logprob_fields();
        let template = assets.template.as_ref().map(ChatTemplate::source);
        let reasoning_parser = match F::SPLITS_REASONING {
            true => reasoning_parser_for(
                self.reasoning_parser,
                template,
                assets.adapters_own_template,
            ),
            false => None,
        };
        let tools = match fields.tool_request()? {
            Some(request) => {
                let parser = parser_for(
                    self.tool_call_parser,
                    template,
                    assets.adapters_own_template,
                );
                if let Some(text) = tool_system_prompt(parser, &request, template) {
                    fields.add_tool_prompt(text);
                }
                Some(ToolPlan::new(request, parser, &assets.tokenizer))
            }
            None => None,
        };
        let control_limits = ControlLimits {
            vocab_size: self.vocab_size,
            max_stop_sequences: self.max_stop_sequences,
        };
        let mut checked = check_params(params, logprob_fields.echo(), control_limits)?;
        apply_logprobs(logprob_fields, params, &mut checked)?;
        check_best_of_bound(&checked, self.bounds.max_choices_per_request)?;
        let limits = PromptLimits {
            request: self.bounds,
            n: checked.n,
            max_input_tokens: self.limits.max_input_tokens,
        };
        let sourced = fields.prompt_ids(assets, &limits).await?;
        let reasoning = reasoning_parser.map(|parser| {
            let prompt = sourced.first().and_then(|(_, text)| text.as_deref());
            ReasoningPlan::new(parser, prompt.unwrap_or_default(), &assets.tokenizer)
        });
        let echo = checked.options.logprobs.echo;
        let mut prompts = Vec::with_capacity(sourced.len());
        for (ids, text) in sourced {
            let echo = match text {
                Some(text) if echo => Some(text),
                None if echo => Some(
                    assets
                        .tokenizer
                        .decode_off_runtime(ids.clone(), true)
                        .await?,
                ),
                _ => None,
            };
            prompts.push(ValidPrompt { ids, echo });
        }
        if let Some(text) = tools.as_ref().and_then(ToolPlan::grammar_text) {
            // One grammar per request: tool calls and a structured reply cannot both hold.
            if let Some(other) = &checked.grammar {
                return Err(ValidationError::invalid(
                    other.param,
                    format!(
                        "`{}` cannot be combined with tool calls; drop it, or send \
                         `tool_choice: \"none\"`",
                        other.param
                    ),
                ));
            }
            checked.grammar = Some(OutputGrammar::tool_calls(text.to_owned()));
        }
        if let Some(plan) = &reasoning {
            checked.grammar = checked
                .grammar
                .take()
                .map(|grammar| plan.constrain_after_thinking(grammar));
        }
        let mut valid = self.build(prompts, F::PARAM, checked, adapter_id, assets)?;
        valid.tools = tools;
        valid.reasoning = reasoning;
        Ok(valid)
    }

    /// The model's EOS ids plus those of the tokenizer in use (an adapter's own tokenizer may
    /// end turns with a token of its own, e.g. `<|im_end|>`).
    fn eos_token_ids_for(&self, assets: &ModelAssets) -> Vec<u32> {
        let mut ids = self.eos_token_ids.clone();
        ids.extend_from_slice(assets.tokenizer.stop_token_ids());
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Length and vocabulary checks per prompt, then one `GenerationRequest` per choice.
    fn build(
        &self,
        prompts: Vec<ValidPrompt>,
        prompt_param: &str,
        checked: CheckedParams,
        adapter_id: &str,
        assets: &ModelAssets,
    ) -> Result<ValidRequest, ValidationError> {
        // Every per-prompt check, then the whole request's logprobs and KV demand, before any
        // choice is built.
        let mut max_new_tokens = Vec::with_capacity(prompts.len());
        for prompt in &prompts {
            max_new_tokens.push(self.check_prompt(&prompt.ids, prompt_param, &checked)?);
        }
        let lengths = prompts
            .iter()
            .zip(&max_new_tokens)
            .map(|(prompt, &new)| (prompt.ids.len() as u64, u64::from(new)));
        let entries = LogprobEntries::of(&checked.options.logprobs, lengths, checked.n);
        check_logprob_entries(&entries, self.max_logprob_entries)?;
        let demand = prompts
            .iter()
            .zip(&max_new_tokens)
            .map(|(prompt, &new)| prompt.ids.len() as u64 + u64::from(new));
        self.bounds
            .check_kv_demand(demand, checked.n, prompt_param)?;
        let eos_token_ids = self.eos_token_ids_for(assets);
        let mut choices = Vec::with_capacity(prompts.len() * checked.n as usize);
        let mut prompt_tokens = 0u32;
        let prompt_logprobs = checked.options.logprobs.shard_prompt_logprobs();
        for (prompt, max_new_tokens) in prompts.iter().zip(max_new_tokens) {
            let input_ids = &prompt.ids;
            prompt_tokens += input_ids.len() as u32;
            for choice in 0..checked.n {
                let seed = match checked.seed {
                    // Distinct seeds per choice, or all `n` choices would be identical.
                    Some(seed) => seed.wrapping_add(u64::from(choice)),
                    None => rand::random(),
                };
                choices.push(GenerationRequest {
                    input_ids: input_ids.clone(),
                    max_new_tokens,
                    sampling: SamplingParams {
                        seed,
                        ..checked.sampling.clone()
                    },
                    eos_token_ids: eos_token_ids.clone(),
                    ignore_eos: checked.ignore_eos,
                    stop_token_ids: checked.stop_token_ids.clone(),
                    min_tokens: checked.min_tokens,
                    adapter_id: adapter_id.to_owned(),
                    // The registry's (`Infer::generate`).
                    adapter_rank: 0,
                    prompt_logprobs,
                    // Pinned once the shards compiled it (`Infer::generate`).
                    grammar: None,
                    embed: false,
                    // The caller's (`Infer::generate`).
                    scope: Default::default(),
                });
            }
        }
        Ok(ValidRequest {
            choices,
            prompt_tokens,
            options: checked.options,
            prompts,
            grammar: checked.grammar,
            tools: None,
            reasoning: None,
            cache_salt: checked.cache_salt,
        })
    }

    /// A prompt's ids: not empty, within `--max-input-tokens`, in the vocabulary.
    fn check_prompt_ids(
        &self,
        input_ids: &[u32],
        prompt_param: &str,
    ) -> Result<(), ValidationError> {
        let length = input_ids.len() as u32;
        if length == 0 {
            return Err(ValidationError::invalid(
                prompt_param,
                "the prompt is empty (0 tokens)",
            ));
        }
        if length > self.limits.max_input_tokens {
            return Err(bounds::too_long(
                prompt_param,
                &length.to_string(),
                self.limits.max_input_tokens,
            ));
        }
        if let Some(&bad) = input_ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(ValidationError::invalid(
                prompt_param,
                format!(
                    "token id {bad} is out of range: the vocabulary has {} tokens",
                    self.vocab_size
                ),
            ));
        }
        Ok(())
    }

    /// Length, vocabulary and `max_tokens` checks of one prompt; returns its `max_new_tokens`.
    fn check_prompt(
        &self,
        input_ids: &[u32],
        prompt_param: &str,
        checked: &CheckedParams,
    ) -> Result<u32, ValidationError> {
        let limits = self.limits;
        self.check_prompt_ids(input_ids, prompt_param)?;
        let length = input_ids.len() as u32;
        let available = limits.max_total_tokens - length;
        let max_new_tokens = match checked.max_tokens {
            Some((requested, field)) if requested > available => {
                return Err(ValidationError::Invalid {
                    param: field.to_owned(),
                    code: "context_length_exceeded",
                    message: format!(
                        "`{field}` is {requested}, but the prompt has {length} tokens, which \
                         leaves {available} of the {} total tokens this server allows \
                         (--max-total-tokens)",
                        limits.max_total_tokens
                    ),
                });
            }
            Some((requested, _)) => requested,
            None => available,
        };
        if checked.min_tokens > max_new_tokens {
            return Err(ValidationError::invalid(
                "min_tokens",
                format!(
                    "`min_tokens` ({}) exceeds max_tokens ({max_new_tokens})",
                    checked.min_tokens
                ),
            ));
        }
        Ok(max_new_tokens)
    }
}
