//! A finished reply read for calls, also when `max_tokens` cut it short inside one. A reply cut
//! inside its calls would not parse (its last call is unfinished JSON), and the whole of it,
//! markup included, would come back as content with no calls. OpenAI's API answers such a reply
//! with its calls instead: the complete ones whole, the cut one with the arguments written so
//! far, and `finish_reason: "length"`. So does this: what the stream reader knows of a reply in
//! progress (`ToolCallFormat::scan`) is what a cut reply holds.

use quiver_flags::ToolCallParser;

use super::parsed::{ParsedCall, ParsedOutput};
use super::registry::format_of;

/// `text` split into content and calls; `cut`: generation stopped at `max_tokens`.
pub(super) fn parse_reply(
    parser: ToolCallParser,
    text: &str,
    declared: &[String],
    cut: bool,
) -> ParsedOutput {
    let format = format_of(parser);
    let parsed = format.parse(text, Some(declared));
    if !cut {
        return parsed;
    }
    let scan = format.scan(text);
    let calls: Vec<ParsedCall> = scan
        .calls
        .iter()
        .take_while(|call| declared.contains(&call.name))
        .map(|call| ParsedCall {
            name: call.name.clone(),
            arguments: call.arguments.to_string(),
        })
        .collect();
    // The scan reads calls in the grammar's layout only; a reply in another that parses whole
    // keeps its parse.
    if calls.len() < parsed.tool_calls.len() {
        return parsed;
    }
    // A cut inside a marker or before the first call's name was complete: no call, and the
    // markup is not content. Without one, the text is the reply's.
    let in_a_call = format.opens_calls(text);
    if calls.is_empty() && !in_a_call {
        return parsed;
    }
    ParsedOutput::with_calls(&scan.content, calls)
}
