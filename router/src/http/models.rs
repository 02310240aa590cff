//! `GET /v1/models` and `GET /v1/models/{id}`: the base model first, then every loaded
//! adapter in load order (its `parent` is the base model's served name, its `root` what it was
//! loaded from), of those the caller's API key may use.
//!
//! With thousands of adapters the list can be read in pages, with the cursor parameters of
//! OpenAI's other list endpoints: `limit` (1 to 1000) cards after the card `after` names, and
//! `has_more`, `first_id` and `last_id` in the answer. Without them, the whole list, as before.

use std::collections::HashMap;

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::Uri;
use axum::{Extension, Json};

use super::state::AppState;
use crate::error::ApiError;
use crate::openai::models::{ModelCard, ModelList};
use crate::tenants::Caller;
use crate::validation::ValidationError;

/// The most cards one page holds.
pub const MAX_PAGE: usize = 1000;

/// `GET /v1/models`'s paging parameters.
#[derive(Debug, Default)]
struct Paging {
    limit: Option<usize>,
    after: Option<String>,
}

impl Paging {
    /// Reads the query; any other parameter is refused, naming it.
    fn parse(query: HashMap<String, String>) -> Result<Self, ValidationError> {
        let mut paging = Self::default();
        for (name, value) in query {
            match name.as_str() {
                "limit" => {
                    let limit = value.parse().ok().filter(|l| (1..=MAX_PAGE).contains(l));
                    paging.limit = Some(limit.ok_or_else(|| {
                        ValidationError::invalid(
                            "limit",
                            format!(
                                "`limit` must be an integer from 1 to {MAX_PAGE}, got `{value}`"
                            ),
                        )
                    })?);
                }
                "after" => paging.after = Some(value),
                _ => {
                    return Err(ValidationError::invalid(
                        name.clone(),
                        format!("/v1/models takes `limit` and `after` only, not `{name}`"),
                    ))
                }
            }
        }
        Ok(paging)
    }
}

/// Only what the caller's key may use is listed.
pub async fn list_models(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<Json<ModelList>, ApiError> {
    let Query(query) = query.map_err(|rejection| {
        ValidationError::invalid(
            "query",
            format!("the query string does not parse: {rejection}"),
        )
    })?;
    let paging = Paging::parse(query)?;
    let cards = state.infer.models().cards(&caller).into_iter();
    if paging.limit.is_none() && paging.after.is_none() {
        return Ok(Json(ModelList::new(cards.collect())));
    }
    let limit = paging.limit.unwrap_or(MAX_PAGE);
    let mut cards = cards.peekable();
    if let Some(after) = &paging.after {
        // Cards come in a fixed order (base, then load order): skip to the cursor's.
        if !cards.any(|card| &card.id == after) {
            return Err(ValidationError::invalid(
                "after",
                format!(
                    "`after` names no listed model: `{after}` (unloaded since, or never listed)"
                ),
            )
            .into());
        }
    }
    let page: Vec<ModelCard> = cards.by_ref().take(limit).collect();
    let has_more = cards.peek().is_some();
    Ok(Json(ModelList::page(page, has_more)))
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
    state
        .infer
        .models()
        .card(&caller, &id)
        .map(Json)
        .ok_or(ApiError::ModelNotFound(id))
}
