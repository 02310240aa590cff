//! Python's `str()`/`repr()` of template values.
//!
//! Jinja2 prints values with Python's `str()`: `True`, `None`, `{'a': 1}`, `1e-05`. minijinja
//! prints `true`, `none`, `{"a": 1}`. Templates such as SmolLM3's write `tool | string` into the
//! prompt, so the router has to print exactly what Python prints.

use std::fmt::Write;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::Error;

/// An argument of a Python-style call `f(a, b, name=c)`: the keyword if given, else the
/// positional argument at `idx`.
pub fn argument(
    args: &[Value],
    kwargs: &Kwargs,
    idx: usize,
    name: &str,
) -> Result<Option<Value>, Error> {
    let keyword: Option<Value> = kwargs.get(name)?;
    Ok(keyword.or_else(|| args.get(idx).cloned()))
}

/// Python's `str(value)`: strings as they are, everything else as `repr`.
pub fn to_str(value: &Value) -> Result<String, Error> {
    match value.as_str() {
        Some(text) => Ok(text.to_owned()),
        None if value.is_undefined() => Ok(String::new()),
        None => to_repr(value),
    }
}

/// Python's `repr(value)` for the JSON-like values a chat template sees.
pub fn to_repr(value: &Value) -> Result<String, Error> {
    let mut out = String::new();
    write_repr(&mut out, value)?;
    Ok(out)
}

fn write_repr(out: &mut String, value: &Value) -> Result<(), Error> {
    match value.kind() {
        // Jinja2's default Undefined prints as the empty string.
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value),
        ValueKind::String => write_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let (open, close) = if value.is_tuple() {
                ('(', ')')
            } else {
                ('[', ']')
            };
            out.push(open);
            let mut count = 0;
            for (idx, item) in value.try_iter()?.enumerate() {
                if idx > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &item)?;
                count += 1;
            }
            // A one-element tuple is written `(x,)` by Python.
            if value.is_tuple() && count == 1 {
                out.push(',');
            }
            out.push(close);
        }
        ValueKind::Map => {
            out.push('{');
            for (idx, key) in value.try_iter()?.enumerate() {
                if idx > 0 {
                    out.push_str(", ");
                }
                write_repr(out, &key)?;
                out.push_str(": ");
                write_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        // Bytes, callables, namespaces: no JSON-like shape; minijinja's own text is the best
        // we have, and no known chat template prints them.
        _ => {
            let _ = write!(out, "{value}");
        }
    }
    Ok(())
}

fn write_number(out: &mut String, value: &Value) {
    if value.is_integer() {
        let _ = write!(out, "{value}");
    } else if let Ok(float) = f64::try_from(value.clone()) {
        out.push_str(&float_repr(float));
    } else {
        let _ = write!(out, "{value}");
    }
}

/// Python's `repr(float)`: the shortest round-tripping digits, positional notation for
/// exponents in [-4, 16), scientific (`1e-05`, `1.5e+16`) outside, always a `.0` or exponent.
pub fn float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    // Rust's `{:e}` gives the same shortest digits Python uses, e.g. "1.5e16", "-2e-5".
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("`{:e}` always writes an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` writes an integer exponent");
    if (-4..16).contains(&exponent) {
        let positional = format!("{value}");
        if positional.contains('.') {
            positional
        } else {
            positional + ".0"
        }
    } else {
        let sign = if exponent < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exponent.abs())
    }
}

/// Python's `repr(str)`: single quotes unless the text holds a single quote and no double
/// quote; backslash escapes for the quote, the backslash and non-printable characters.
fn write_str_repr(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for ch in text.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if is_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
}

/// An approximation of Python's `str.isprintable` without Unicode tables: control characters,
/// separators other than the ASCII space, and the common format characters are not printable.
fn is_printable(ch: char) -> bool {
    let code = ch as u32;
    !matches!(
        code,
        0x00..=0x1f
            | 0x7f..=0xa0
            | 0xad
            | 0x1680
            | 0x180e
            | 0x2000..=0x200f
            | 0x2028..=0x202f
            | 0x205f..=0x206f
            | 0x3000
            | 0xd800..=0xf8ff
            | 0xfeff
            | 0xfff9..=0xfffb
            | 0xe0000..=0x10ffff
    )
}

/// Python's `str.title()`: a cased letter is upper-cased when it follows a character that is
/// not a letter, lower-cased otherwise (so `"it's"` becomes `"It'S"`, as in Python).
pub fn title(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut previous_cased = false;
    for ch in text.chars() {
        if previous_cased {
            out.extend(ch.to_lowercase());
        } else {
            out.extend(ch.to_uppercase());
        }
        previous_cased = ch.is_lowercase() || ch.is_uppercase();
    }
    out
}

/// Python's `str.splitlines()`: splits at every line boundary Python knows (`\r\n` counts once),
/// without the line endings, and no empty last element for a trailing newline.
pub fn splitlines(text: &str) -> Vec<&str> {
    let mut lines = Vec::new();
    let mut start = 0;
    let mut chars = text.char_indices().peekable();
    while let Some((idx, ch)) = chars.next() {
        let is_break = matches!(
            ch,
            '\n' | '\r'
                | '\u{0b}'
                | '\u{0c}'
                | '\u{1c}'
                | '\u{1d}'
                | '\u{1e}'
                | '\u{85}'
                | '\u{2028}'
                | '\u{2029}'
        );
        if !is_break {
            continue;
        }
        lines.push(&text[start..idx]);
        start = idx + ch.len_utf8();
        if ch == '\r' && chars.peek().map(|(_, next)| *next) == Some('\n') {
            chars.next();
            start += 1;
        }
    }
    if start < text.len() {
        lines.push(&text[start..]);
    }
    lines
}

/// Jinja2's `indent` filter: every line but the first (and the first too with `first`) gets
/// `unit` in front; blank lines only with `blank`. Lines are split as Python's `splitlines` does
/// and rejoined with `\n`, and a trailing newline survives, as in Jinja2.
pub fn indent(text: &str, unit: &str, first: bool, blank: bool) -> String {
    // Jinja2 appends a newline before splitting so that a trailing newline survives.
    let padded = format!("{text}\n");
    let lines = splitlines(&padded);
    let mut out = String::with_capacity(text.len() + unit.len() * lines.len());
    if first {
        out.push_str(unit);
    }
    for (idx, line) in lines.iter().enumerate() {
        if idx > 0 {
            out.push('\n');
            if blank || !line.is_empty() {
                out.push_str(unit);
            }
        }
        out.push_str(line);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_print_like_python() {
        // Expected strings are what CPython 3 prints for repr(x).
        let cases = [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (123456789.125, "123456789.125"),
            (f64::INFINITY, "inf"),
        ];
        for (value, expected) in cases {
            assert_eq!(float_repr(value), expected, "{value}");
        }
    }

    #[test]
    fn values_print_like_python_str() {
        let value = Value::from(minijinja::value::Serde(serde_json::json!({
            "b": [1, 2.5, true, null], "a": "it's", "c": "say \"hi\" and 'bye'\n", "d": "\u{a0}é"
        })));
        assert_eq!(
            to_str(&value).unwrap(),
            r#"{'b': [1, 2.5, True, None], 'a': "it's", 'c': 'say "hi" and \'bye\'\n', 'd': '\xa0é'}"#
        );
        assert_eq!(to_str(&Value::from("plain")).unwrap(), "plain");
    }

    #[test]
    fn indent_matches_jinja2() {
        // jinja2: Environment().from_string("{{ s|indent(2, first=F, blank=B) }}")
        assert_eq!(indent("{\n", "    ", true, false), "    {\n");
        assert_eq!(indent("a\n\nb", "  ", false, false), "a\n\n  b");
        assert_eq!(indent("a\n\nb\n", "  ", false, true), "a\n  \n  b\n  ");
        assert_eq!(indent("a\r\nb", "  ", false, false), "a\n  b");
        assert_eq!(indent("", "  ", true, false), "  ");
    }

    #[test]
    fn title_matches_python() {
        assert_eq!(title("hello wORLD it's a-b"), "Hello World It'S A-B");
    }
}
