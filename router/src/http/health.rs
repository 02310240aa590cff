//! `GET /health` and `GET /info`: unauthenticated, for probes and operators.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;

use super::state::{AppState, ServerInfo};
use crate::error::ApiError;

/// 200 when every shard rank answers `Health`; 503 (OpenAI error body) when one does not, or
/// while the router is dialling a rank whose connection failed: requests are refused then, and
/// a probe that said 200 would keep the pod in rotation while it refuses them.
pub async fn health(State(state): State<AppState>) -> Result<StatusCode, ApiError> {
    if state.shard.is_unavailable() {
        return Err(ApiError::ShardUnavailable(
            "the router is reconnecting to it".to_owned(),
        ));
    }
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
