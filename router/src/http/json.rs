//! `OpenAiJson<T>`: axum's `Json` with our error as its rejection, so malformed JSON and
//! wrong field types are answered with OpenAI's error body and the offending field's name,
//! never axum's plain-text 400/415/422.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::bounded_json::{parse_bounded, BoundedJsonError, MAX_CONTAINERS};
use super::state::AppState;
use crate::error::ApiError;
use crate::validation::MAX_PROMPTS;

/// A request body made of one or more structs read from the same JSON object (see
/// `GenerationParams` for why the endpoints are split that way). The body is handed over, so
/// the struct that keeps its large parts (`prompt`, `messages`) can move them out rather than
/// copy them.
pub trait RequestBody: Sized {
    fn from_json(value: Value) -> Result<Self, ApiError>;
}

/// Reads one struct out of the body (a `Value`, or a `&Value` to leave it whole), naming the
/// field whose type is wrong (`param`).
pub fn typed<'de, T: DeserializeOwned, D>(value: D) -> Result<T, ApiError>
where
    D: serde::Deserializer<'de, Error = serde_json::Error>,
{
    serde_path_to_error::deserialize(value).map_err(|error| {
        let path = error.path().to_string();
        let param = (path != ".").then_some(path);
        let message = match &param {
            Some(param) => format!("invalid `{param}`: {}", error.inner()),
            None => format!("invalid request body: {}", error.inner()),
        };
        ApiError::BadRequestBody {
            message,
            param,
            code: "invalid_type",
        }
    })
}

pub struct OpenAiJson<T>(pub T);

/// The longest array a body may hold (`bounded_json`): four times the longest prompt, or 256Ki
/// items, whichever is more (8 MB parsed, as numbers). The fields that take lists stay far below
/// it (2,048 prompts, a prompt of at most `--max-input-tokens` ids; a JSON schema's `enum` of
/// 200,000 values still reaches the grammar compiler's own budget), so validation still names
/// the field and its limit for a list that is merely too long.
fn max_array_items(state: &AppState) -> usize {
    let longest_prompt = state.info.limits.max_input_tokens as usize;
    longest_prompt.saturating_mul(4).max(1 << 18)
}

impl<T: RequestBody> FromRequest<AppState> for OpenAiJson<T> {
    type Rejection = ApiError;

    /// Any content type is accepted: `curl -d` sends form-urlencoded by default, and the body
    /// is what matters.
    async fn from_request(request: Request, state: &AppState) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(request, state)
            .await
            .map_err(|rejection| {
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                    return ApiError::PayloadTooLarge;
                }
                ApiError::BadRequestBody {
                    message: format!("cannot read the request body: {}", rejection.body_text()),
                    param: None,
                    code: "invalid_body",
                }
            })?;
        let max_items = max_array_items(state);
        let value = parse_bounded(&bytes, max_items).map_err(|error| match error {
            BoundedJsonError::Syntax(error) => ApiError::BadRequestBody {
                message: format!("the request body is not valid JSON: {error}"),
                param: None,
                code: "invalid_json",
            },
            BoundedJsonError::TooManyContainers => ApiError::BadRequestBody {
                message: format!(
                    "the request body holds more than {MAX_CONTAINERS} arrays and objects"
                ),
                param: None,
                code: "invalid_body",
            },
            BoundedJsonError::LongArray => ApiError::BadRequestBody {
                message: format!(
                    "the request body holds an array of more than {max_items} items; no field \
                     takes that many (a prompt is at most --max-input-tokens ids, and there are \
                     at most {MAX_PROMPTS} prompts)"
                ),
                param: None,
                code: "invalid_body",
            },
        })?;
        drop(bytes);
        if !value.is_object() {
            return Err(ApiError::BadRequestBody {
                message: "the request body must be a JSON object".to_owned(),
                param: None,
                code: "invalid_json",
            });
        }
        T::from_json(value).map(OpenAiJson)
    }
}
