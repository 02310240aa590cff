//! `POST /v1/responses`' request, read as the Chat Completions request it amounts to: the same
//! model, messages, tools, output constraint and sampling, so that validation, templating,
//! grammars, tool and reasoning parsing are the chat path's own. What the Responses API has
//! beyond chat either maps onto it (items onto messages, `text.format` onto `response_format`,
//! `max_output_tokens` onto `max_tokens`), is accepted without effect for a stated reason, or is
//! refused by name (`RESPONSES`, the field table `docs/api.md` mirrors).
//!
//! Input items, in order, become messages:
//! - `instructions` → a first `system` message;
//! - a string `input` → one `user` message;
//! - `message` items (typed or the short `{role, content}` form), content a string or
//!   `input_text`/`output_text` parts → messages of their role;
//! - `function_call` items → the `tool_calls` of an assistant message (consecutive calls, and
//!   calls right after an assistant message, join that message, as a chat turn holds them);
//! - `function_call_output` items → `tool` messages answering `call_id` (named after the
//!   function that call called, for templates that print the name); an output whose call is
//!   not earlier in the input is refused, as OpenAI refuses it;
//! - `reasoning` items → dropped: chat templates drop earlier turns' reasoning themselves.
//!
//! Any other item or content type (images, files, built-in tools' calls) is refused by name.

use serde_json::{json, Map, Value};

use super::fields::{check_fields_of, implemented, no_effect, refused, some_values, Field};
use crate::error::ApiError;
use items::ItemMessages;

mod items;

/// What the response object repeats of its request (OpenAI's Response echoes these).
#[derive(Debug, Clone, Default)]
pub struct ResponsesEcho {
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u64>,
    pub metadata: Value,
    pub parallel_tool_calls: bool,
    pub temperature: f64,
    pub top_p: f64,
    /// `text` as OpenAI spells it: `{"format": {...}}`.
    pub text: Value,
    pub tool_choice: Value,
    /// The function tools, in the Responses shape.
    pub tools: Vec<Value>,
    pub reasoning: Value,
    pub user: Option<String>,
}

/// A Responses request: the chat request body it amounts to, what the response echoes, and the
/// fields it sent that the table does not know (accepted without effect, named in a header).
pub struct TranslatedRequest {
    pub chat_body: Value,
    pub echo: ResponsesEcho,
    pub ignored: Vec<String>,
}

/// Every top-level field of `/v1/responses`.
pub const RESPONSES: &[Field] = &[
    implemented("model"),
    implemented("input"),
    implemented("instructions"),
    implemented("tools"),
    implemented("tool_choice"),
    implemented("parallel_tool_calls"),
    implemented("text"),
    implemented("max_output_tokens"),
    implemented("temperature"),
    implemented("top_p"),
    implemented("stream"),
    implemented("metadata"),
    no_effect(
        "reasoning",
        "a control of OpenAI's reasoning models; a thinking model's reasoning is returned as a \
         `reasoning` item whatever it says",
    ),
    some_values(
        no_effect(
            "store",
            "quiver stores no responses: `false` is what it does",
        ),
        refuse_store,
    ),
    some_values(
        no_effect(
            "truncation",
            "`disabled` is what quiver does: a long input is refused",
        ),
        refuse_auto_truncation,
    ),
    some_values(
        no_effect(
            "background",
            "`false` is what quiver does: responses are streamed or waited for",
        ),
        refuse_true,
    ),
    some_values(
        no_effect("include", "nothing extra is asked for"),
        refuse_includes,
    ),
    no_effect(
        "stream_options",
        "its one option, `include_obfuscation`, pads events against side channels of OpenAI's \
         network; quiver adds no padding",
    ),
    no_effect(
        "user",
        "an end-user label for OpenAI's abuse monitoring; quiver keeps no per-user records",
    ),
    no_effect(
        "safety_identifier",
        "an end-user label for OpenAI's abuse monitoring; quiver keeps no per-user records",
    ),
    no_effect(
        "prompt_cache_key",
        "a routing hint for OpenAI's prompt cache; quiver's prefix cache needs none",
    ),
    no_effect(
        "prompt_cache_retention",
        "OpenAI's prompt-cache lifetime; quiver's prefix cache evicts by need",
    ),
    no_effect(
        "prompt_cache_options",
        "OpenAI's prompt-cache settings; quiver's prefix cache needs none",
    ),
    no_effect("service_tier", "one tier: every request is served alike"),
    refused(
        "moderation",
        "quiver runs no moderation; accepting it would suggest it did",
    ),
    refused(
        "context_management",
        "it compacts OpenAI's stored conversations; quiver stores none",
    ),
    refused(
        "previous_response_id",
        "quiver stores no responses to continue from; send the conversation as `input` items",
    ),
    refused(
        "conversation",
        "quiver stores no conversations; send the conversation as `input` items",
    ),
    refused(
        "prompt",
        "OpenAI's stored prompt templates are not available; send `instructions` and `input`",
    ),
    refused(
        "max_tool_calls",
        "it bounds OpenAI's built-in tools, which quiver does not run",
    ),
    refused(
        "top_logprobs",
        "output logprobs are not returned by /v1/responses yet; use /v1/chat/completions",
    ),
];

fn refuse_store(value: &Value) -> Option<&'static str> {
    (value != &Value::Bool(false)).then_some(
        "quiver stores no responses, so `store` must be false (or absent); continue a \
         conversation by sending it as `input` items",
    )
}

fn refuse_auto_truncation(value: &Value) -> Option<&'static str> {
    (value.as_str() != Some("disabled"))
        .then_some("only `disabled` is supported: an input over the context is refused, not cut")
}

fn refuse_true(value: &Value) -> Option<&'static str> {
    (value != &Value::Bool(false)).then_some("background responses are not supported")
}

fn refuse_includes(value: &Value) -> Option<&'static str> {
    let empty = value.as_array().is_some_and(Vec::is_empty);
    (!empty).then_some(
        "no extra output is available: reasoning is returned in full (nothing is encrypted) \
         and output logprobs are not returned by /v1/responses yet",
    )
}

/// Reads a Responses request body into the chat request it amounts to.
pub fn translate(body: &Map<String, Value>) -> Result<TranslatedRequest, ApiError> {
    let ignored = check_fields_of(&[RESPONSES], body)?;
    let get = |name: &str| body.get(name).filter(|value| !value.is_null());
    let instructions = match get("instructions") {
        None => None,
        Some(Value::String(text)) => Some(text.clone()),
        Some(_) => return Err(invalid("instructions", "`instructions` must be a string")),
    };
    let mut messages = ItemMessages::default();
    if let Some(text) = &instructions {
        messages.push(json!({"role": "system", "content": text}));
    }
    match get("input") {
        None => {
            return Err(invalid(
                "input",
                "`input` is required: a string or a list of items",
            ))
        }
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for (index, item) in items.iter().enumerate() {
                messages.add_item(item, index)?;
            }
        }
        Some(_) => {
            return Err(invalid(
                "input",
                "`input` must be a string or a list of items",
            ))
        }
    }
    let mut chat = Map::new();
    chat.insert(
        "messages".to_owned(),
        Value::Array(messages.into_messages()),
    );
    for name in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "user",
    ] {
        if let Some(value) = get(name) {
            chat.insert(name.to_owned(), value.clone());
        }
    }
    if let Some(limit) = get("max_output_tokens") {
        chat.insert("max_tokens".to_owned(), limit.clone());
    }
    let tools = match get("tools") {
        None => Vec::new(),
        Some(Value::Array(tools)) => tools.clone(),
        Some(_) => return Err(invalid("tools", "`tools` must be a list")),
    };
    // Echoed as OpenAI's Response spells a function tool (`strict` defaults to true there).
    let echoed_tools: Vec<Value> = tools
        .iter()
        .map(|tool| {
            json!({
                "type": "function",
                "name": tool.get("name"),
                "description": tool.get("description"),
                "parameters": tool.get("parameters"),
                "strict": tool.get("strict").and_then(Value::as_bool).unwrap_or(true),
            })
        })
        .collect();
    if !tools.is_empty() {
        let chat_tools = tools
            .iter()
            .enumerate()
            .map(|(index, tool)| chat_tool(tool, index))
            .collect::<Result<Vec<_>, _>>()?;
        chat.insert("tools".to_owned(), Value::Array(chat_tools));
    }
    let tool_choice = get("tool_choice").cloned();
    if let Some(choice) = &tool_choice {
        chat.insert("tool_choice".to_owned(), chat_tool_choice(choice)?);
    }
    let text = get("text").cloned();
    if let Some(format) = text.as_ref().and_then(|text| text.get("format")) {
        if let Some(response_format) = chat_response_format(format)? {
            chat.insert("response_format".to_owned(), response_format);
        }
    }
    // The usage the response reports comes with the stream's last chunk.
    if get("stream") == Some(&Value::Bool(true)) {
        chat.insert("stream_options".to_owned(), json!({"include_usage": true}));
    }
    let number = |name: &str, default: f64| get(name).and_then(Value::as_f64).unwrap_or(default);
    let echo = ResponsesEcho {
        instructions,
        max_output_tokens: get("max_output_tokens").and_then(Value::as_u64),
        metadata: get("metadata").cloned().unwrap_or_else(|| json!({})),
        parallel_tool_calls: get("parallel_tool_calls")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        temperature: number("temperature", 1.0),
        top_p: number("top_p", 1.0),
        text: text.unwrap_or_else(|| json!({"format": {"type": "text"}})),
        tool_choice: tool_choice.unwrap_or_else(|| json!("auto")),
        tools: echoed_tools,
        reasoning: get("reasoning")
            .cloned()
            .unwrap_or_else(|| json!({"effort": null, "summary": null})),
        user: get("user").and_then(Value::as_str).map(str::to_owned),
    };
    Ok(TranslatedRequest {
        chat_body: Value::Object(chat),
        echo,
        ignored,
    })
}

/// A Responses function tool as a chat tool.
fn chat_tool(tool: &Value, index: usize) -> Result<Value, ApiError> {
    let param = format!("tools[{index}]");
    let kind = tool.get("type").and_then(Value::as_str).unwrap_or_default();
    if kind != "function" {
        return Err(unsupported(
            &param,
            format!("tools of type `{kind}` are not supported: quiver calls function tools only"),
        ));
    }
    let mut function = Map::new();
    for key in ["name", "description", "parameters", "strict"] {
        if let Some(value) = tool.get(key).filter(|value| !value.is_null()) {
            function.insert(key.to_owned(), value.clone());
        }
    }
    Ok(json!({"type": "function", "function": function}))
}

/// `tool_choice` as chat spells it.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(object) if object.get("type").and_then(Value::as_str) == Some("function") => {
            let name = object
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid("tool_choice", "a function `tool_choice` needs `name`"))?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(unsupported(
            "tool_choice",
            "`tool_choice` must be `auto`, `none`, `required` or a function by name".to_owned(),
        )),
    }
}

/// `text.format` as a chat `response_format`; `None` for plain text.
fn chat_response_format(format: &Value) -> Result<Option<Value>, ApiError> {
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict", "description"] {
                if let Some(value) = format.get(key).filter(|value| !value.is_null()) {
                    schema.insert(key.to_owned(), value.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(invalid(
            "text.format",
            "`text.format.type` must be `text`, `json_object` or `json_schema`",
        )),
    }
}

fn invalid(param: &str, message: &str) -> ApiError {
    ApiError::BadRequestBody {
        message: message.to_owned(),
        param: Some(param.to_owned()),
        code: "invalid_value",
    }
}

fn unsupported(param: &str, message: String) -> ApiError {
    ApiError::BadRequestBody {
        message,
        param: Some(param.to_owned()),
        code: "unsupported_value",
    }
}

/// The OpenAPI schema of `POST /v1/responses`' body: what `translate` reads (the field table
/// above says what each field does).
pub struct ResponsesRequest;

impl utoipa::PartialSchema for ResponsesRequest {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Type};
        let of_type = |kind: Type| ObjectBuilder::new().schema_type(kind);
        let item = of_type(Type::Object).description(Some(
            "A message (`{role, content}`, content text or `input_text`/`output_text` parts), a \
             `function_call`, a `function_call_output` or a `reasoning` item",
        ));
        let input = OneOfBuilder::new()
            .item(of_type(Type::String))
            .item(ArrayBuilder::new().items(item));
        let tool = of_type(Type::Object)
            .property(
                "type",
                of_type(Type::String).enum_values(Some(["function"])),
            )
            .property("name", of_type(Type::String))
            .property("description", of_type(Type::String))
            .property("parameters", of_type(Type::Object))
            .property("strict", of_type(Type::Boolean))
            .required("type")
            .required("name");
        let tool_choice = OneOfBuilder::new()
            .item(of_type(Type::String).enum_values(Some(["auto", "none", "required"])))
            .item(
                of_type(Type::Object)
                    .property(
                        "type",
                        of_type(Type::String).enum_values(Some(["function"])),
                    )
                    .property("name", of_type(Type::String))
                    .required("type")
                    .required("name"),
            );
        of_type(Type::Object)
            .property("model", of_type(Type::String))
            .property("input", input)
            .property("instructions", of_type(Type::String))
            .property("tools", ArrayBuilder::new().items(tool))
            .property("tool_choice", tool_choice)
            .property("parallel_tool_calls", of_type(Type::Boolean))
            .property(
                "text",
                of_type(Type::Object).property(
                    "format",
                    of_type(Type::Object).property(
                        "type",
                        of_type(Type::String).enum_values(Some([
                            "text",
                            "json_object",
                            "json_schema",
                        ])),
                    ),
                ),
            )
            .property("max_output_tokens", of_type(Type::Integer).minimum(Some(1)))
            .property("temperature", of_type(Type::Number))
            .property("top_p", of_type(Type::Number))
            .property("stream", of_type(Type::Boolean))
            .property("metadata", of_type(Type::Object))
            .property("store", of_type(Type::Boolean).enum_values(Some([false])))
            .required("input")
            .into()
    }
}

impl utoipa::ToSchema for ResponsesRequest {}
