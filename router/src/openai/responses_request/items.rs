//! A Responses request's `input` items, in order, as chat messages (the mapping the parent
//! module's header lists). One pass, linear in the items: a `function_call_output` finds its
//! call through an index by `call_id`, never by searching the messages so far (a body of tens
//! of thousands of outputs made that search quadratic).

use std::collections::HashMap;

use serde_json::{json, Value};

use super::{invalid, unsupported};
use crate::bounded_text::bounded_to;
use crate::error::ApiError;

/// Longest `call_id` an error message quotes, in bytes: ids are client text of any length.
const QUOTED_CALL_ID_BYTES: usize = 64;

/// Messages being built from input items.
#[derive(Default)]
pub(super) struct ItemMessages {
    messages: Vec<Value>,
    /// The function each `call_id` seen so far called (the latest call of an id wins).
    called: HashMap<String, String>,
}

impl ItemMessages {
    pub(super) fn push(&mut self, message: Value) {
        self.messages.push(message);
    }

    pub(super) fn into_messages(self) -> Vec<Value> {
        self.messages
    }

    /// Appends the message(s) of input item `index`.
    pub(super) fn add_item(&mut self, item: &Value, index: usize) -> Result<(), ApiError> {
        let param = format!("input[{index}]");
        let Some(object) = item.as_object() else {
            return Err(invalid(&param, "an input item must be an object"));
        };
        match object.get("type").and_then(Value::as_str) {
            None | Some("message") => {
                let role = object
                    .get("role")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                if !matches!(role, "user" | "assistant" | "system" | "developer") {
                    return Err(invalid(
                        &param,
                        "a message's `role` must be `user`, `assistant`, `system` or `developer`",
                    ));
                }
                let content = message_text(object.get("content"), &param)?;
                self.messages
                    .push(json!({"role": role, "content": content}));
            }
            Some("function_call") => self.add_call(object, &param)?,
            Some("function_call_output") => self.add_output(object, &param)?,
            Some("reasoning") => {}
            Some(other) => {
                return Err(unsupported(
                    &param,
                    format!(
                        "input items of type `{other}` are not supported: quiver takes messages, \
                         `function_call`, `function_call_output` and `reasoning` items"
                    ),
                ))
            }
        }
        Ok(())
    }

    /// A `function_call` joins the assistant turn just before it, or opens one.
    fn add_call(
        &mut self,
        object: &serde_json::Map<String, Value>,
        param: &str,
    ) -> Result<(), ApiError> {
        let text = |key: &str| {
            object
                .get(key)
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(param, &format!("a `function_call` item needs `{key}`")))
        };
        let (call_id, name) = (text("call_id")?, text("name")?);
        let call = json!({
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": text("arguments")?},
        });
        self.called.insert(call_id.to_owned(), name.to_owned());
        match self.messages.last_mut() {
            Some(last) if last["role"] == "assistant" => {
                let calls = last
                    .as_object_mut()
                    .map(|message| message.entry("tool_calls").or_insert_with(|| json!([])));
                if let Some(Value::Array(calls)) = calls {
                    calls.push(call);
                }
            }
            _ => self
                .messages
                .push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
        }
        Ok(())
    }

    /// A `function_call_output` answers a call made earlier in the input, as OpenAI requires; it
    /// is named after the function that call called, for templates that print the name (Hermes
    /// 2 Pro's).
    fn add_output(
        &mut self,
        object: &serde_json::Map<String, Value>,
        param: &str,
    ) -> Result<(), ApiError> {
        let call_id = object
            .get("call_id")
            .and_then(Value::as_str)
            .ok_or_else(|| invalid(param, "a `function_call_output` item needs `call_id`"))?;
        let output = match object.get("output") {
            Some(Value::String(text)) => text.clone(),
            Some(parts @ Value::Array(_)) => message_text(Some(parts), param)?,
            _ => {
                return Err(invalid(
                    param,
                    "a `function_call_output` item needs `output` text",
                ))
            }
        };
        let Some(name) = self.called.get(call_id) else {
            // OpenAI's words, so clients that match on them keep working.
            return Err(invalid(
                param,
                &format!(
                    "No tool call found for function call output with call_id {}.",
                    bounded_to(call_id, QUOTED_CALL_ID_BYTES)
                ),
            ));
        };
        self.messages.push(
            json!({"role": "tool", "tool_call_id": call_id, "name": name, "content": output}),
        );
        Ok(())
    }
}

/// A message's content as text: a string, or its text parts joined with a newline.
fn message_text(content: Option<&Value>, param: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                match (kind, part.get("text").and_then(Value::as_str)) {
                    ("input_text" | "output_text", Some(text)) => texts.push(text),
                    ("input_text" | "output_text", None) => {
                        return Err(invalid(param, "a text part needs `text`"))
                    }
                    _ => {
                        return Err(unsupported(
                            param,
                            format!(
                                "content parts of type `{kind}` are not supported: quiver \
                                     serves text models"
                            ),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(invalid(
            param,
            "a message needs `content`: text or a list of text parts",
        )),
    }
}

#[cfg(test)]
#[path = "items_tests.rs"]
mod tests;
