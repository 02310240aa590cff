//! The `tojson` filter as transformers defines it: Python's
//! `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
//!
//! minijinja's own `tojson` escapes `<`, `>`, `&` and `'` for HTML and uses serde's spacing;
//! Python writes `", "`/`": "` separators, keeps non-ASCII text, and keeps key order.

use std::fmt::Write;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Error, ErrorKind};

use super::python::{self, float_repr};

/// The arguments of Python's `json.dumps` that transformers' `tojson` exposes.
#[derive(Debug, Clone, Default)]
pub struct DumpOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(unit)`: one item per line, each level indented by `unit`.
    pub indent: Option<String>,
    pub item_separator: Option<String>,
    pub key_separator: Option<String>,
    pub sort_keys: bool,
}

/// The filter: `x | tojson`, `x | tojson(indent=4)`, `x | tojson(separators=(",", ":"))`.
/// Positional arguments follow the Python signature `(ensure_ascii, indent, separators, sort_keys)`.
pub fn tojson_filter(value: &Value, args: &[Value], kwargs: Kwargs) -> Result<String, Error> {
    let positional = |idx, name| python::argument(args, &kwargs, idx, name);
    let mut options = DumpOptions::default();
    if let Some(ensure_ascii) = positional(0, "ensure_ascii")? {
        options.ensure_ascii = ensure_ascii.is_true();
    }
    if let Some(indent) = positional(1, "indent")? {
        options.indent = indent_unit(&indent)?;
    }
    if let Some(separators) = positional(2, "separators")? {
        if !separators.is_none() {
            let pair: Vec<Value> = separators.try_iter()?.collect();
            match pair.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    options.item_separator = item.as_str().map(str::to_owned);
                    options.key_separator = key.as_str().map(str::to_owned);
                }
                _ => return Err(invalid("separators must be a pair of strings")),
            }
        }
    }
    if let Some(sort_keys) = positional(3, "sort_keys")? {
        options.sort_keys = sort_keys.is_true();
    }
    if args.len() > 4 {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    kwargs.assert_all_used()?;
    dumps(value, &options)
}

/// `indent` as Python takes it: an int is that many spaces (negative: none), a string is used
/// verbatim, `None` means a single line.
fn indent_unit(indent: &Value) -> Result<Option<String>, Error> {
    if indent.is_none() || indent.is_undefined() {
        Ok(None)
    } else if let Some(text) = indent.as_str() {
        Ok(Some(text.to_owned()))
    } else if let Some(width) = indent.as_i64() {
        Ok(Some(" ".repeat(width.max(0) as usize)))
    } else {
        Err(invalid("indent must be an integer, a string or none"))
    }
}

/// Python's `json.dumps(value, ...)`.
pub fn dumps(value: &Value, options: &DumpOptions) -> Result<String, Error> {
    let default_item_separator = if options.indent.is_some() { "," } else { ", " };
    let writer = JsonWriter {
        options,
        item_separator: options
            .item_separator
            .as_deref()
            .unwrap_or(default_item_separator),
        key_separator: options.key_separator.as_deref().unwrap_or(": "),
    };
    let mut out = String::new();
    writer.write_value(&mut out, value, 0)?;
    Ok(out)
}

struct JsonWriter<'a> {
    options: &'a DumpOptions,
    item_separator: &'a str,
    key_separator: &'a str,
}

impl JsonWriter<'_> {
    fn write_value(&self, out: &mut String, value: &Value, depth: usize) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => self.write_number(out, value),
            ValueKind::String => self.write_string(out, value.as_str().unwrap_or_default()),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.write_container(out, ('[', ']'), &items, depth, |out, item, depth| {
                    self.write_value(out, item, depth)
                })?;
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.options.sort_keys {
                    keys.sort();
                }
                self.write_container(out, ('{', '}'), &keys, depth, |out, key, depth| {
                    self.write_key(out, key)?;
                    out.push_str(self.key_separator);
                    self.write_value(out, &value.get_item(key)?, depth)
                })?;
            }
            // Python raises TypeError for objects json cannot serialize (Undefined included).
            kind => {
                return Err(invalid(&format!(
                    "Object of type {kind} is not JSON serializable"
                )))
            }
        }
        Ok(())
    }

    /// Writes `[...]` / `{...}` with Python's layout: empty containers stay `[]`/`{}`, otherwise
    /// with an indent each item goes on its own line one level deeper.
    fn write_container<F>(
        &self,
        out: &mut String,
        (open, close): (char, char),
        items: &[Value],
        depth: usize,
        write_item: F,
    ) -> Result<(), Error>
    where
        F: Fn(&mut String, &Value, usize) -> Result<(), Error>,
    {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (idx, item) in items.iter().enumerate() {
            if idx > 0 {
                out.push_str(self.item_separator);
            }
            self.newline_and_indent(out, depth + 1);
            write_item(out, item, depth + 1)?;
        }
        self.newline_and_indent(out, depth);
        out.push(close);
        Ok(())
    }

    fn newline_and_indent(&self, out: &mut String, depth: usize) {
        if let Some(unit) = &self.options.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(unit);
            }
        }
    }

    /// Python converts non-string keys: `1` → `"1"`, `True` → `"true"`, `None` → `"null"`.
    fn write_key(&self, out: &mut String, key: &Value) -> Result<(), Error> {
        match key.kind() {
            ValueKind::String => self.write_string(out, key.as_str().unwrap_or_default()),
            ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                let mut text = String::new();
                self.write_value(&mut text, key, 0)?;
                self.write_string(out, &text);
            }
            kind => {
                return Err(invalid(&format!(
                    "keys must be str, int, float, bool or None, not {kind}"
                )))
            }
        }
        Ok(())
    }

    fn write_number(&self, out: &mut String, value: &Value) {
        if value.is_integer() {
            let _ = write!(out, "{value}");
            return;
        }
        match f64::try_from(value.clone()) {
            Ok(float) if float.is_nan() => out.push_str("NaN"),
            Ok(float) if float.is_infinite() => {
                out.push_str(if float > 0.0 { "Infinity" } else { "-Infinity" })
            }
            Ok(float) => out.push_str(&float_repr(float)),
            Err(_) => {
                let _ = write!(out, "{value}");
            }
        }
    }

    fn write_string(&self, out: &mut String, text: &str) {
        out.push('"');
        for ch in text.chars() {
            match ch {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.options.ensure_ascii && !c.is_ascii() => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

fn invalid(message: &str) -> Error {
    Error::new(ErrorKind::InvalidOperation, message.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Value {
        Value::from(minijinja::value::Serde(serde_json::json!({
            "name": "f", "text": "é \"q\" \u{1}\n", "n": [1, 2.0, 1e-7, true, null], "empty": {}, "e": []
        })))
    }

    #[test]
    fn default_matches_python() {
        // python: json.dumps(x, ensure_ascii=False)
        let expected = r#"{"name": "f", "text": "é \"q\" \u0001\n", "n": [1, 2.0, 1e-07, true, null], "empty": {}, "e": []}"#;
        assert_eq!(dumps(&sample(), &DumpOptions::default()).unwrap(), expected);
    }

    #[test]
    fn indent_matches_python() {
        // python: json.dumps(x, ensure_ascii=False, indent=2)
        let options = DumpOptions {
            indent: Some("  ".into()),
            ..Default::default()
        };
        let expected = "{\n  \"name\": \"f\",\n  \"text\": \"é \\\"q\\\" \\u0001\\n\",\n  \"n\": [\n    1,\n    2.0,\n    1e-07,\n    true,\n    null\n  ],\n  \"empty\": {},\n  \"e\": []\n}";
        assert_eq!(dumps(&sample(), &options).unwrap(), expected);
    }

    #[test]
    fn ensure_ascii_and_separators_match_python() {
        // python: json.dumps({"k": "é😀"}, ensure_ascii=True, separators=(",", ":"))
        let options = DumpOptions {
            ensure_ascii: true,
            item_separator: Some(",".into()),
            key_separator: Some(":".into()),
            ..Default::default()
        };
        let value = Value::from(minijinja::value::Serde(
            serde_json::json!({"k": "é😀", "l": [1, 2]}),
        ));
        assert_eq!(
            dumps(&value, &options).unwrap(),
            r#"{"k":"\u00e9\ud83d\ude00","l":[1,2]}"#
        );
    }

    #[test]
    fn undefined_is_not_serializable() {
        assert!(dumps(&Value::UNDEFINED, &DumpOptions::default()).is_err());
    }
}
