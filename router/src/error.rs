//! The router's one error type at the HTTP boundary, and the one place errors become an HTTP
//! status and OpenAI's `{"error": {message, type, param, code}}` body (also used for the final
//! `data: {"error": ...}` event of a stream that fails after it started).

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use quiver_flags::UnknownAdapterSource;

use crate::adapters::AdapterError;
use crate::bounded_text::bounded;
use crate::metrics::http::ErrorCode;
use crate::openai::error::{ErrorObject, ErrorResponse};
use crate::scheduler::{AdmissionError, GenerationError};
use crate::tenants::LimitExceeded;
use crate::tokenizer::TokenizerError;
use crate::validation::ValidationError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON, or a field has the wrong JSON type.
    #[error("{message}")]
    BadRequestBody {
        message: String,
        param: Option<String>,
        code: &'static str,
    },
    #[error(transparent)]
    Validation(#[from] ValidationError),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// An adapter that cannot serve: bad id, not found, refused by the shard... `param` is
    /// the request field it came from (`model`, or the load endpoint's `lora_path`).
    #[error("{error}")]
    Adapter {
        error: AdapterError,
        param: &'static str,
    },
    #[error("Incorrect API key provided. Send it as `Authorization: Bearer <key>`.")]
    Unauthorized,
    /// A known key asked for something its grant does not include.
    #[error("{0}")]
    PermissionDenied(String),
    /// A limit of the caller's own key (`--api-keys-file`), not the server's.
    #[error(
        "Rate limit reached for API key `{key}` on {}; retry after {} s.",
        refused.limit.name(),
        refused.retry_after_secs
    )]
    KeyLimit { key: String, refused: LimitExceeded },
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error(transparent)]
    Generation(#[from] GenerationError),
    #[error("the model shard is not available: {0}")]
    ShardUnavailable(String),
    /// The body is larger than `--max-request-body-bytes`.
    #[error("the request body is larger than this server accepts")]
    PayloadTooLarge,
    /// The body did not arrive within `--body-read-timeout-secs` (or at `--body-read-min-rate`);
    /// the message says which limits apply.
    #[error("{0}")]
    BodyTimeout(String),
    /// The server stopped before the request finished: its grace period ran out.
    #[error("the server shut down before this request finished (its grace period ran out)")]
    GracePeriodOver,
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{0}")]
    Internal(String),
    /// An error of a request read as another endpoint's (the Responses API as chat), its
    /// `param` named as the client's own request names it.
    #[error("{error}")]
    Respelled {
        error: Box<ApiError>,
        param: Option<String>,
    },
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Respelled { error, .. } => error.status(),
            Self::BadRequestBody { .. } => StatusCode::BAD_REQUEST,
            Self::Validation(error) if error.is_client_error() => StatusCode::BAD_REQUEST,
            Self::Validation(_) => StatusCode::INTERNAL_SERVER_ERROR,
            Self::ModelNotFound(_) | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Adapter { error, .. } if error.is_not_found() => StatusCode::NOT_FOUND,
            Self::Adapter { error, .. } if error.is_conflict() => StatusCode::CONFLICT,
            Self::Adapter { error, .. } if error.is_client_error() => StatusCode::BAD_REQUEST,
            Self::Adapter { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::PermissionDenied(_) => StatusCode::FORBIDDEN,
            Self::KeyLimit { .. } => StatusCode::TOO_MANY_REQUESTS,
            Self::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::GracePeriodOver => StatusCode::SERVICE_UNAVAILABLE,
            Self::Admission(AdmissionError::Overloaded) => StatusCode::TOO_MANY_REQUESTS,
            // It can never fit, however long the client waits.
            Self::Admission(AdmissionError::TooLarge { .. }) => StatusCode::BAD_REQUEST,
            Self::Admission(AdmissionError::AdaptersDisabled { .. }) => StatusCode::BAD_REQUEST,
            Self::Admission(AdmissionError::ShuttingDown)
            | Self::Generation(GenerationError::ShuttingDown)
            // Busy for longer than the operator lets a request wait: retry later.
            | Self::Generation(GenerationError::QueueTimeout { .. })
            | Self::ShardUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Generation(GenerationError::Shard(_))
            | Self::Tokenizer(_)
            | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type`, and a stable `code` (also usable as a metric label).
    fn kind_and_code(&self) -> (&'static str, &'static str) {
        match self {
            Self::Respelled { error, .. } => error.kind_and_code(),
            Self::BadRequestBody { code, .. } => ("invalid_request_error", code),
            Self::Validation(error) if error.is_client_error() => {
                ("invalid_request_error", error.code())
            }
            Self::Validation(error) => ("server_error", error.code()),
            Self::ModelNotFound(_) => ("invalid_request_error", "model_not_found"),
            Self::Adapter { error, .. } if error.is_client_error() => {
                ("invalid_request_error", error.code())
            }
            Self::Adapter { error, .. } => ("server_error", error.code()),
            Self::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            Self::PermissionDenied(_) => ("invalid_request_error", "permission_denied"),
            Self::KeyLimit { .. } => ("rate_limit_error", "rate_limit_exceeded"),
            Self::NotFound(_) => ("invalid_request_error", "not_found"),
            Self::MethodNotAllowed(_) => ("invalid_request_error", "method_not_allowed"),
            Self::Admission(AdmissionError::Overloaded) => {
                ("rate_limit_error", "rate_limit_exceeded")
            }
            Self::Admission(AdmissionError::TooLarge { .. }) => {
                ("invalid_request_error", "context_length_exceeded")
            }
            Self::Admission(AdmissionError::AdaptersDisabled { .. }) => {
                ("invalid_request_error", "adapters_disabled")
            }
            Self::Admission(AdmissionError::ShuttingDown)
            | Self::Generation(GenerationError::ShuttingDown) => {
                ("server_error", "service_unavailable")
            }
            Self::Generation(GenerationError::QueueTimeout { .. }) => {
                ("server_error", "queue_timeout")
            }
            Self::ShardUnavailable(_) => ("server_error", "shard_unavailable"),
            Self::PayloadTooLarge => ("invalid_request_error", "request_too_large"),
            Self::BodyTimeout(_) => ("invalid_request_error", "request_timeout"),
            Self::GracePeriodOver => ("server_error", "shutdown_grace_expired"),
            Self::Generation(GenerationError::Shard(_)) => ("server_error", "shard_error"),
            Self::Tokenizer(_) => ("server_error", "tokenizer_error"),
            Self::Internal(_) => ("server_error", "internal_error"),
        }
    }

    /// The request field the error names, if any (`param`).
    pub fn param(&self) -> Option<String> {
        match self {
            Self::Respelled { param, .. } => param.clone(),
            Self::BadRequestBody { param, .. } => param.clone(),
            Self::Validation(error) => error.param().map(str::to_owned),
            Self::ModelNotFound(_) => Some("model".to_owned()),
            Self::Adapter { param, .. } => Some((*param).to_owned()),
            Self::Admission(AdmissionError::TooLarge { .. }) => Some("max_tokens".to_owned()),
            Self::Admission(AdmissionError::AdaptersDisabled { .. }) => Some("model".to_owned()),
            _ => None,
        }
    }

    /// The client's message, bounded: it may quote unbounded input (`bounded_text`).
    pub fn message(&self) -> String {
        bounded(&self.to_string()).into_owned()
    }

    pub fn to_body(&self) -> ErrorResponse {
        let (kind, code) = self.kind_and_code();
        ErrorResponse {
            error: ErrorObject {
                message: self.message(),
                kind: kind.to_owned(),
                param: self.param(),
                code: Some(code.to_owned()),
            },
        }
    }
}

impl ApiError {
    /// A shard process is gone: every request is refused until the launcher restarts the stack.
    pub fn shard_gone() -> Self {
        Self::ShardUnavailable("a model shard stopped responding".to_owned())
    }

    /// An adapter error about the request field `param`.
    pub fn adapter(error: impl Into<AdapterError>, param: &'static str) -> Self {
        let error = error.into();
        let param = match error {
            AdapterError::InvalidSource(_) => "adapter_source",
            _ => param,
        };
        Self::Adapter { error, param }
    }
}

/// Adapter errors of a generation request are about its `model`.
impl From<AdapterError> for ApiError {
    fn from(error: AdapterError) -> Self {
        Self::adapter(error, "model")
    }
}

/// A request's `adapter_source` that is neither `hub` nor `local`.
impl From<UnknownAdapterSource> for ApiError {
    fn from(error: UnknownAdapterSource) -> Self {
        Self::adapter(error, "adapter_source")
    }
}

/// Seconds a client is asked to wait before retrying a 429 (requests finish and free their
/// slot within seconds) or a 503 (a shard or the whole server is going away: by then another
/// replica, or this one restarted, can take it).
fn retry_after(status: StatusCode) -> Option<HeaderValue> {
    match status {
        StatusCode::TOO_MANY_REQUESTS => Some(HeaderValue::from_static("1")),
        StatusCode::SERVICE_UNAVAILABLE => Some(HeaderValue::from_static("5")),
        _ => None,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(error = ?self.message(), "request failed");
        } else {
            tracing::debug!(error = ?self.message(), status = status.as_u16(), "request refused");
        }
        let (_, code) = self.kind_and_code();
        let mut response = (status, Json(self.to_body())).into_response();
        response.extensions_mut().insert(ErrorCode(code));
        let own_retry = match &self {
            Self::KeyLimit { refused, .. } => Some(HeaderValue::from(refused.retry_after_secs)),
            Self::Respelled { error, .. } => match error.as_ref() {
                Self::KeyLimit { refused, .. } => Some(HeaderValue::from(refused.retry_after_secs)),
                _ => None,
            },
            _ => None,
        };
        if let Some(seconds) = own_retry.or_else(|| retry_after(status)) {
            response.headers_mut().insert(RETRY_AFTER, seconds);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_429_and_503_says_when_to_retry() {
        for error in [
            ApiError::Admission(AdmissionError::Overloaded),
            ApiError::Admission(AdmissionError::ShuttingDown),
            ApiError::ShardUnavailable("gone".to_owned()),
            ApiError::GracePeriodOver,
        ] {
            let response = error.into_response();
            assert!(
                response.headers().contains_key(RETRY_AFTER),
                "{} without Retry-After",
                response.status()
            );
        }
        let response = ApiError::NotFound("x".to_owned()).into_response();
        assert!(!response.headers().contains_key(RETRY_AFTER));
    }

    #[test]
    fn no_error_body_echoes_unbounded_input() {
        let role = "r".repeat(800_000);
        let error = ApiError::BadRequestBody {
            message: format!("unknown role `{role}` in messages[0]"),
            param: Some("messages[0].role".to_owned()),
            code: "invalid_value",
        };
        let body = error.to_body();
        assert!(body.error.message.len() <= crate::bounded_text::MAX_MESSAGE_BYTES);
        assert!(body.error.message.starts_with("unknown role `rrr"));
        assert!(body.error.message.ends_with("` in messages[0]"));
        // Wrapped errors are bounded as a whole too.
        let respelled = ApiError::Respelled {
            error: Box::new(error),
            param: Some("input[0].role".to_owned()),
        };
        assert!(respelled.to_body().error.message.len() <= crate::bounded_text::MAX_MESSAGE_BYTES);
    }
}
