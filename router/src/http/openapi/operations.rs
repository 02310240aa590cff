//! One `#[utoipa::path]` per route of `http::router`: the handlers are generic or shared by
//! two paths, so the operations are declared here, on bodiless functions, rather than on them.
//! `tests/http_openapi.rs` fails when a route has no operation here, or an operation no route.
#![allow(dead_code)]

use super::responses::{
    AdapterErrors, GenerationErrors, HealthErrors, ListErrors, LookupErrors, TokenErrors,
};
use crate::http::ServerInfo;
use crate::openai::adapters::{LoadLoraAdapterRequest, UnloadLoraAdapterRequest};
use crate::openai::chat::{ChatCompletionChunk, ChatCompletionResponse};
use crate::openai::completions::CompletionResponse;
use crate::openai::embeddings::{EmbeddingsRequest, EmbeddingsResponse};
use crate::openai::models::{ModelCard, ModelList};
use crate::openai::responses_request::ResponsesRequest;
use crate::openai::schema::{ChatCompletionRequest, CompletionRequest};
use crate::openai::tokenize::{
    DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
};

/// A chat completion. With `stream: true` the answer is Server-Sent Events: each `data:` line
/// holds one chunk, an error after the stream started is a last `data: {"error": ...}`, and
/// `data: [DONE]` ends it.
#[utoipa::path(
    post, path = "/v1/chat/completions", tag = "generation",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion, or its chunks as Server-Sent Events",
         content((ChatCompletionResponse = "application/json"),
                 (ChatCompletionChunk = "text/event-stream"))),
        GenerationErrors,
    ),
    security((), ("api_key" = [])),
)]
fn chat_completions() {}

/// OpenAI's Responses API on the chat path (docs/api.md#responses). With `stream: true` the
/// answer is Server-Sent Events of typed events (`event:` names each), ending with
/// `response.completed` or `response.incomplete`, without `[DONE]`.
#[utoipa::path(
    post, path = "/v1/responses", tag = "generation",
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The Response object, or its events as Server-Sent Events",
         content((Object = "application/json"), (Object = "text/event-stream"))),
        GenerationErrors,
    ),
    security((), ("api_key" = [])),
)]
fn responses() {}

/// The embedding of each input, from the base model or an adapter (docs/api.md#embeddings):
/// its last hidden states pooled as the model's sentence-transformers files say, else the last
/// token's, L2-normalized.
#[utoipa::path(
    post, path = "/v1/embeddings", tag = "embeddings",
    request_body = EmbeddingsRequest,
    responses(
        (status = 200, description = "OpenAI's list of embeddings", body = EmbeddingsResponse),
        GenerationErrors,
    ),
    security((), ("api_key" = [])),
)]
fn embeddings() {}

/// A text completion; streamed as chat is, with the response object as each chunk.
#[utoipa::path(
    post, path = "/v1/completions", tag = "generation",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion, or its chunks as Server-Sent Events",
         content((CompletionResponse = "application/json"),
                 (CompletionResponse = "text/event-stream"))),
        GenerationErrors,
    ),
    security((), ("api_key" = [])),
)]
fn completions() {}

/// The base model, then every loaded adapter in load order; in pages with `limit` and `after`.
#[utoipa::path(
    get, path = "/v1/models", tag = "models",
    params(
        ("limit" = Option<u32>, Query, description = "Cards per page, 1 to 1000 (paged answers only)"),
        ("after" = Option<String>, Query, description = "The id of the last card of the previous page"),
    ),
    responses((status = 200, description = "OpenAI's list object", body = ModelList), ListErrors),
    security((), ("api_key" = [])),
)]
fn list_models() {}

/// One model or loaded adapter; never loads one.
#[utoipa::path(
    get, path = "/v1/models/{id}", tag = "models",
    params(("id" = String, Path, description = "A model or adapter id; hub ids keep their `/`")),
    responses((status = 200, description = "The model card", body = ModelCard), LookupErrors),
    security((), ("api_key" = [])),
)]
fn retrieve_model() {}

/// Loads an adapter under a name of the operator's choosing (vLLM's endpoint).
#[utoipa::path(
    post, path = "/v1/load_lora_adapter", tag = "adapters",
    request_body = LoadLoraAdapterRequest,
    responses(
        (status = 200, description = "Loaded", body = String, content_type = "text/plain"),
        AdapterErrors,
    ),
    security((), ("api_key" = [])),
)]
fn load_lora_adapter() {}

/// Unloads an adapter; its running requests finish first.
#[utoipa::path(
    post, path = "/v1/unload_lora_adapter", tag = "adapters",
    request_body = UnloadLoraAdapterRequest,
    responses(
        (status = 200, description = "Unloaded", body = String, content_type = "text/plain"),
        AdapterErrors,
    ),
    security((), ("api_key" = [])),
)]
fn unload_lora_adapter() {}

/// A `prompt`, or `messages` rendered with the chat template, as token ids (vLLM's shapes).
#[utoipa::path(
    post, path = "/tokenize", tag = "tokens",
    request_body = TokenizeRequest,
    responses((status = 200, description = "The token ids", body = TokenizeResponse), TokenErrors),
    security((), ("api_key" = [])),
)]
fn tokenize() {}

/// `/tokenize` under the `/v1` base URL clients are configured with.
#[utoipa::path(
    post, path = "/v1/tokenize", tag = "tokens", operation_id = "tokenize_v1",
    request_body = TokenizeRequest,
    responses((status = 200, description = "The token ids", body = TokenizeResponse), TokenErrors),
    security((), ("api_key" = [])),
)]
fn tokenize_v1() {}

/// Token ids back to text, special tokens kept.
#[utoipa::path(
    post, path = "/detokenize", tag = "tokens",
    request_body = DetokenizeRequest,
    responses((status = 200, description = "The text", body = DetokenizeResponse), TokenErrors),
    security((), ("api_key" = [])),
)]
fn detokenize() {}

/// `/detokenize` under the `/v1` base URL.
#[utoipa::path(
    post, path = "/v1/detokenize", tag = "tokens", operation_id = "detokenize_v1",
    request_body = DetokenizeRequest,
    responses((status = 200, description = "The text", body = DetokenizeResponse), TokenErrors),
    security((), ("api_key" = [])),
)]
fn detokenize_v1() {}

/// Readiness: 200 with an empty body when the shard answers its health check.
#[utoipa::path(
    get, path = "/health", tag = "operations",
    responses((status = 200, description = "Every shard is ready"), HealthErrors),
)]
fn health() {}

/// The served model, its device and the resolved limits.
#[utoipa::path(
    get, path = "/info", tag = "operations",
    responses((status = 200, description = "Model, device and limits", body = ServerInfo)),
)]
fn info() {}

/// Prometheus metrics.
#[utoipa::path(
    get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text exposition format", body = String,
               content_type = "text/plain")),
)]
fn metrics() {}

/// This document.
#[utoipa::path(
    get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "OpenAPI 3.1", body = Object,
               content_type = "application/json")),
)]
fn openapi_json() {}
