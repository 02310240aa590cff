//! Chat messages: roles and content shapes checked, text parts joined, everything else passed
//! through to the chat template.

use serde_json::Value;

use super::template_kwargs::template_kwargs;
use super::tool_turns::check_tool_fields;
use super::{ModelAssets, ValidationError};
use crate::openai::field_schemas::ROLES;

/// `messages` checked and rendered with the model's chat template (and the request's
/// `chat_template_kwargs`): the prompt text of `/v1/chat/completions` and of `/tokenize` with
/// `messages`.
pub(crate) fn render_chat(
    assets: &ModelAssets,
    messages: Option<Vec<Value>>,
    tools: Option<&Value>,
    add_generation_prompt: bool,
    kwargs: Option<&Value>,
) -> Result<String, ValidationError> {
    let messages =
        normalize_messages(messages.ok_or_else(|| ValidationError::missing("messages"))?)?;
    let kwargs = template_kwargs(kwargs)?;
    let template = assets
        .template
        .as_ref()
        .ok_or(ValidationError::NoChatTemplate)?;
    Ok(template.render_with(&messages, tools, add_generation_prompt, kwargs)?)
}

/// Checks each message's role and content and flattens a list of text parts into one string,
/// so templates written for string content work. Other keys pass through to the template.
pub(super) fn normalize_messages(messages: Vec<Value>) -> Result<Value, ValidationError> {
    if messages.is_empty() {
        return Err(ValidationError::invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut normalized = Vec::with_capacity(messages.len());
    for (i, message) in messages.into_iter().enumerate() {
        let Value::Object(mut message) = message else {
            return Err(ValidationError::invalid(
                format!("messages[{i}]"),
                format!("messages[{i}] must be an object"),
            ));
        };
        match message.get("role") {
            Some(Value::String(role)) if ROLES.contains(&role.as_str()) => {}
            Some(Value::String(role)) => {
                return Err(ValidationError::invalid(
                    format!("messages[{i}].role"),
                    format!(
                        "messages[{i}].role `{role}` is not one of {}",
                        ROLES.join(", ")
                    ),
                ))
            }
            Some(_) => {
                return Err(ValidationError::invalid(
                    format!("messages[{i}].role"),
                    format!("messages[{i}].role must be a string"),
                ))
            }
            None => return Err(ValidationError::missing(&format!("messages[{i}].role"))),
        }
        if let Some(content) = message.get_mut("content") {
            normalize_content(i, content)?;
        }
        check_tool_fields(i, &message)?;
        normalized.push(Value::Object(message));
    }
    Ok(Value::Array(normalized))
}

/// `content`: a string, null (an assistant message with tool calls), or text parts joined
/// with "\n" (as vLLM does for string-content templates).
fn normalize_content(i: usize, content: &mut Value) -> Result<(), ValidationError> {
    let parts = match content {
        Value::String(_) | Value::Null => return Ok(()),
        Value::Array(parts) => parts,
        _ => {
            return Err(ValidationError::invalid(
                format!("messages[{i}].content"),
                format!("messages[{i}].content must be a string or a list of content parts"),
            ))
        }
    };
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("messages[{i}].content[{j}]");
        let part = part.as_object().ok_or_else(|| {
            ValidationError::invalid(&param, format!("{param} must be an object"))
        })?;
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(text))) => texts.push(text.clone()),
            (Some("text"), _) => {
                return Err(ValidationError::invalid(
                    format!("{param}.text"),
                    format!("{param}.text must be a string"),
                ))
            }
            (Some(kind), _) => {
                return Err(ValidationError::invalid(
                    format!("{param}.type"),
                    format!("content parts of type `{kind}` are not supported; only `text` is"),
                ))
            }
            (None, _) => return Err(ValidationError::missing(&format!("{param}.type"))),
        }
    }
    *content = Value::String(texts.join("\n"));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn messages_are_checked_and_text_parts_joined() {
        let normalized = normalize_messages(vec![
            json!({"role": "system", "content": "s"}),
            json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
            json!({"role": "assistant", "content": null, "tool_calls": []}),
        ])
        .unwrap();
        assert_eq!(normalized[1]["content"], "a\nb");
        assert_eq!(normalized[2]["tool_calls"], json!([]));

        let error =
            normalize_messages(vec![json!({"role": "wizard", "content": "x"})]).unwrap_err();
        assert_eq!(error.param(), Some("messages[0].role"));
        assert!(error.to_string().contains("wizard"));
        assert_eq!(
            normalize_messages(vec![]).unwrap_err().param(),
            Some("messages")
        );
        let image =
            json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]});
        assert_eq!(
            normalize_messages(vec![image]).unwrap_err().param(),
            Some("messages[0].content[0].type")
        );
        assert_eq!(
            normalize_messages(vec![json!({"content": "x"})])
                .unwrap_err()
                .param(),
            Some("messages[0].role")
        );
    }
}
