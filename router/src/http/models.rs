//! `GET /v1/models` and `GET /v1/models/{id}`.

use axum::extract::{Path, State};
use axum::Json;

use super::state::AppState;
use crate::error::ApiError;
use crate::openai::models::{ModelCard, ModelList};

pub async fn list_models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList::new(state.models.cards()))
}

/// Looks the id up among the listed cards, so a model is retrievable exactly when it is listed.
/// The route captures the rest of the path: hub ids contain a slash.
pub async fn retrieve_model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    state
        .models
        .cards()
        .into_iter()
        .find(|card| card.id == id)
        .map(Json)
        .ok_or(ApiError::ModelNotFound(id))
}
