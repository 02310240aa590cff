//! OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorObject,
}

/// `param` and `code` are always present, `null` when they do not apply (the schema requires
/// all four keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorObject {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    #[schema(required = true)]
    pub param: Option<String>,
    #[schema(required = true)]
    pub code: Option<String>,
}
