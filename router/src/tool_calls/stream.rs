//! A streamed reply read for calls as it comes: content deltas, then per call a first delta
//! with its id and name and deltas with pieces of its arguments, OpenAI's order. Each piece of
//! text rescans the reply so far (`partial`); the finished reply is parsed as the non-streamed
//! response is (`ToolCallFormat::parse`) and whatever that has beyond what was sent is sent
//! last, so the deltas add up to the non-streamed message.

use quiver_flags::ToolCallParser;

use super::parsed::{call_id, non_blank};
use super::registry::format_of;
use super::truncated::parse_reply;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolDelta {
    Content(String),
    /// A call's first delta: `arguments` is `""` on the wire.
    CallStart {
        index: usize,
        id: String,
        name: String,
    },
    Arguments {
        index: usize,
        text: String,
    },
}

#[derive(Debug)]
pub struct ToolCallStream {
    parser: ToolCallParser,
    declared: Vec<String>,
    text: String,
    content_sent: String,
    /// Per call started: its name and the arguments sent.
    calls_sent: Vec<(String, String)>,
}

impl ToolCallStream {
    pub fn new(parser: ToolCallParser, declared: Vec<String>) -> Self {
        Self {
            parser,
            declared,
            text: String::new(),
            content_sent: String::new(),
            calls_sent: Vec::new(),
        }
    }

    /// The deltas `piece`, the reply's next text, makes known.
    pub fn push(&mut self, piece: &str) -> Vec<ToolDelta> {
        self.text.push_str(piece);
        let scan = format_of(self.parser).scan(&self.text);
        let mut deltas = Vec::new();
        // Content only once it is more than whitespace: a reply of calls alone has none.
        if non_blank(&scan.content).is_some() {
            send_content(&mut self.content_sent, &scan.content, &mut deltas);
        }
        for (index, call) in scan.calls.iter().enumerate() {
            if !self.declared.contains(&call.name) {
                break;
            }
            send_call(
                &mut self.calls_sent,
                index,
                &call.name,
                &call.arguments,
                &mut deltas,
            );
        }
        deltas
    }

    /// The last deltas once the reply is complete, and whether it holds calls; `cut`: it
    /// stopped at `max_tokens`, maybe inside a call.
    pub fn finish(&mut self, cut: bool) -> (Vec<ToolDelta>, bool) {
        let parsed = parse_reply(self.parser, &self.text, &self.declared, cut);
        let mut deltas = Vec::new();
        if let Some(content) = &parsed.content {
            send_content(&mut self.content_sent, content, &mut deltas);
        }
        for (index, call) in parsed.tool_calls.iter().enumerate() {
            send_call(
                &mut self.calls_sent,
                index,
                &call.name,
                &call.arguments,
                &mut deltas,
            );
        }
        (deltas, !self.calls_sent.is_empty())
    }
}

/// What `content` has beyond what was sent. Sent text is never taken back: were `content` to
/// disagree (a call that turned out malformed), what was sent stands.
fn send_content(sent: &mut String, content: &str, deltas: &mut Vec<ToolDelta>) {
    if let Some(new) = content.strip_prefix(sent.as_str()) {
        if !new.is_empty() {
            deltas.push(ToolDelta::Content(new.to_owned()));
            sent.push_str(new);
        }
    } else {
        tracing::warn!("streamed content and the finished reply's content differ");
    }
}

/// Call `index`'s first delta if not sent yet, and what its arguments have beyond what was sent.
fn send_call(
    sent: &mut Vec<(String, String)>,
    index: usize,
    name: &str,
    arguments: &str,
    deltas: &mut Vec<ToolDelta>,
) {
    if index == sent.len() {
        deltas.push(ToolDelta::CallStart {
            index,
            id: call_id(),
            name: name.to_owned(),
        });
        sent.push((name.to_owned(), String::new()));
    }
    let Some((sent_name, sent_arguments)) = sent.get_mut(index) else {
        return;
    };
    match arguments.strip_prefix(sent_arguments.as_str()) {
        Some(new) if sent_name == name => {
            if !new.is_empty() {
                deltas.push(ToolDelta::Arguments {
                    index,
                    text: new.to_owned(),
                });
                sent_arguments.push_str(new);
            }
        }
        _ => tracing::warn!(
            index,
            "a streamed tool call and the finished reply's differ"
        ),
    }
}
