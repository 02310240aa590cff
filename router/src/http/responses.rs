//! `POST /v1/responses`, OpenAI's Responses API, on the chat path: the request is read as the
//! chat request it amounts to (`openai::responses_request`), runs as one (validation, template,
//! grammar, tool and reasoning parsing), and its answer is re-spelt as a Response: the chat
//! message's reasoning, text and calls become `reasoning`, `message` and `function_call` output
//! items. Streamed, each chat chunk's deltas become the Responses API's typed events, in its
//! order: `response.created`, `response.in_progress`, per item `response.output_item.added`,
//! its deltas (`response.reasoning_text.delta`, `response.content_part.added` and
//! `response.output_text.delta`, `response.function_call_arguments.delta`), their `.done`
//! events and `response.output_item.done`, then `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut it) with the whole response and usage.
//! Every event carries its `sequence_number`; the stream has no `[DONE]`.

use axum::extract::State;
use axum::response::Response;
use axum::Extension;
use serde_json::{json, Value};

use super::chat::Chat;
use super::endpoint::{answer, Endpoint, FinishedChoice, GenerationBody, ResponseSetup};
use super::ignored_fields::name_ignored_fields;
use super::json::{OpenAiJson, RequestBody};
use super::sse::{ChoiceStep, ChunkFormat};
use super::state::AppState;
use crate::error::ApiError;
use crate::openai::chat::{AssistantMessage, ChatCompletionChunk, ChatFields};
use crate::openai::common::{random_id, unix_now, FinishReason, Usage};
use crate::openai::responses_request::{translate, ResponsesEcho};
use crate::tenants::Caller;

/// A Responses request body: the chat request it amounts to, and what its answer echoes.
pub struct ResponsesBody {
    chat: GenerationBody<ChatFields>,
    echo: ResponsesEcho,
    ignored: Vec<String>,
}

impl RequestBody for ResponsesBody {
    fn from_json(value: Value) -> Result<Self, ApiError> {
        let Value::Object(body) = value else {
            return Err(ApiError::BadRequestBody {
                message: "the request body must be a JSON object".to_owned(),
                param: None,
                code: "invalid_json",
            });
        };
        let translated = translate(&body)?;
        Ok(Self {
            chat: GenerationBody::from_json(translated.chat_body).map_err(in_responses_terms)?,
            echo: translated.echo,
            ignored: translated.ignored,
        })
    }
}

/// The axum handler of `POST /v1/responses`.
pub async fn create_response(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    OpenAiJson(body): OpenAiJson<ResponsesBody>,
) -> Result<Response, ApiError> {
    let (fields, params, _) = body.chat.into_parts();
    let response = answer::<Responses>(state, &caller, fields, params, body.echo)
        .await
        .map_err(in_responses_terms)?;
    Ok(name_ignored_fields(response, &body.ignored))
}

/// An error of the chat request a Responses request was read as, its `param` named as the
/// Responses request names the field (`messages` is `input`, `max_tokens` is
/// `max_output_tokens`, `response_format` is `text.format`); the message may still use the chat
/// field's name.
fn in_responses_terms(error: ApiError) -> ApiError {
    let Some(param) = error.param() else {
        return error;
    };
    let renamed = [
        ("messages", "input"),
        ("max_completion_tokens", "max_output_tokens"),
        ("max_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
    ]
    .iter()
    // The whole field: a chat message's index is not an input item's, and `response_format`'s
    // nesting is not `text.format`'s.
    .find_map(|(chat, ours)| param.starts_with(chat).then(|| (*ours).to_owned()));
    match renamed {
        Some(param) => ApiError::Respelled {
            error: Box::new(error),
            param: Some(param),
        },
        None => error,
    }
}

/// One Responses request's answer, made from its chat answer.
pub struct Responses {
    chat: Chat,
    echo: ResponsesEcho,
    id: String,
    created_at: u64,
    model: String,
    /// Streamed: the next event's `sequence_number`, the items done, the one being written.
    sequence: u64,
    done: Vec<Value>,
    open: Option<OpenItem>,
    finish: Option<FinishReason>,
}

/// An output item whose deltas are being streamed.
enum OpenItem {
    Reasoning {
        id: String,
        text: String,
    },
    Message {
        id: String,
        text: String,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

impl Endpoint for Responses {
    type Fields = ChatFields;
    type Response = Value;
    type Context = ResponsesEcho;

    fn new(setup: ResponseSetup, echo: ResponsesEcho) -> Self {
        let model = setup.model.clone();
        Self {
            chat: <Chat as Endpoint>::new(setup, ()),
            echo,
            id: random_id("resp_"),
            created_at: unix_now(),
            model,
            sequence: 0,
            done: Vec::new(),
            open: None,
            finish: None,
        }
    }

    fn response(self, choices: Vec<FinishedChoice>, usage: Usage) -> Value {
        let chat = self.chat.response(choices, usage);
        let mut output = Vec::new();
        let mut finish = FinishReason::Stop;
        if let Some(choice) = chat.choices.into_iter().next() {
            finish = choice.finish_reason;
            output = output_items(choice.message, item_status(finish));
        }
        response_object(
            &self.echo,
            &self.id,
            self.created_at,
            &self.model,
            finish,
            output,
            Some(&usage),
        )
    }
}

impl ChunkFormat for Responses {
    type Chunk = Value;
    const ENDS_WITH_DONE: bool = false;
    const ERROR_EVENT: Option<&'static str> = Some("error");

    fn choice(&mut self, index: u32, step: ChoiceStep) -> Vec<Value> {
        let mut events = Vec::new();
        if matches!(step, ChoiceStep::Opening) {
            let created = self.in_progress();
            events.push(self.event("response.created", json!({"response": created})));
            events.push(self.event("response.in_progress", json!({"response": created})));
        }
        for chunk in self.chat.choice(index, step) {
            self.translate_chunk(chunk, &mut events);
        }
        events
    }

    fn usage(&mut self, usage: Usage) -> Vec<Value> {
        let finish = self.finish.unwrap_or(FinishReason::Stop);
        let response = response_object(
            &self.echo,
            &self.id,
            self.created_at,
            &self.model,
            finish,
            self.done.clone(),
            Some(&usage),
        );
        let kind = match response["status"] == "incomplete" {
            true => "response.incomplete",
            false => "response.completed",
        };
        vec![self.event(kind, json!({"response": response}))]
    }

    fn error(&mut self, error: &ApiError) -> Value {
        let body = error.to_body().error;
        let sequence = self.next_sequence();
        json!({
            "type": "error",
            "code": body.code,
            "message": body.message,
            "param": body.param,
            "sequence_number": sequence,
        })
    }

    fn event_name(chunk: &Value) -> Option<String> {
        chunk.get("type").and_then(Value::as_str).map(str::to_owned)
    }
}

impl Responses {
    fn next_sequence(&mut self) -> u64 {
        let sequence = self.sequence;
        self.sequence += 1;
        sequence
    }

    /// An event of `kind` with `fields` and the next sequence number.
    fn event(&mut self, kind: &str, fields: Value) -> Value {
        let mut event = json!({"type": kind, "sequence_number": self.next_sequence()});
        if let (Value::Object(event), Value::Object(fields)) = (&mut event, fields) {
            event.extend(fields);
        }
        event
    }

    /// The response as it stands, for `response.created` and `response.in_progress`.
    fn in_progress(&self) -> Value {
        let mut response = response_object(
            &self.echo,
            &self.id,
            self.created_at,
            &self.model,
            FinishReason::Stop,
            self.done.clone(),
            None,
        );
        response["status"] = json!("in_progress");
        response["completed_at"] = Value::Null;
        response
    }

    /// The events one chat chunk's deltas make.
    fn translate_chunk(&mut self, chunk: ChatCompletionChunk, events: &mut Vec<Value>) {
        for choice in chunk.choices {
            let delta = choice.delta;
            if let Some(text) = delta.reasoning_content.filter(|text| !text.is_empty()) {
                if !matches!(self.open, Some(OpenItem::Reasoning { .. })) {
                    self.close(events, "completed");
                    let id = random_id("rs_");
                    let item = reasoning_item(&id, "", "in_progress");
                    self.open = Some(OpenItem::Reasoning {
                        id,
                        text: String::new(),
                    });
                    self.added(item, events);
                }
                let output_index = self.done.len();
                if let Some(OpenItem::Reasoning { id, text: written }) = &mut self.open {
                    written.push_str(&text);
                    let fields = json!({"item_id": id, "output_index": output_index,
                                        "content_index": 0, "delta": text});
                    let event = self.event("response.reasoning_text.delta", fields);
                    events.push(event);
                }
            }
            if let Some(text) = delta.content.filter(|text| !text.is_empty()) {
                if !matches!(self.open, Some(OpenItem::Message { .. })) {
                    self.close(events, "completed");
                    let id = random_id("msg_");
                    let item = json!({"type": "message", "id": id, "status": "in_progress",
                                      "role": "assistant", "content": []});
                    self.open = Some(OpenItem::Message {
                        id: id.clone(),
                        text: String::new(),
                    });
                    self.added(item, events);
                    let fields = json!({"item_id": id, "output_index": self.done.len(),
                                        "content_index": 0, "part": output_text("")});
                    let event = self.event("response.content_part.added", fields);
                    events.push(event);
                }
                let output_index = self.done.len();
                if let Some(OpenItem::Message { id, text: written }) = &mut self.open {
                    written.push_str(&text);
                    let fields = json!({"item_id": id, "output_index": output_index,
                                        "content_index": 0, "delta": text, "logprobs": []});
                    let event = self.event("response.output_text.delta", fields);
                    events.push(event);
                }
            }
            for call in delta.tool_calls.unwrap_or_default() {
                if let Some(call_id) = call.id {
                    self.close(events, "completed");
                    let id = random_id("fc_");
                    let name = call.function.name.unwrap_or_default();
                    let item = function_call_item(&id, &call_id, &name, "", "in_progress");
                    self.open = Some(OpenItem::Call {
                        id,
                        call_id,
                        name,
                        arguments: String::new(),
                    });
                    self.added(item, events);
                }
                let piece = call.function.arguments;
                let output_index = self.done.len();
                if let (false, Some(OpenItem::Call { id, arguments, .. })) =
                    (piece.is_empty(), &mut self.open)
                {
                    arguments.push_str(&piece);
                    let fields =
                        json!({"item_id": id, "output_index": output_index, "delta": piece});
                    let event = self.event("response.function_call_arguments.delta", fields);
                    events.push(event);
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(reason);
                self.close(events, item_status(reason));
            }
        }
    }

    fn added(&mut self, item: Value, events: &mut Vec<Value>) {
        let fields = json!({"output_index": self.done.len(), "item": item});
        let event = self.event("response.output_item.added", fields);
        events.push(event);
    }

    /// Ends the item being written: its `.done` events, then `response.output_item.done`.
    fn close(&mut self, events: &mut Vec<Value>, status: &str) {
        let Some(open) = self.open.take() else {
            return;
        };
        let output_index = self.done.len();
        let item = match open {
            OpenItem::Reasoning { id, text } => {
                let fields = json!({"item_id": id, "output_index": output_index,
                                    "content_index": 0, "text": text});
                let event = self.event("response.reasoning_text.done", fields);
                events.push(event);
                reasoning_item(&id, &text, status)
            }
            OpenItem::Message { id, text } => {
                let fields = json!({"item_id": id, "output_index": output_index,
                                    "content_index": 0, "text": text, "logprobs": []});
                let event = self.event("response.output_text.done", fields);
                events.push(event);
                let fields = json!({"item_id": id, "output_index": output_index,
                                    "content_index": 0, "part": output_text(&text)});
                let event = self.event("response.content_part.done", fields);
                events.push(event);
                message_item(&id, &text, status)
            }
            OpenItem::Call {
                id,
                call_id,
                name,
                arguments,
            } => {
                let fields = json!({"item_id": id, "output_index": output_index,
                                    "name": name, "arguments": arguments});
                let event = self.event("response.function_call_arguments.done", fields);
                events.push(event);
                function_call_item(&id, &call_id, &name, &arguments, status)
            }
        };
        let fields = json!({"output_index": output_index, "item": item.clone()});
        let event = self.event("response.output_item.done", fields);
        events.push(event);
        self.done.push(item);
    }
}

/// An item cut by `max_output_tokens` is `incomplete`; any other ended `completed`.
fn item_status(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "incomplete",
        _ => "completed",
    }
}

/// A finished chat message as output items: its reasoning, its text, its calls.
fn output_items(message: AssistantMessage, status: &str) -> Vec<Value> {
    let mut items = Vec::new();
    let reasoning = message.reasoning_content.flatten();
    if let Some(reasoning) = reasoning.filter(|text| !text.is_empty()) {
        items.push(reasoning_item(&random_id("rs_"), &reasoning, status));
    }
    if let Some(text) = message.content.filter(|text| !text.is_empty()) {
        items.push(message_item(&random_id("msg_"), &text, status));
    }
    for call in message.tool_calls.unwrap_or_default() {
        let function = call.function;
        items.push(function_call_item(
            &random_id("fc_"),
            &call.id,
            &function.name,
            &function.arguments,
            status,
        ));
    }
    items
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [output_text(text)]})
}

fn reasoning_item(id: &str, text: &str, status: &str) -> Value {
    let content = match text.is_empty() {
        true => json!([]),
        false => json!([{"type": "reasoning_text", "text": text}]),
    };
    json!({"type": "reasoning", "id": id, "summary": [], "content": content, "status": status})
}

fn function_call_item(id: &str, call_id: &str, name: &str, arguments: &str, status: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": arguments, "status": status})
}

/// The Response object: its request's echo, its output items, its status and usage.
fn response_object(
    echo: &ResponsesEcho,
    id: &str,
    created_at: u64,
    model: &str,
    finish: FinishReason,
    output: Vec<Value>,
    usage: Option<&Usage>,
) -> Value {
    let incomplete = finish == FinishReason::Length;
    let usage = usage.map(|usage| {
        let cached = usage
            .prompt_tokens_details
            .map_or(0, |details| details.cached_tokens);
        json!({
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens()},
            "total_tokens": usage.total_tokens,
        })
    });
    let mut response = json!({
        "id": id,
        "object": "response",
        "created_at": created_at,
        "status": if incomplete { "incomplete" } else { "completed" },
        "completed_at": unix_now(),
        "error": null,
        "incomplete_details": if incomplete { json!({"reason": "max_output_tokens"}) } else { Value::Null },
        "instructions": echo.instructions,
        "max_output_tokens": echo.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": echo.parallel_tool_calls,
        "previous_response_id": null,
        "reasoning": echo.reasoning,
        "temperature": echo.temperature,
        "text": echo.text,
        "tool_choice": echo.tool_choice,
        "tools": echo.tools,
        "top_p": echo.top_p,
        "truncation": "disabled",
        "metadata": echo.metadata,
    });
    // Absent until known: OpenAI's schema has no null usage.
    if let Some(usage) = usage {
        response["usage"] = usage;
    }
    // OpenAI's schema has `user` as a string when present, never null.
    if let Some(user) = &echo.user {
        response["user"] = json!(user);
    }
    response
}
