//! `POST /v1/embeddings`: its request fields (`EMBEDDINGS`, the table `docs/api.md` mirrors) and
//! the response, as OpenAI's `CreateEmbeddingRequest` and `CreateEmbeddingResponse` spell them.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use super::fields::{implemented, no_effect, refused, some_values, Field};

/// Every top-level field of `/v1/embeddings`.
pub const EMBEDDINGS: &[Field] = &[
    implemented("model"),
    implemented("input"),
    some_values(implemented("encoding_format"), refuse_unknown_format),
    refused(
        "dimensions",
        "the served model's embeddings have one width, its hidden size; shortening them is only \
         meaningful for a model trained for it (Matryoshka), which quiver cannot tell",
    ),
    no_effect(
        "user",
        "an end-user label for OpenAI's abuse monitoring; quiver keeps no per-user records",
    ),
    // vLLM's extensions.
    implemented("add_special_tokens"),
    implemented("adapter_source"),
];

fn refuse_unknown_format(value: &Value) -> Option<&'static str> {
    (!matches!(value.as_str(), Some("float" | "base64")))
        .then_some("`encoding_format` must be `float` or `base64`")
}

/// The request; its fields were checked against `EMBEDDINGS` first, so a refused one never
/// gets here and `input` keeps its four shapes for validation to tell apart.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct EmbeddingsRequest {
    /// Selects the base model or an adapter, as on the generation endpoints.
    pub model: Option<String>,
    /// A string, a list of strings, a list of token ids, or a list of token-id lists.
    #[schema(value_type = super::field_schemas::Prompt, required = true)]
    pub input: Option<Value>,
    /// `float` (the default) or `base64`: the little-endian float32 bytes, base64-encoded.
    #[schema(value_type = Option<String>)]
    pub encoding_format: Option<String>,
    /// Refused: see `EMBEDDINGS`.
    #[schema(value_type = Option<u32>)]
    pub dimensions: Option<Value>,
    pub user: Option<String>,
    /// Text inputs only: tokenize with the tokenizer's special tokens (BOS, and EOS where the
    /// tokenizer appends one); default true, as vLLM.
    pub add_special_tokens: Option<bool>,
    /// Extension: where an adapter id in `model` is looked up, `hub`, `local` or `s3`.
    pub adapter_source: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingsResponse {
    /// Always `list`.
    #[schema(value_type = String)]
    pub object: &'static str,
    /// One per input, in input order.
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingsUsage,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Embedding {
    /// Always `embedding`.
    #[schema(value_type = String)]
    pub object: &'static str,
    pub index: u32,
    pub embedding: EmbeddingVector,
}

/// The vector as numbers, or as base64 of its little-endian float32 bytes.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Clone, Copy, Serialize, ToSchema)]
pub struct EmbeddingsUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
}
