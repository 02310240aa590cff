//! `GET /health` and `GET /info`: unauthenticated, for probes and operators.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

use super::state::{AppState, ServerInfo};
use crate::error::ApiError;

/// 200 when every shard rank answers `Health`; 503 (OpenAI error body) when one does not, or
/// while the router is dialling a rank whose connection failed (`Infer::health`).
pub async fn health(State(state): State<AppState>) -> Result<StatusCode, ApiError> {
    state.infer.health().await?;
    Ok(StatusCode::OK)
}

pub async fn info(State(state): State<AppState>) -> Json<ServerInfo> {
    Json(ServerInfo::clone(&state.info))
}
