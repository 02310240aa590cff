//! `GET /v1/models` and `GET /v1/models/{id}`: the base model first, then every loaded
//! adapter (its `parent` is the base model's served name, its `root` what it was loaded from),
//! of those the caller's API key may use.

use axum::extract::rejection::PathRejection;
use axum::extract::{Path, State};
use axum::http::Uri;
use axum::{Extension, Json};

use super::state::AppState;
use crate::adapters::AdapterEntry;
use crate::error::ApiError;
use crate::openai::models::{ModelCard, ModelList};
use crate::tenants::Caller;

/// Only what the caller's key may use is listed.
pub async fn list_models(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
) -> Json<ModelList> {
    let base = caller
        .may_use_base_model()
        .then(|| state.models.base_card());
    let adapters = state.adapters.list();
    let adapters = adapters
        .iter()
        .filter(|entry| caller.may_use_adapter(&entry.id))
        .map(|entry| adapter_card(&state, entry));
    Json(ModelList::new(base.into_iter().chain(adapters).collect()))
}

/// A model is retrievable exactly when it is listed: looking an id up never loads an adapter.
/// The route captures the rest of the path: hub ids contain a slash. An id that does not
/// decode to UTF-8 (`%ff`) names no model either.
pub async fn retrieve_model(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<String>, PathRejection>,
    uri: Uri,
) -> Result<Json<ModelCard>, ApiError> {
    let Ok(Path(id)) = id else {
        let raw = uri.path().strip_prefix("/v1/models/").unwrap_or(uri.path());
        return Err(ApiError::ModelNotFound(raw.to_owned()));
    };
    let base = state.models.base_card();
    if base.id == id {
        if !caller.may_use_base_model() {
            return Err(ApiError::ModelNotFound(id));
        }
        return Ok(Json(base));
    }
    if !caller.may_use_adapter(&id) {
        return Err(ApiError::ModelNotFound(id));
    }
    state
        .adapters
        .get(&id)
        .map(|entry| Json(adapter_card(&state, &entry)))
        .ok_or(ApiError::ModelNotFound(id))
}

fn adapter_card(state: &AppState, entry: &AdapterEntry) -> ModelCard {
    ModelCard::adapter(
        entry.id.clone(),
        entry.root(),
        state.models.served_name.clone(),
        entry.created,
    )
}
