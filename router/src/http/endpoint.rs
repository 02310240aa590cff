//! The one request path of the generation endpoints (`/v1/chat/completions`,
//! `/v1/completions`, and `/v1/responses` through `responses`): parse the body, have `Infer`
//! resolve, validate and schedule every choice, then stream chunks as SSE or collect one JSON
//! response. What differs per endpoint is small and sits behind
//! `Endpoint`: the request fields it reads (which say how its prompts are built, see
//! `PromptSource`), and how its chunks (`ChunkFormat`) and its final response are spelled.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::ignored_fields::name_ignored_fields;
use super::json::{typed, OpenAiJson, RequestBody};
use super::logprobs::{prompt_logprobs, select_best};
use super::sse::{sse_response, ChunkFormat, StreamPlan};
use super::state::AppState;
pub use crate::core::ResponseSetup;
use crate::core::{prompt_cached_tokens, ChoiceOutput, Started};
use crate::error::ApiError;
use crate::openai::common::{GenerationParams, Usage};
use crate::openai::fields::{check_fields, EndpointFields};
use crate::openai::logprobs::PromptLogprobs;
use crate::scheduler::PromptPosition;
use crate::tenants::Caller;
use crate::validation::PromptSource;

/// One generation endpoint; a value formats one request's chunks and response.
pub trait Endpoint: ChunkFormat + Sized {
    /// The request fields only this endpoint reads (`messages`, `prompt`).
    type Fields: PromptSource + EndpointFields + DeserializeOwned + 'static;
    type Response: Serialize;
    /// What the endpoint's answer needs of its request beyond `ResponseSetup` (the Responses
    /// API echoes its request's fields).
    type Context;

    fn new(setup: ResponseSetup, context: Self::Context) -> Self;

    /// The non-streamed response, choices in index order.
    fn response(self, choices: Vec<FinishedChoice>, usage: Usage) -> Self::Response;
}

/// Spelled here, where logprobs are rendered; the rest of `ResponseSetup` is in `core`.
impl ResponseSetup {
    /// vLLM's `prompt_logprobs` for choice `index`, when asked.
    pub fn prompt_logprobs(
        &self,
        index: u32,
        positions: Option<&[PromptPosition]>,
    ) -> Option<PromptLogprobs> {
        let k = self.options.logprobs.prompt?;
        let prompt = self.prompt(index)?;
        Some(prompt_logprobs(
            &self.tokenizer,
            &prompt.ids,
            positions.unwrap_or_default(),
            k,
        ))
    }
}

/// A choice run to its end, for the non-streamed response.
pub struct FinishedChoice {
    pub index: u32,
    pub output: ChoiceOutput,
}

/// An endpoint's request body: its own fields and the shared generation parameters, both read
/// from the same JSON object (see `GenerationParams` for why they are not flattened).
pub struct GenerationBody<F> {
    fields: F,
    params: GenerationParams,
    /// Fields the endpoint does not know: accepted without effect, named in the response.
    ignored: Vec<String>,
}

impl<F> GenerationBody<F> {
    /// The endpoint's fields, the shared parameters, and the fields it does not know.
    pub fn into_parts(self) -> (F, GenerationParams, Vec<String>) {
        (self.fields, self.params, self.ignored)
    }
}

impl<F: DeserializeOwned + EndpointFields> RequestBody for GenerationBody<F> {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        // Refused fields first, and the unknown ones noted: the typed structs below would skip
        // both silently.
        let ignored = match &value {
            Value::Object(body) => check_fields(F::FIELDS, body)?,
            _ => Vec::new(),
        };
        // The shared parameters are read from a borrow (their fields are small); the endpoint's
        // own then take the body, moving `messages` or `prompt` rather than copying them. When
        // both are wrong, the endpoint's field is named.
        let params = typed(&value);
        let fields = typed(value)?;
        Ok(Self {
            fields,
            params: params?,
            ignored,
        })
    }
}

/// The axum handler of endpoint `E`.
pub async fn generate<E: Endpoint<Context = ()>>(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    OpenAiJson(body): OpenAiJson<GenerationBody<E::Fields>>,
) -> Result<Response, ApiError> {
    let GenerationBody {
        fields,
        params,
        ignored,
    } = body;
    let response = answer::<E>(state, &caller, fields, params, ()).await?;
    Ok(name_ignored_fields(response, &ignored))
}

/// Runs one request through `Infer` and answers it: SSE chunks, or one JSON response.
pub(super) async fn answer<E: Endpoint>(
    state: AppState,
    caller: &Caller,
    fields: E::Fields,
    params: GenerationParams,
    context: E::Context,
) -> Result<Response, ApiError> {
    let Started {
        choices,
        setup,
        prompt_tokens,
        choices_per_prompt,
    } = state.infer.generate(caller, fields, params).await?;
    let counts_reasoning = setup.reasoning.is_some();
    let options = setup.options.clone();
    let format = E::new(setup, context);
    if options.stream {
        let plan = StreamPlan {
            choices,
            prompt_tokens,
            choices_per_prompt: choices_per_prompt as usize,
            include_usage: options.include_usage,
            counts_reasoning,
            cutoff: state.infer.cutoff().clone(),
        };
        return Ok(sse_response(format, plan).into_response());
    }
    let outputs = state.infer.finish(choices).await?;
    // Every generated token is billed, also those of choices `best_of` leaves out.
    let completion_tokens = outputs.iter().map(|output| output.completion_tokens).sum();
    let reasoning_tokens = outputs.iter().map(|output| output.reasoning_tokens).sum();
    let cached: Vec<u32> = outputs.iter().map(|output| output.cached_tokens).collect();
    let cached_tokens = prompt_cached_tokens(&cached, choices_per_prompt as usize);
    let finished = select_best(outputs, choices_per_prompt, options.n)
        .into_iter()
        .zip(0..)
        .map(|(output, index)| FinishedChoice { index, output })
        .collect();
    let usage = Usage::new(prompt_tokens, completion_tokens)
        .with_cached(cached_tokens)
        .with_reasoning(counts_reasoning.then_some(reasoning_tokens));
    let response = format.response(finished, usage);
    Ok(Json(response).into_response())
}
