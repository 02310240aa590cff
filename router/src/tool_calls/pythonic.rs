//! Python-style calls, as Llama 3.2 and Llama 4 write them with their pythonic templates: the
//! whole reply is a Python list of calls with keyword arguments, `[get_weather(city="Paris",
//! days=3), get_time()]`, maybe between Llama 4's `<|python_start|>` and `<|python_end|>`. The
//! values are Python literals (strings in either quote, numbers, `True`/`False`/`None`, lists,
//! tuples, dicts), turned into the JSON object OpenAI's `arguments` holds. A reply that is not
//! such a list is text.
//!
//! The grammar holds a reply to a Python list of `name(key=value, …)` calls of the declared
//! functions, each keyword one of the function's parameters, each value a Python literal of the
//! parameter's JSON-schema type: a string (only the `enum`'s, when it has one), an integer, a
//! number, `True`/`False`, `None`, a list or a dict; any literal where the schema gives no
//! single type. Ranges, patterns and which keywords are required are not held, unlike
//! the JSON formats' `%json` schemas: the values are Python's syntax, not JSON's.

use std::borrow::Cow;

use serde_json::{Map, Number, Value};

use super::format::ToolCallFormat;
use super::lark::{call_choice, string, SpecialId};
use super::parsed::{ParsedCall, ParsedOutput};
use super::partial::{PartialCall, Scan};
use super::request::FunctionSpec;

const START: &str = "<|python_start|>";
const END: &str = "<|python_end|>";

pub(super) struct Pythonic;

impl ToolCallFormat for Pythonic {
    fn markers(&self) -> &'static [&'static str] {
        &[START, END]
    }

    /// The pythonic templates' instruction (vLLM's Llama 3.2 one, Llama 4's own).
    fn taught_by(&self, template: &str) -> bool {
        template.contains("[func_name1(")
    }

    fn call_instruction(&self) -> &'static str {
        "a Python list of calls with keyword arguments, [function_name(argument=value, \
         ...), ...], and nothing else."
    }

    fn grammar(
        &self,
        forced: bool,
        several: bool,
        functions: &[&FunctionSpec],
        _special_id: SpecialId,
    ) -> (String, Vec<String>) {
        let (start, mut rules) = layout_rules(forced, several);
        rules.extend(call_rules(functions));
        (start, rules)
    }

    /// `None` when `text` is not a list of well-formed calls (of declared functions).
    fn read(&self, text: &str, declared: Option<&[String]>) -> Option<ParsedOutput> {
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

    /// A Python list of calls: each call's name once `name(` is written, its arguments once the
    /// call is complete. Text that cannot open such a list is content.
    fn scan<'a>(&self, text: &'a str) -> Scan<'a> {
        let mut scan = Scan::default();
        let trimmed = text.trim_start();
        if trimmed.is_empty() || START.starts_with(trimmed) {
            return scan;
        }
        let Some(body) = body(text) else {
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

    /// A marker, or a reply that opens the list.
    fn opens_calls(&self, text: &str) -> bool {
        self.markers().iter().any(|marker| text.contains(marker)) || body(text).is_some()
    }
}

/// The reply without surrounding whitespace and Llama 4's tags; `None` when it does not open
/// a list.
fn body(text: &str) -> Option<&str> {
    let trimmed = text.trim();
    let inner = match trimmed.strip_prefix(START) {
        Some(rest) => rest.strip_suffix(END).unwrap_or(rest).trim(),
        None => trimmed,
    };
    inner.starts_with('[').then_some(inner)
}

/// Reads Python calls and literals left to right; every step skips whitespace first and
/// answers `None` when the text ends or differs.
struct Reader<'a> {
    text: &'a str,
    at: usize,
}

impl<'a> Reader<'a> {
    fn new(text: &'a str) -> Self {
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
    fn take(&mut self, c: char) -> bool {
        self.skip_whitespace();
        let found = self.rest().starts_with(c);
        if found {
            self.at += c.len_utf8();
        }
        found
    }

    fn expect(&mut self, c: char) -> Option<()> {
        self.take(c).then_some(())
    }

    /// A (dotted) Python identifier.
    fn identifier(&mut self) -> Option<&'a str> {
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
    fn call(&mut self) -> Option<ParsedCall> {
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

/// Python literals, written as the grammar lets the model write them.
const LITERALS: &[&str] = &[
    r#"py_value: PY_STRING | PY_NUMBER | "True" | "False" | "None" | py_list | py_dict"#,
    r#"py_list: "[" (py_value (", " py_value)*)? "]""#,
    r#"py_dict: "{" (PY_STRING ": " py_value (", " PY_STRING ": " py_value)*)? "}""#,
    r#"PY_STRING: /'([^'\\\n]|\\.)*'/ | /"([^"\\\n]|\\.)*"/"#,
    r#"PY_INT: /-?[0-9]+/"#,
    r#"PY_NUMBER: /-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?/"#,
];

/// The start rule and the list's rules; in `auto`, text that does not open with `[` instead.
fn layout_rules(forced: bool, several: bool) -> (String, Vec<String>) {
    let calls = match several {
        true => r#"calls: "[" call (", " call)* "]""#,
        false => r#"calls: "[" call "]""#,
    };
    let mut rules = vec![calls.to_owned()];
    rules.extend(LITERALS.iter().map(|rule| (*rule).to_owned()));
    let start = if forced {
        "calls".to_owned()
    } else {
        rules.push(r"PLAIN: /([^\[\s](.|\n)*)?/".to_owned());
        "PLAIN | calls".to_owned()
    };
    (start, rules)
}

/// `call`: one call of any of `functions`, keywords from its parameters.
fn call_rules(functions: &[&FunctionSpec]) -> Vec<String> {
    let mut rules = vec![call_choice(functions)];
    for (i, function) in functions.iter().enumerate() {
        let opening = string(&format!("{}(", function.name));
        let properties = function.parameters["properties"]
            .as_object()
            .filter(|properties| !properties.is_empty());
        let Some(properties) = properties else {
            rules.push(format!("fn_{i}: {opening} \")\""));
            continue;
        };
        rules.push(format!(
            "fn_{i}: {opening} (kwarg_{i} (\", \" kwarg_{i})*)? \")\""
        ));
        let keywords: Vec<String> = (0..properties.len())
            .map(|j| format!("kw_{i}_{j}"))
            .collect();
        rules.push(format!("kwarg_{i}: {}", keywords.join(" | ")));
        for (j, (key, schema)) in properties.iter().enumerate() {
            rules.push(format!(
                "kw_{i}_{j}: {} {}",
                string(&format!("{key}=")),
                value_rule(schema)
            ));
        }
    }
    rules
}

/// The literal a parameter's schema asks for.
fn value_rule(schema: &Value) -> String {
    if let Some(values) = schema["enum"].as_array() {
        let choices: Vec<String> = values.iter().filter_map(enum_literal).collect();
        if choices.len() == values.len() && !choices.is_empty() {
            return format!("({})", choices.join(" | "));
        }
    }
    match schema["type"].as_str() {
        Some("string") => "PY_STRING",
        Some("integer") => "PY_INT",
        Some("number") => "PY_NUMBER",
        Some("boolean") => r#"("True" | "False")"#,
        Some("null") => r#""None""#,
        Some("array") => "py_list",
        Some("object") => "py_dict",
        _ => "py_value",
    }
    .to_owned()
}

/// An enum value as a Python literal (strings in single quotes, as Python's `repr`).
fn enum_literal(value: &Value) -> Option<String> {
    let literal = match value {
        Value::String(text) if !text.contains(['\'', '\\', '\n']) => format!("'{text}'"),
        Value::Number(number) => number.to_string(),
        Value::Bool(true) => "True".to_owned(),
        Value::Bool(false) => "False".to_owned(),
        Value::Null => "None".to_owned(),
        _ => return None,
    };
    Some(string(&literal))
}
