//! The error responses each operation documents: OpenAI's error body under the statuses that
//! `ApiError::status` gives on that route.

use std::collections::BTreeMap;

use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::{ContentBuilder, Ref, RefOr};
use utoipa::{IntoResponses, ToSchema};

use crate::openai::error::ErrorResponse;

const BAD_REQUEST: (u16, &str) = (
    400,
    "Invalid request: malformed JSON, a field of the wrong type, or a value out of range \
     (`param` names the field).",
);
const UNAUTHORIZED: (u16, &str) = (
    401,
    "Missing or unknown `Authorization: Bearer <key>` (only when the server runs with API keys).",
);
const FORBIDDEN: (u16, &str) = (
    403,
    "The API key may not load or unload adapters (not `admin` in `--api-keys-file`).",
);
const NOT_FOUND: (u16, &str) = (404, "Unknown model or adapter (`code: model_not_found`).");
const CONFLICT: (u16, &str) = (409, "The adapter name is taken by another adapter.");
const TOO_LARGE: (u16, &str) = (413, "The body is larger than `--max-request-body-bytes`.");
const OVERLOADED: (u16, &str) = (
    429,
    "Overloaded, or over a limit of the caller's key: retry after `Retry-After` seconds.",
);
const SERVER_ERROR: (u16, &str) = (500, "The shard or the tokenizer failed.");
const UNAVAILABLE: (u16, &str) = (
    503,
    "A shard is down, or the server is shutting down: retry after `Retry-After` seconds.",
);

fn error_responses(statuses: &[(u16, &str)]) -> BTreeMap<String, RefOr<Response>> {
    statuses
        .iter()
        .map(|&(status, description)| {
            let body = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(ErrorResponse::name())))
                .build();
            let response = ResponseBuilder::new()
                .description(description)
                .content("application/json", body)
                .build();
            (status.to_string(), RefOr::T(response))
        })
        .collect()
}

/// Declares a marker type whose `IntoResponses` lists the given error statuses.
macro_rules! error_set {
    ($(#[$doc:meta])* $name:ident: $($status:ident),+) => {
        $(#[$doc])*
        pub struct $name;

        impl IntoResponses for $name {
            fn responses() -> BTreeMap<String, RefOr<Response>> {
                error_responses(&[$($status),+])
            }
        }
    };
}

error_set!(
    /// Chat and completions: everything from validation to the shard.
    GenerationErrors: BAD_REQUEST, UNAUTHORIZED, NOT_FOUND, TOO_LARGE, OVERLOADED, SERVER_ERROR,
    UNAVAILABLE
);
error_set!(
    /// `/v1/models`: the key and its limits, and a bad `limit` or `after`.
    ListErrors: BAD_REQUEST, UNAUTHORIZED, OVERLOADED
);

error_set!(
    /// `/v1/models/{id}`: looking a model up never loads it.
    LookupErrors: UNAUTHORIZED, NOT_FOUND, OVERLOADED
);
error_set!(
    /// Loading and unloading adapters.
    AdapterErrors: BAD_REQUEST, UNAUTHORIZED, FORBIDDEN, NOT_FOUND, CONFLICT, TOO_LARGE,
    OVERLOADED, SERVER_ERROR, UNAVAILABLE
);
error_set!(
    /// `/tokenize`, `/detokenize`: `model` may name an adapter loaded on first use.
    TokenErrors: BAD_REQUEST, UNAUTHORIZED, NOT_FOUND, TOO_LARGE, OVERLOADED, SERVER_ERROR,
    UNAVAILABLE
);
error_set!(
    /// `/health`: the shard did not answer.
    HealthErrors: UNAVAILABLE
);
