//! `OpenAiJson<T>`: axum's `Json` with our error as its rejection, so malformed JSON and
//! wrong field types are answered with OpenAI's error body and the offending field's name,
//! never axum's plain-text 400/415/422.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// A request body made of one or more structs read from the same JSON object (see
/// `GenerationParams` for why the endpoints are split that way).
pub trait RequestBody: Sized {
    fn from_json(value: &Value) -> Result<Self, ApiError>;
}

/// Reads one struct out of the body, naming the field whose type is wrong (`param`).
pub fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
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

impl<S: Send + Sync, T: RequestBody> FromRequest<S> for OpenAiJson<T> {
    type Rejection = ApiError;

    /// Any content type is accepted: `curl -d` sends form-urlencoded by default, and the body
    /// is what matters.
    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
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
        let value: Value =
            serde_json::from_slice(&bytes).map_err(|error| ApiError::BadRequestBody {
                message: format!("the request body is not valid JSON: {error}"),
                param: None,
                code: "invalid_json",
            })?;
        if !value.is_object() {
            return Err(ApiError::BadRequestBody {
                message: "the request body must be a JSON object".to_owned(),
                param: None,
                code: "invalid_json",
            });
        }
        T::from_json(&value).map(OpenAiJson)
    }
}
