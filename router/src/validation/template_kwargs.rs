//! `chat_template_kwargs` (vLLM's extension): extra variables for the chat template, as
//! transformers' `apply_chat_template(..., **kwargs)` passes them, e.g. `{"enable_thinking":
//! false}` for Qwen3. A name the template does not read changes nothing, as under transformers.
//!
//! Names the request itself sets are refused rather than let through: under transformers they
//! are `apply_chat_template`'s own arguments (a second value is a TypeError there), and
//! overriding them here would silently replace the request's `messages` or `tools`, or ask for
//! a rendering this server does not do (`continue_final_message`, another `chat_template`).

use serde_json::{Map, Value};

use super::ValidationError;

pub const PARAM: &str = "chat_template_kwargs";

/// Variables the request sets, and `apply_chat_template` arguments that are not variables.
const RESERVED: [&str; 7] = [
    "messages",
    "tools",
    "documents",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "tokenize",
];

/// The kwargs as template variables; a 400 naming the field for anything but an object, or
/// for a reserved name.
pub(super) fn template_kwargs(
    value: Option<&Value>,
) -> Result<Option<&Map<String, Value>>, ValidationError> {
    let Some(value) = value.filter(|value| !value.is_null()) else {
        return Ok(None);
    };
    let kwargs = value.as_object().ok_or_else(|| {
        ValidationError::invalid(
            PARAM,
            "`chat_template_kwargs` must be an object of template variables",
        )
    })?;
    if let Some(name) = kwargs.keys().find(|name| RESERVED.contains(&name.as_str())) {
        let why = match name.as_str() {
            "messages" | "tools" | "documents" | "add_generation_prompt" => {
                "the request sets it (use the request's own field)"
            }
            _ => {
                "it is an option of transformers' apply_chat_template that quiver does not support"
            }
        };
        return Err(ValidationError::invalid(
            format!("{PARAM}.{name}"),
            format!("`{PARAM}` cannot set `{name}`: {why}"),
        ));
    }
    Ok(Some(kwargs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn objects_pass_reserved_names_and_other_shapes_are_refused() {
        let kwargs = json!({"enable_thinking": false, "bos_token": "<b>"});
        assert_eq!(template_kwargs(Some(&kwargs)).unwrap().unwrap().len(), 2);
        assert_eq!(template_kwargs(None).unwrap(), None);
        assert_eq!(template_kwargs(Some(&Value::Null)).unwrap(), None);
        let error = template_kwargs(Some(&json!([1]))).unwrap_err();
        assert_eq!(error.param(), Some(PARAM));
        for name in RESERVED {
            let error = template_kwargs(Some(&json!({ name: 1 }))).unwrap_err();
            assert_eq!(error.param(), Some(format!("{PARAM}.{name}").as_str()));
            assert!(error.to_string().contains(name), "{error}");
        }
    }
}
