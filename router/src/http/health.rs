//! `GET /health` and `GET /info`: unauthenticated, for probes and operators.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

use super::state::{AppState, ServerInfo};
use crate::error::ApiError;

/// 200 when the shard answers `Health`; 503 (OpenAI error body) when it does not.
pub async fn health(State(state): State<AppState>) -> Result<StatusCode, ApiError> {
    match state.shard.health().await {
        Ok(_) => Ok(StatusCode::OK),
        Err(error) => {
            // The detail can name the shard's socket path: it goes to the log, not the client.
            tracing::warn!(%error, "shard health check failed");
            Err(ApiError::ShardUnavailable(
                "it did not answer its health check".to_owned(),
            ))
        }
    }
}

pub async fn info(State(state): State<AppState>) -> Json<ServerInfo> {
    Json(ServerInfo::clone(&state.info))
}
