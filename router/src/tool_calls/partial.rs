//! What can already be told of a reply still being generated: the content no later text can
//! turn into part of a call (text that could be the start of a marker is held back), and the
//! calls whose name is complete, with the arguments written so far. Calls are read in the
//! canonical layout the grammar writes (`{"name": …, "arguments": …}`, name first); a call laid
//! out otherwise is left to the finished reply's parse. Here the reading every JSON format shares;
//! each format's own `scan` (`ToolCallFormat::scan`) puts it together for its layout.

use std::borrow::Cow;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Scan<'a> {
    pub content: String,
    pub calls: Vec<PartialCall<'a>>,
}

#[derive(Debug, PartialEq, Eq)]
pub struct PartialCall<'a> {
    pub name: String,
    /// The arguments object as far as written (empty until it starts, and for arguments written
    /// as a JSON string, which only the finished parse decodes). Pythonic calls have theirs
    /// converted to JSON once the call is complete, and none before.
    pub arguments: Cow<'a, str>,
}

/// Calls one after another, `separator` between them (none: a single call).
pub(super) fn read_list<'a>(
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
pub(super) fn without_marker_start<'a>(text: &'a str, marker: &str) -> &'a str {
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
pub(super) enum Read<'a> {
    /// Its name is complete; the byte after the object when it is complete.
    Call(PartialCall<'a>, Option<usize>),
    /// Not enough text yet, or not in the canonical layout.
    Unknown,
}

/// Reads `{"name": "…", "<key>": ` and what follows of the arguments.
pub(super) fn read<'a>(text: &'a str, keys: &[&str]) -> Read<'a> {
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
pub(super) fn value_end(text: &str) -> Option<usize> {
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
