//! The minijinja environment configured the way transformers configures Jinja2 for chat
//! templates (`transformers.utils.chat_template_utils._cached_compile_jinja_template`):
//! `trim_blocks`, `lstrip_blocks`, loop controls, a `{% generation %}` block, the globals
//! `raise_exception`, `strftime_now`, `namespace` and `dict`, a Python-style `tojson`, Python
//! string methods, and values printed with Python's `str()`.

use std::fmt::Write;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind, State, UndefinedBehavior};

use super::{pyjson, python, source, Clock};

/// Name under which the one chat template is stored in its environment.
pub const TEMPLATE_NAME: &str = "chat_template";

/// The error `raise_exception(msg)` attaches to the minijinja error, so that `render` can tell a
/// template's deliberate refusal (the user's fault, HTTP 400) from a broken template.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RaisedByTemplate(pub String);

/// Builds the environment holding `source` (already passed through [`source::prepare`]).
pub fn build(source: String, clock: Clock) -> Result<Environment<'static>, Error> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?,
    );
    // Jinja2's default `Undefined`: prints as "", iterates as empty, errors on attribute access.
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    // Chat templates produce plain text; Jinja2 in transformers does not autoescape.
    env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
    env.set_formatter(|out, _state, value| {
        let text = python::to_str(value)?;
        out.write_str(&text).map_err(Error::from)
    });
    env.set_unknown_method_callback(python_method);

    env.add_filter("tojson", pyjson::tojson_filter);
    env.add_filter("string", |value: &Value| python::to_str(value));
    env.add_filter("indent", indent_filter);
    env.add_filter(source::ITERABLE_FILTER, python_iterable);
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", move |format: &str| {
        strftime_now(&clock, format)
    });

    env.add_template_owned(TEMPLATE_NAME, source)?;
    Ok(env)
}

/// Jinja2's `indent(width=4, first=False, blank=False)`; `width` may be a string.
fn indent_filter(text: &str, args: &[Value], kwargs: Kwargs) -> Result<String, Error> {
    let argument = |idx, name| python::argument(args, &kwargs, idx, name);
    let unit = match argument(0, "width")? {
        None => "    ".to_owned(),
        Some(width) => match (width.as_str(), width.as_i64()) {
            (Some(text), _) => text.to_owned(),
            (None, Some(count)) => " ".repeat(count.max(0) as usize),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "indent width must be an int or a string",
                ))
            }
        },
    };
    let first = argument(1, "first")?.is_some_and(|v| v.is_true());
    let blank = argument(2, "blank")?.is_some_and(|v| v.is_true());
    if args.len() > 3 {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    kwargs.assert_all_used()?;
    Ok(python::indent(text, &unit, first, blank))
}

/// Jinja2 raises when a `for` loop meets None; minijinja would loop zero times.
fn python_iterable(value: Value) -> Result<Value, Error> {
    if value.is_none() {
        Err(Error::new(
            ErrorKind::InvalidOperation,
            "'NoneType' object is not iterable",
        ))
    } else {
        Ok(value)
    }
}

fn raise_exception(message: &str) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.to_owned())
        .with_source(RaisedByTemplate(message.to_owned())))
}

fn strftime_now(clock: &Clock, format: &str) -> Result<String, Error> {
    let now = match clock {
        Clock::Local => chrono::Local::now().naive_local(),
        Clock::Fixed(fixed) => *fixed,
    };
    let mut out = String::new();
    write!(out, "{}", now.format(format)).map_err(|_| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        )
    })?;
    Ok(out)
}

/// Python string methods the templates call that minijinja-contrib's pycompat lacks or
/// implements differently, then pycompat's for the rest (`strip`, `split`, `items`, `get`, …).
fn python_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(text) = value.as_str() {
        match method {
            "title" => {
                let () = minijinja::value::from_args(args)?;
                return Ok(Value::from(python::title(text)));
            }
            "split" if args.is_empty() || args[0].is_none() => {
                return split_whitespace(text, args);
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Python's `str.split()` / `str.split(None, maxsplit)`: split on runs of whitespace, no empty
/// strings, leading whitespace ignored, the remainder after `maxsplit` splits kept whole.
fn split_whitespace(text: &str, args: &[Value]) -> Result<Value, Error> {
    let max_splits = match args.get(1) {
        Some(value) => value.as_i64().ok_or_else(|| {
            Error::new(ErrorKind::InvalidOperation, "maxsplit must be an integer")
        })?,
        None => -1,
    };
    if args.len() > 2 {
        return Err(Error::from(ErrorKind::TooManyArguments));
    }
    let mut parts = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        if max_splits >= 0 && parts.len() as i64 == max_splits {
            parts.push(Value::from(rest));
            break;
        }
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        parts.push(Value::from(&rest[..end]));
        rest = rest[end..].trim_start();
    }
    Ok(Value::from(parts))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_without_separator_matches_python() {
        let parts = split_whitespace("  a b\t\nc  ", &[]).unwrap();
        assert_eq!(parts.to_string(), "['a', 'b', 'c']");
        let parts = split_whitespace(" a b  c ", &[Value::from(()), Value::from(1)]).unwrap();
        assert_eq!(parts.to_string(), "['a', 'b  c ']");
    }
}
