//! Python-style calls, as Llama 3.2 and Llama 4 write them with their pythonic templates: the
//! whole reply is a Python list of calls with keyword arguments, `[get_weather(city="Paris",
//! days=3), get_time()]`, maybe between Llama 4's `<|python_start|>` and `<|python_end|>`. The
//! values are Python literals (strings in either quote, numbers, `True`/`False`/`None`, lists,
//! tuples, dicts), turned into the JSON object OpenAI's `arguments` holds. A reply that is not
//! such a list is text.

use serde_json::{Map, Number, Value};

use super::{ParsedCall, ParsedOutput};

pub(super) const START: &str = "<|python_start|>";
pub(super) const END: &str = "<|python_end|>";

/// `None` when `text` is not a list of well-formed calls (of declared functions).
pub(super) fn parse(text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
    let body = body(text)?;
    let mut reader = Reader::new(body);
    let mut tool_calls = Vec::new();
    reader.expect('[')?;
    loop {
        let call = reader.call()?;
        if declared.is_some_and(|names| !names.contains(&call.name)) {
            return None;
        }
        tool_calls.push(call);
        if reader.take(',') {
            continue;
        }
        reader.expect(']')?;
        break;
    }
    reader.at_end().then_some(ParsedOutput {
        content: None,
        tool_calls,
    })
}

/// The reply without surrounding whitespace and Llama 4's tags; `None` when it does not open
/// a list.
pub(super) fn body(text: &str) -> Option<&str> {
    let trimmed = text.trim();
    let inner = match trimmed.strip_prefix(START) {
        Some(rest) => rest.strip_suffix(END).unwrap_or(rest).trim(),
        None => trimmed,
    };
    inner.starts_with('[').then_some(inner)
}

/// Reads Python calls and literals left to right; every step skips whitespace first and
/// answers `None` when the text ends or differs.
pub(super) struct Reader<'a> {
    text: &'a str,
    pub(super) at: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(text: &'a str) -> Self {
        Self { text, at: 0 }
    }

    fn rest(&self) -> &'a str {
        &self.text[self.at..]
    }

    fn skip_whitespace(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start().len();
    }

    fn at_end(&mut self) -> bool {
        self.skip_whitespace();
        self.rest().is_empty()
    }

    /// Consumes `c` if it comes next.
    pub(super) fn take(&mut self, c: char) -> bool {
        self.skip_whitespace();
        let found = self.rest().starts_with(c);
        if found {
            self.at += c.len_utf8();
        }
        found
    }

    pub(super) fn expect(&mut self, c: char) -> Option<()> {
        self.take(c).then_some(())
    }

    /// A (dotted) Python identifier.
    pub(super) fn identifier(&mut self) -> Option<&'a str> {
        self.skip_whitespace();
        let rest = self.rest();
        let length = rest
            .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.'))
            .unwrap_or(rest.len());
        let name = &rest[..length];
        if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
            return None;
        }
        self.at += length;
        Some(name)
    }

    /// `name(key=value, …)`, its keywords as a JSON object.
    pub(super) fn call(&mut self) -> Option<ParsedCall> {
        let name = self.identifier()?.to_owned();
        self.expect('(')?;
        let mut arguments = Map::new();
        if !self.take(')') {
            loop {
                let key = self.identifier()?.to_owned();
                self.expect('=')?;
                arguments.insert(key, self.value()?);
                if self.take(',') {
                    // A trailing comma before `)` is Python too.
                    if self.take(')') {
                        break;
                    }
                    continue;
                }
                self.expect(')')?;
                break;
            }
        }
        Some(ParsedCall {
            name,
            arguments: Value::Object(arguments).to_string(),
        })
    }

    fn value(&mut self) -> Option<Value> {
        self.skip_whitespace();
        let first = self.rest().chars().next()?;
        match first {
            '\'' | '"' => self.string().map(Value::String),
            '[' | '(' => {
                let close = if first == '[' { ']' } else { ')' };
                self.at += 1;
                let items = self.items(close, |reader| reader.value())?;
                Some(Value::Array(items))
            }
            '{' => {
                self.at += 1;
                let pairs = self.items('}', |reader| {
                    let key = match reader.value()? {
                        Value::String(key) => key,
                        other => other.to_string(),
                    };
                    reader.expect(':')?;
                    Some((key, reader.value()?))
                })?;
                Some(Value::Object(pairs.into_iter().collect()))
            }
            _ => self.word(),
        }
    }

    /// Items up to `close`, comma-separated (a trailing comma allowed).
    fn items<T>(
        &mut self,
        close: char,
        mut item: impl FnMut(&mut Self) -> Option<T>,
    ) -> Option<Vec<T>> {
        let mut items = Vec::new();
        while !self.take(close) {
            items.push(item(self)?);
            if !self.take(',') {
                self.expect(close)?;
                break;
            }
        }
        Some(items)
    }

    /// `True`, `False`, `None`, or a number.
    fn word(&mut self) -> Option<Value> {
        let rest = self.rest();
        let length = rest
            .find(|c: char| !(c.is_alphanumeric() || matches!(c, '.' | '-' | '+' | '_')))
            .unwrap_or(rest.len());
        let word = &rest[..length];
        let value = match word {
            "True" => Value::Bool(true),
            "False" => Value::Bool(false),
            "None" => Value::Null,
            _ => number(&word.replace('_', ""))?,
        };
        self.at += length;
        Some(value)
    }

    /// A quoted string with Python's common escapes.
    fn string(&mut self) -> Option<String> {
        let mut chars = self.rest().char_indices();
        let (_, quote) = chars.next()?;
        let mut out = String::new();
        while let Some((i, c)) = chars.next() {
            match c {
                _ if c == quote => {
                    self.at += i + c.len_utf8();
                    return Some(out);
                }
                '\\' => {
                    let (_, escaped) = chars.next()?;
                    out.push(match escaped {
                        'n' => '\n',
                        't' => '\t',
                        'r' => '\r',
                        '0' => '\0',
                        'u' | 'x' => {
                            let digits = if escaped == 'u' { 4 } else { 2 };
                            let hex: String = (0..digits)
                                .filter_map(|_| chars.next().map(|(_, c)| c))
                                .collect();
                            char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?
                        }
                        other => other,
                    });
                }
                '\n' => return None,
                _ => out.push(c),
            }
        }
        None
    }
}

fn number(word: &str) -> Option<Value> {
    if let Ok(integer) = word.parse::<i64>() {
        return Some(Value::Number(integer.into()));
    }
    let float: f64 = word.parse().ok()?;
    Number::from_f64(float).map(Value::Number)
}
