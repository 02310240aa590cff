//! The axum application: routes, authentication, and the fallbacks that keep every error in
//! OpenAI's shape. Handlers parse a request, call `crate::core::Infer`, and render its answer:
//! a generation request flows `endpoint` (with `chat`, `completions` or `responses` saying how
//! its fields are read and its chunks and response spelled) → `Infer::generate` → JSON, or
//! `sse` for a stream; an embeddings request `embeddings` → `Infer::embed` → JSON.

use axum::extract::Request;
use axum::middleware;
use axum::routing::{get, post};
use axum::Router;

use crate::error::ApiError;

mod adapters;
mod auth;
mod body_guard;
mod body_timeout;
mod bounded_json;
mod chat;
mod chat_reader;
mod completions;
mod embeddings;
mod endpoint;
mod give_back;
mod health;
pub(crate) mod held_body;
mod ignored_fields;
mod json;
mod logprobs;
mod metrics;
mod models;
pub mod openapi;
mod responses;
mod sse;
mod state;
mod tokenize;

pub use body_guard::limit_bodies;
pub use state::{AppState, EmbeddingsInfo, ServedLimits, ServerInfo};

/// The whole HTTP surface over `state`. The API keys guard every route that takes a body
/// or names models (loading and unloading need an admin key), and `/metrics` (an admin key,
/// unless `--metrics-open`); `/health`, `/info` and `/openapi.json` stay open.
pub fn router(state: AppState) -> Router {
    // Inside the authentication layer below, which puts the caller where this one reads it.
    let admin = Router::new()
        .route("/v1/load_lora_adapter", post(adapters::load_lora_adapter))
        .route(
            "/v1/unload_lora_adapter",
            post(adapters::unload_lora_adapter),
        )
        .route_layer(middleware::from_fn(auth::require_admin));
    let v1 = Router::new()
        .route(
            "/v1/chat/completions",
            post(endpoint::generate::<chat::Chat>),
        )
        .route("/v1/responses", post(responses::create_response))
        .route(
            "/v1/completions",
            post(endpoint::generate::<completions::Completions>),
        )
        .route("/v1/embeddings", post(embeddings::create_embeddings))
        .route("/v1/models", get(models::list_models))
        .route("/v1/models/{*id}", get(models::retrieve_model))
        // vLLM serves these at the root; the /v1 aliases suit clients configured with a
        // `/v1` base URL.
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .route("/v1/tokenize", post(tokenize::tokenize))
        .route("/v1/detokenize", post(tokenize::detokenize))
        .merge(admin)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authenticate,
        ));
    Router::new()
        .merge(v1)
        .route("/health", get(health::health))
        .route("/info", get(health::info))
        .route(
            "/metrics",
            get(metrics::metrics).route_layer(middleware::from_fn_with_state(
                state.clone(),
                auth::guard_metrics,
            )),
        )
        .route("/openapi.json", get(openapi::openapi_json))
        // The route a response came from, for the response counter below (which sees
        // unmatched paths too, so it sits outside routing).
        .route_layer(middleware::from_fn(metrics::tag_route))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn(body_timeout::answer_late_bodies))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            metrics::count_responses,
        ))
        .layer(middleware::from_fn(crate::telemetry::trace_requests))
        .with_state(state)
}

async fn not_found(request: Request) -> ApiError {
    ApiError::NotFound(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
}

async fn method_not_allowed(request: Request) -> ApiError {
    ApiError::MethodNotAllowed(format!(
        "{} is not allowed on {}",
        request.method(),
        request.uri().path()
    ))
}
