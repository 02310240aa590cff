//! What can already be told of a reply still being generated: the content no later text can
//! turn into part of a call (text that could be the start of a marker is held back), and the
//! calls whose name is complete, with the arguments written so far. Calls are read in the
//! canonical layout the grammar writes (`{"name": …, "arguments": …}`, name first); a call laid
//! out otherwise is left to the finished reply's parse.

use std::borrow::Cow;

use super::pythonic::{self, Reader};
use super::{granite, hermes, llama3_json, mistral, ToolCallParser};

#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Scan<'a> {
    pub content: String,
    pub calls: Vec<PartialCall<'a>>,
}

#[derive(Debug, PartialEq, Eq)]
pub(super) struct PartialCall<'a> {
    pub name: String,
    /// The arguments object as far as written (empty until it starts, and for arguments written
    /// as a JSON string, which only the finished parse decodes). Pythonic calls have theirs
    /// converted to JSON once the call is complete, and none before.
    pub arguments: Cow<'a, str>,
}

/// The scan of `text`, the reply so far.
pub(super) fn scan(parser: ToolCallParser, text: &str) -> Scan<'_> {
    match parser {
        ToolCallParser::Hermes => scan_hermes(text),
        ToolCallParser::Llama3Json => scan_llama(text),
        ToolCallParser::Mistral => scan_mistral(text),
        ToolCallParser::Granite => scan_marked_list(text, granite::MARKER, granite::ARGUMENTS),
        ToolCallParser::Pythonic => scan_pythonic(text),
    }
}

fn scan_hermes(text: &str) -> Scan<'_> {
    let mut scan = Scan::default();
    let mut rest = text;
    loop {
        let Some(start) = rest.find(hermes::START) else {
            scan.content
                .push_str(without_marker_start(rest, hermes::START));
            return scan;
        };
        scan.content.push_str(&rest[..start]);
        let body = rest[start + hermes::START.len()..].trim_start();
        let Read::Call(call, end) = read(body, hermes::ARGUMENTS) else {
            return scan;
        };
        scan.calls.push(call);
        let Some(end) = end else { return scan };
        match body[end..].trim_start().strip_prefix(hermes::END) {
            Some(after) => rest = after,
            None => return scan,
        }
    }
}

fn scan_mistral(text: &str) -> Scan<'_> {
    let Some(start) = text.find(mistral::MARKER) else {
        return scan_marked_list(text, mistral::MARKER, mistral::ARGUMENTS);
    };
    let after = &text[start + mistral::MARKER.len()..];
    if after.trim_start().is_empty() || after.trim_start().starts_with(['[', '{']) {
        return scan_marked_list(text, mistral::MARKER, mistral::ARGUMENTS);
    }
    // v11 on: `name[ARGS]{…}` after each marker.
    let mut scan = Scan::default();
    scan.content.push_str(&text[..start]);
    for call in after.split(mistral::MARKER) {
        let Some((name, arguments)) = call.split_once(mistral::ARGS) else {
            return scan;
        };
        let Some(name) = mistral::v11_name(name) else {
            return scan;
        };
        let arguments = arguments.trim_start();
        let arguments = match value_end(arguments) {
            Some(end) => &arguments[..end],
            None if arguments.starts_with('{') => arguments,
            None => "",
        };
        scan.calls.push(PartialCall {
            name: name.to_owned(),
            arguments: Cow::Borrowed(arguments),
        });
    }
    scan
}

/// `marker` then a JSON array of calls (or one object), text before it the content.
fn scan_marked_list<'a>(text: &'a str, marker: &str, keys: &[&str]) -> Scan<'a> {
    let mut scan = Scan::default();
    let Some(start) = text.find(marker) else {
        scan.content.push_str(without_marker_start(text, marker));
        return scan;
    };
    scan.content.push_str(&text[..start]);
    let after = text[start + marker.len()..].trim_start();
    match after.strip_prefix('[') {
        Some(list) => read_list(list, keys, ",", &mut scan.calls),
        None => read_list(after, keys, "", &mut scan.calls),
    }
    scan
}

/// A Python list of calls: each call's name once `name(` is written, its arguments once the
/// call is complete. Text that cannot open such a list is content.
fn scan_pythonic(text: &str) -> Scan<'_> {
    let mut scan = Scan::default();
    let trimmed = text.trim_start();
    if trimmed.is_empty() || pythonic::START.starts_with(trimmed) {
        return scan;
    }
    let Some(body) = pythonic::body(text) else {
        scan.content.push_str(text);
        return scan;
    };
    let mut reader = Reader::new(body);
    if !reader.take('[') {
        return scan;
    }
    loop {
        let from = reader.at;
        if let Some(call) = reader.call() {
            scan.calls.push(PartialCall {
                name: call.name,
                arguments: Cow::Owned(call.arguments),
            });
            if reader.take(',') {
                continue;
            }
            return scan;
        }
        // Unfinished: its name, if complete.
        let mut name_reader = Reader::new(&body[from..]);
        if let (Some(name), true) = (name_reader.identifier(), name_reader.take('(')) {
            scan.calls.push(PartialCall {
                name: name.to_owned(),
                arguments: Cow::Borrowed(""),
            });
        }
        return scan;
    }
}

fn scan_llama(text: &str) -> Scan<'_> {
    let mut scan = Scan::default();
    let trimmed = text.trim_start();
    let body = match trimmed.strip_prefix(llama3_json::PYTHON_TAG) {
        Some(after) => after.trim_start(),
        // Nothing yet, or the start of the tag: it may still become a call.
        None if llama3_json::PYTHON_TAG.starts_with(trimmed) => return scan,
        None if !trimmed.starts_with('{') => {
            scan.content.push_str(text);
            return scan;
        }
        None => trimmed,
    };
    read_list(body, llama3_json::ARGUMENTS, ";", &mut scan.calls);
    scan
}

/// Calls one after another, `separator` between them (none: a single call).
fn read_list<'a>(
    mut text: &'a str,
    keys: &[&str],
    separator: &str,
    calls: &mut Vec<PartialCall<'a>>,
) {
    loop {
        text = text.trim_start();
        let Read::Call(call, end) = read(text, keys) else {
            return;
        };
        calls.push(call);
        let Some(end) = end else { return };
        if separator.is_empty() {
            return;
        }
        match text[end..].trim_start().strip_prefix(separator) {
            Some(after) => text = after,
            None => return,
        }
    }
}

/// `text` without a tail that could be the start of `marker`.
fn without_marker_start<'a>(text: &'a str, marker: &str) -> &'a str {
    let longest = (marker.len() - 1).min(text.len());
    for length in (1..=longest).rev() {
        let cut = text.len() - length;
        if text.is_char_boundary(cut) && marker.starts_with(&text[cut..]) {
            return &text[..cut];
        }
    }
    text
}

/// What is known of a call object at the start of a text.
enum Read<'a> {
    /// Its name is complete; the byte after the object when it is complete.
    Call(PartialCall<'a>, Option<usize>),
    /// Not enough text yet, or not in the canonical layout.
    Unknown,
}

/// Reads `{"name": "…", "<key>": ` and what follows of the arguments.
fn read<'a>(text: &'a str, keys: &[&str]) -> Read<'a> {
    let mut cursor = Cursor { text, at: 0 };
    let name = (|| {
        cursor.literal("{")?;
        cursor.literal("\"name\"")?;
        cursor.literal(":")?;
        let name = cursor.string()?;
        cursor.literal(",")?;
        cursor.one_of(keys)?;
        cursor.literal(":")?;
        cursor.skip_whitespace();
        Some(name)
    })();
    let Some(name) = name else {
        return Read::Unknown;
    };
    let rest = &text[cursor.at..];
    let arguments = if rest.starts_with('{') {
        match value_end(rest) {
            Some(end) => &rest[..end],
            None => rest,
        }
    } else {
        ""
    };
    let call = PartialCall {
        name,
        arguments: Cow::Borrowed(arguments),
    };
    Read::Call(call, value_end(text))
}

/// A position in a text read left to right; every step skips whitespace before what it reads
/// and fails when the text ends or differs.
struct Cursor<'a> {
    text: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn skip_whitespace(&mut self) {
        let rest = &self.text[self.at..];
        self.at += rest.len() - rest.trim_start().len();
    }

    fn literal(&mut self, literal: &str) -> Option<()> {
        self.skip_whitespace();
        self.text[self.at..].starts_with(literal).then(|| {
            self.at += literal.len();
        })
    }

    fn one_of(&mut self, keys: &[&str]) -> Option<()> {
        keys.iter()
            .find_map(|key| self.literal(&format!("\"{key}\"")))
    }

    /// A complete JSON string, decoded.
    fn string(&mut self) -> Option<String> {
        self.skip_whitespace();
        let rest = &self.text[self.at..];
        let end = string_end(rest)?;
        let value = serde_json::from_str(&rest[..end]).ok()?;
        self.at += end;
        Some(value)
    }
}

/// The byte after a JSON string starting at `text`'s first byte, when complete.
fn string_end(text: &str) -> Option<usize> {
    let mut bytes = text.bytes().enumerate();
    if bytes.next()?.1 != b'"' {
        return None;
    }
    let mut escaped = false;
    for (i, byte) in bytes {
        match byte {
            _ if escaped => escaped = false,
            b'\\' => escaped = true,
            b'"' => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// The byte after the object or array starting at `text`'s first byte, when complete.
fn value_end(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, byte) in text.bytes().enumerate() {
        if in_string {
            match byte {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match byte {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ if depth == 0 => return None,
            _ => {}
        }
    }
    None
}
