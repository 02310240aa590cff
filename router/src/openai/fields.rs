//! What quiver does with every top-level request field of `/v1/chat/completions` and
//! `/v1/completions`: the one table that the request check below, the docs (`docs/api.md`, whose
//! tables a test holds against this one) and OpenAI's field lists (`testdata/openai/`) agree on.
//!
//! Nothing is silently ignored: a field is implemented, accepted without effect for a stated
//! reason, or refused with a 400 naming it. A field the table does not know is accepted without
//! effect, as DESIGN.md rules (real clients send extras), but not silently: the response names
//! it in the `quiver-ignored-fields` header and the router logs it, so a misspelt `max_token`
//! shows. `null` means absent everywhere, as clients send explicit nulls for unset options.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// How a field is documented; `docs/api.md` spells it in its status column.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Implemented,
    /// Accepted and valid, but it changes nothing here (the note says why).
    NoEffect,
    /// Refused with 400 (the note says why), except values `Field::refuses` lets through.
    Refused,
}

impl Status {
    /// The status column of `docs/api.md`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Implemented => "implemented",
            Self::NoEffect => "accepted without effect",
            Self::Refused => "refused",
        }
    }
}

/// One request field.
#[derive(Debug, Clone, Copy)]
pub struct Field {
    pub name: &'static str,
    pub status: Status,
    /// Why it has no effect or is refused; the refusal message quotes it.
    pub reason: &'static str,
    /// For a field accepted with some values only: the message refusing `value`, if it is one of
    /// the others. Without it, a `Refused` field refuses every value and the others none.
    pub refuses: Option<fn(&Value) -> Option<&'static str>>,
}

pub(crate) const fn field(name: &'static str, status: Status, reason: &'static str) -> Field {
    Field {
        name,
        status,
        reason,
        refuses: None,
    }
}

pub(crate) const fn implemented(name: &'static str) -> Field {
    field(name, Status::Implemented, "")
}

pub(crate) const fn no_effect(name: &'static str, reason: &'static str) -> Field {
    field(name, Status::NoEffect, reason)
}

pub(crate) const fn refused(name: &'static str, reason: &'static str) -> Field {
    field(name, Status::Refused, reason)
}

pub(crate) const fn some_values(
    field: Field,
    refuses: fn(&Value) -> Option<&'static str>,
) -> Field {
    Field {
        refuses: Some(refuses),
        ..field
    }
}

/// The fields both endpoints take, OpenAI's and the documented extensions.
pub const SHARED: &[Field] = &[
    implemented("model"),
    implemented("max_tokens"),
    implemented("max_completion_tokens"),
    implemented("temperature"),
    implemented("top_p"),
    implemented("n"),
    implemented("seed"),
    implemented("stop"),
    implemented("stream"),
    implemented("stream_options"),
    implemented("presence_penalty"),
    implemented("frequency_penalty"),
    implemented("logit_bias"),
    no_effect(
        "user",
        "an end-user label for OpenAI's abuse monitoring; quiver keeps no per-user records",
    ),
    // Extensions (vLLM's names and meanings).
    implemented("top_k"),
    implemented("min_p"),
    implemented("repetition_penalty"),
    implemented("ignore_eos"),
    implemented("min_tokens"),
    implemented("stop_token_ids"),
    implemented("return_token_ids"),
    implemented("prompt_logprobs"),
    implemented("adapter_source"),
    implemented("cache_salt"),
    // Structured output: OpenAI's field, vLLM's extension and its older aliases.
    implemented("response_format"),
    implemented("structured_outputs"),
    implemented("guided_json"),
    implemented("guided_regex"),
    implemented("guided_choice"),
    implemented("guided_grammar"),
    // Other servers' extensions a client relies on when it sends them: refused by name rather
    // than ignored as unknown, since ignoring them changes the answer the client expects.
    refused(
        "grammar",
        "TGI's grammar field is not supported; use `response_format` or `structured_outputs`",
    ),
    refused(
        "use_beam_search",
        "beam search is not supported; use `n` or `best_of`",
    ),
    refused(
        "include_stop_str_in_output",
        "stop strings are never part of the output",
    ),
];

/// `/v1/chat/completions`' own fields.
pub const CHAT: &[Field] = &[
    implemented("messages"),
    implemented("tools"),
    implemented("tool_choice"),
    implemented("parallel_tool_calls"),
    implemented("logprobs"),
    implemented("top_logprobs"),
    some_values(
        no_effect("modalities", "`[\"text\"]` is what is always returned"),
        refuse_non_text_modalities,
    ),
    implemented("functions"),
    implemented("function_call"),
    // vLLM's extension: variables for the chat template (docs/reasoning.md).
    implemented("chat_template_kwargs"),
    refused(
        "audio",
        "quiver serves text models: there is no audio output",
    ),
    refused("prediction", "predicted outputs are not supported"),
    refused("web_search_options", "quiver does not search the web"),
    refused(
        "moderation",
        "quiver runs no moderation; accepting it would suggest it did",
    ),
    refused(
        "reasoning_effort",
        "a control of OpenAI's reasoning models, which the served model does not have \
         (OpenAI refuses it for such models too)",
    ),
    refused(
        "verbosity",
        "a control of OpenAI's GPT-5 models, which the served model does not have \
         (OpenAI refuses it for other models too)",
    ),
    no_effect(
        "metadata",
        "tags for OpenAI's stored completions; quiver stores nothing",
    ),
    no_effect("store", "quiver stores no completions"),
    no_effect("service_tier", "one tier: every request is served alike"),
    no_effect(
        "safety_identifier",
        "an end-user label for OpenAI's abuse monitoring; quiver keeps no per-user records",
    ),
    no_effect(
        "prompt_cache_key",
        "a routing hint for OpenAI's prompt cache; quiver has no prompt cache yet",
    ),
    no_effect(
        "prompt_cache_retention",
        "OpenAI's prompt-cache lifetime; quiver has no prompt cache yet",
    ),
    no_effect(
        "prompt_cache_options",
        "OpenAI's prompt-cache settings; quiver has no prompt cache yet",
    ),
];

/// `/v1/completions`' own fields.
pub const COMPLETIONS: &[Field] = &[
    implemented("prompt"),
    implemented("echo"),
    implemented("logprobs"),
    implemented("best_of"),
    some_values(
        refused("suffix", "insertion after a suffix is not supported"),
        refuse_non_empty_suffix,
    ),
];

/// The endpoint fields a body is read into know which table they answer to.
pub trait EndpointFields {
    /// The endpoint's own fields; `SHARED` applies too.
    const FIELDS: &'static [Field];
}

impl EndpointFields for super::chat::ChatFields {
    const FIELDS: &'static [Field] = CHAT;
}

impl EndpointFields for super::completions::CompletionFields {
    const FIELDS: &'static [Field] = COMPLETIONS;
}

/// The response header naming the fields a request sent that the endpoint does not know.
pub const IGNORED_FIELDS_HEADER: &str = "quiver-ignored-fields";

/// Refuses a body with a refused field, or a value of a field taken only with some values.
/// Returns the fields the endpoint does not know (accepted without effect), in body order.
/// Runs on the raw JSON object, before typed parsing.
pub fn check_fields(own: &[Field], body: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    check_fields_of(&[own, SHARED], body)
}

/// `check_fields` against the fields of `tables` alone (an endpoint that takes none of `SHARED`).
pub fn check_fields_of(
    tables: &[&[Field]],
    body: &Map<String, Value>,
) -> Result<Vec<String>, ApiError> {
    let mut unknown = Vec::new();
    for (name, value) in body {
        if value.is_null() {
            continue;
        }
        let known = tables.iter().flat_map(|table| table.iter());
        let Some(field) = known.into_iter().find(|field| field.name == name) else {
            unknown.push(name.clone());
            continue;
        };
        let refusal = match field.refuses {
            Some(refuses) => refuses(value),
            None => (field.status == Status::Refused).then_some(field.reason),
        };
        if let Some(why) = refusal {
            let code = match field.refuses {
                Some(_) => "unsupported_value",
                None => "unsupported_parameter",
            };
            return Err(unsupported(
                name,
                code,
                format!("`{name}` is not supported here: {why}"),
            ));
        }
    }
    Ok(unknown)
}

fn unsupported(name: &str, code: &'static str, message: String) -> ApiError {
    ApiError::BadRequestBody {
        message,
        param: Some(name.to_owned()),
        code,
    }
}

fn refuse_non_text_modalities(value: &Value) -> Option<&'static str> {
    let text_only = value
        .as_array()
        .is_some_and(|modalities| modalities.iter().all(|m| m.as_str() == Some("text")));
    (!text_only).then_some("only [\"text\"] is accepted: quiver serves text models")
}

/// `""` means no suffix, which some clients send by default.
fn refuse_non_empty_suffix(value: &Value) -> Option<&'static str> {
    (value.as_str() != Some("")).then_some("insertion after a suffix is not supported")
}

#[cfg(test)]
#[path = "fields_tests.rs"]
mod tests;
