//! `GET /v1/models` and `GET /v1/models/{id}`.

use serde::Serialize;
use utoipa::ToSchema;

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    #[schema(value_type = String, pattern = "^list$")]
    pub object: &'static str,
    pub data: Vec<ModelCard>,
    /// Paged answers only (`limit` or `after` given): the first and last card's ids, and
    /// whether more cards follow `last_id`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub has_more: Option<bool>,
}

impl ModelList {
    pub fn new(data: Vec<ModelCard>) -> Self {
        Self {
            object: "list",
            data,
            first_id: None,
            last_id: None,
            has_more: None,
        }
    }

    /// One page of a longer list.
    pub fn page(data: Vec<ModelCard>, has_more: bool) -> Self {
        Self {
            first_id: data.first().map(|card| card.id.clone()),
            last_id: data.last().map(|card| card.id.clone()),
            has_more: Some(has_more),
            ..Self::new(data)
        }
    }
}

/// One servable model. Adapters are listed as further cards whose `parent` is the base model's
/// served name (vLLM's convention); the base model has none.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    #[schema(value_type = String, pattern = "^model$")]
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    /// What the card serves: the base model's id (hub id or directory), or what an adapter was
    /// loaded from (hub id, or its directory).
    pub root: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

impl ModelCard {
    pub fn base(id: String, root: String, created: u64) -> Self {
        Self {
            id,
            object: "model",
            created,
            owned_by: "quiver",
            root,
            parent: None,
        }
    }

    pub fn adapter(id: String, root: String, parent: String, created: u64) -> Self {
        Self {
            id,
            object: "model",
            created,
            owned_by: "quiver",
            root,
            parent: Some(parent),
        }
    }
}
