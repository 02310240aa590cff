//! Forwards a child's stdout/stderr into the launcher's log, one event per line, tagged with the
//! child's name. JSON lines keep their level and message: the shard writes
//! `{"level","message","target"}`, the router tracing-subscriber's `{"level","fields":{"message"}}`.
//! Anything else (a Python traceback, a progress bar) is forwarded as plain text.

use std::borrow::Cow;

use serde_json::{Map, Value};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tracing::Level;

/// One line of a child's output, ready to be re-logged.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildLine {
    pub level: Level,
    pub message: String,
    /// The module that logged it inside the child, when the line says.
    pub source: Option<String>,
    /// The line's other structured fields, as compact JSON.
    pub fields: Option<String>,
}

/// Reads `stream` to its end and logs every line under `child`'s name.
pub async fn forward<R: AsyncRead + Unpin>(child: String, stream: R) {
    let mut reader = BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match read_segment(&mut reader, &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let text = String::from_utf8_lossy(&buf);
                let text = text.trim_end();
                if !text.trim().is_empty() {
                    emit(&child, &parse_line(text));
                }
            }
        }
    }
}

/// Reads up to and including the next `\n` or `\r`: progress bars redraw with `\r`, and waiting
/// for their `\n` would hide download progress until the download is over.
async fn read_segment<R: AsyncRead + Unpin>(
    reader: &mut BufReader<R>,
    out: &mut Vec<u8>,
) -> std::io::Result<usize> {
    let mut total = 0;
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(total);
        }
        match available.iter().position(|&b| b == b'\n' || b == b'\r') {
            Some(end) => {
                out.extend_from_slice(&available[..=end]);
                reader.consume(end + 1);
                return Ok(total + end + 1);
            }
            None => {
                let len = available.len();
                out.extend_from_slice(available);
                reader.consume(len);
                total += len;
            }
        }
    }
}

/// Python's and tracing's level names, any case; unknown ones count as INFO.
fn parse_level(name: &str) -> Level {
    match name.to_ascii_uppercase().as_str() {
        "TRACE" => Level::TRACE,
        "DEBUG" => Level::DEBUG,
        "WARN" | "WARNING" => Level::WARN,
        "ERROR" | "CRITICAL" | "FATAL" => Level::ERROR,
        _ => Level::INFO,
    }
}

pub fn parse_line(line: &str) -> ChildLine {
    let plain = || ChildLine {
        level: Level::INFO,
        message: line.to_owned(),
        source: None,
        fields: None,
    };
    let Ok(Value::Object(mut object)) = serde_json::from_str::<Value>(line) else {
        return plain();
    };
    let Some(level) = object.get("level").and_then(Value::as_str).map(parse_level) else {
        return plain();
    };
    object.remove("level");
    object.remove("timestamp");
    let source = take_string(&mut object, "target");
    // tracing-subscriber nests the message and the event's fields under "fields".
    let mut fields = match object.remove("fields") {
        Some(Value::Object(nested)) => nested,
        _ => Map::new(),
    };
    let message = take_string(&mut fields, "message")
        .or_else(|| take_string(&mut object, "message"))
        .unwrap_or_default();
    fields.extend(object);
    let fields = (!fields.is_empty()).then(|| Value::Object(fields).to_string());
    ChildLine {
        level,
        message,
        source,
        fields,
    }
}

fn take_string(object: &mut Map<String, Value>, key: &str) -> Option<String> {
    match object.remove(key)? {
        Value::String(s) => Some(s),
        other => Some(other.to_string()),
    }
}

/// `text` with every control character (C0 such as CR, LF, NUL, ESC; DEL; C1) written as an
/// escape: a child's line may carry a client's string, which must not forge or garble lines of
/// the launcher's log or drive the operator's terminal.
pub fn escape_controls(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

fn emit(child: &str, line: &ChildLine) {
    let message = escape_controls(&line.message);
    let source = line.source.as_deref().map(escape_controls);
    let fields = line.fields.as_deref().map(escape_controls);
    // tracing needs the level as a constant at each call site, hence one arm per level.
    macro_rules! event_at {
        ($level:expr) => {
            tracing::event!(
                target: "quiver_launcher::child",
                $level,
                child = child,
                source = source.as_deref(),
                fields = fields.as_deref(),
                "{}",
                message
            )
        };
    }
    match line.level {
        Level::ERROR => event_at!(Level::ERROR),
        Level::WARN => event_at!(Level::WARN),
        Level::INFO => event_at!(Level::INFO),
        Level::DEBUG => event_at!(Level::DEBUG),
        _ => event_at!(Level::TRACE),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_json_lines_keep_level_message_and_target() {
        let line = parse_line(
            r#"{"level": "WARNING", "message": "slow disk", "target": "quiver_server.loader"}"#,
        );
        assert_eq!(line.level, Level::WARN);
        assert_eq!(line.message, "slow disk");
        assert_eq!(line.source.as_deref(), Some("quiver_server.loader"));
        assert_eq!(line.fields, None);
    }

    #[test]
    fn tracing_json_lines_unnest_the_message_and_keep_other_fields() {
        let line = parse_line(
            r#"{"timestamp":"t","level":"ERROR","fields":{"message":"boom","code":3},"target":"quiver_router::http"}"#,
        );
        assert_eq!(line.level, Level::ERROR);
        assert_eq!(line.message, "boom");
        assert_eq!(line.source.as_deref(), Some("quiver_router::http"));
        assert_eq!(line.fields.as_deref(), Some(r#"{"code":3}"#));
    }

    #[test]
    fn anything_else_is_plain_text_at_info() {
        for text in [
            "Traceback (most recent call last):",
            r#"{"no_level": 1}"#,
            "[1, 2]",
        ] {
            let line = parse_line(text);
            assert_eq!(line.level, Level::INFO);
            assert_eq!(line.message, text);
        }
        assert_eq!(parse_level("critical"), Level::ERROR);
    }

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            escape_controls("a\r\nINFO forged\0\u{1b}[31m\u{85}\u{7f}é\tb"),
            "a\\r\\nINFO forged\\0\\u{1b}[31m\\u{85}\\u{7f}é\\tb"
        );
        assert!(matches!(escape_controls("plain"), Cow::Borrowed("plain")));
        // A JSON line's message is unescaped by the parser: emit must escape it again.
        let line = parse_line(r#"{"level":"INFO","message":"adapter a\nINFO forged"}"#);
        assert_eq!(line.message, "adapter a\nINFO forged");
        assert_eq!(escape_controls(&line.message), "adapter a\\nINFO forged");
    }

    #[tokio::test]
    async fn segments_split_on_newline_and_carriage_return() {
        let data: &[u8] = b"a\rbb\ncc";
        let mut reader = BufReader::new(data);
        let mut seen = Vec::new();
        loop {
            let mut buf = Vec::new();
            if read_segment(&mut reader, &mut buf).await.unwrap() == 0 {
                break;
            }
            seen.push(String::from_utf8(buf).unwrap());
        }
        assert_eq!(seen, ["a\r", "bb\n", "cc"]);
    }
}
