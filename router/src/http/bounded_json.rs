//! A request body parsed into a `serde_json::Value`, refused as soon as it holds more arrays and
//! objects than any request needs.
//!
//! Why: a `Value` costs far more than the JSON that spells it. `[1], ` is 5 bytes of a body and
//! about 180 bytes as a one-element array `Value` (its slot in the outer array and a heap
//! allocation), so a 4 MB body of 800,000 one-token prompts took the router to 600 MB before
//! validation refused it for having more than 2,048 prompts. Counting while parsing stops such
//! a body after `MAX_CONTAINERS` arrays and objects, a few MB in.
//!
//! A single array is bounded too: `[1, 1, …]` costs 32 bytes a number as a `Value` against 2 to
//! 3 in the body. No field takes more items than the server's longest prompt or its 2,048
//! prompts, so an array longer than `max_items` (the caller's: a few times that) is refused as
//! it is read.
//!
//! The bounds are structural, not per field: an unknown field (accepted without effect) or a
//! nested array of messages grows the tree as much as `prompt` does. Real requests hold far
//! fewer: 2,048 prompts are 2,049 arrays; a conversation of 10,000 messages with content parts
//! about 30,000.

use std::cell::Cell;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

/// The most arrays and objects one request body may hold.
pub const MAX_CONTAINERS: usize = 65_536;

#[derive(Debug)]
pub enum BoundedJsonError {
    /// Not JSON (serde_json's message).
    Syntax(String),
    /// More than `MAX_CONTAINERS` arrays and objects.
    TooManyContainers,
    /// An array of more than `max_items` items.
    LongArray,
}

/// `bytes` as a `Value`, counting its arrays and objects and each array's items as they are
/// read.
pub fn parse_bounded(bytes: &[u8], max_items: usize) -> Result<Value, BoundedJsonError> {
    let budget = Budget {
        left: Cell::new(MAX_CONTAINERS),
        max_items,
        exceeded: Cell::new(None),
    };
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let parsed = Node(&budget)
        .deserialize(&mut deserializer)
        .and_then(|value| deserializer.end().map(|()| value));
    parsed.map_err(|error| match budget.exceeded.take() {
        Some(bound) => bound,
        None => BoundedJsonError::Syntax(error.to_string()),
    })
}

struct Budget {
    left: Cell<usize>,
    max_items: usize,
    /// Which bound stopped the parse.
    exceeded: Cell<Option<BoundedJsonError>>,
}

impl Budget {
    fn take<E: serde::de::Error>(&self) -> Result<(), E> {
        match self.left.get().checked_sub(1) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => self.exceed(BoundedJsonError::TooManyContainers),
        }
    }

    fn exceed<E: serde::de::Error>(&self, bound: BoundedJsonError) -> Result<(), E> {
        self.exceeded.set(Some(bound));
        Err(E::custom("the request body is over a bound"))
    }
}

/// One JSON value, built as serde_json builds it, its containers taken from the budget.
#[derive(Clone, Copy)]
struct Node<'a>(&'a Budget);

impl<'de> DeserializeSeed<'de> for Node<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Node<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }

    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }

    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        // JSON has no NaN or infinity, so every parsed float is a Number.
        Ok(Number::from_f64(value).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }

    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.0.take()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self)? {
            if items.len() == self.0.max_items {
                self.0.exceed(BoundedJsonError::LongArray)?;
            }
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.0.take()?;
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(self)?;
            object.insert(key, value);
        }
        Ok(Value::Object(object))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_as_serde_json_does() {
        let text = r#"{"b": [1, -2, 3.5, "x", null, true, {"c": []}], "a": {"é": "\u00e9"}}"#;
        let ours = parse_bounded(text.as_bytes(), 100).unwrap();
        let theirs: Value = serde_json::from_str(text).unwrap();
        assert_eq!(ours, theirs);
        // Key order kept, as the `preserve_order` feature keeps it.
        let keys: Vec<&String> = ours.as_object().unwrap().keys().collect();
        assert_eq!(keys, ["b", "a"]);
    }

    #[test]
    fn refuses_more_containers_than_the_bound_and_accepts_the_bound() {
        let body = |arrays: usize| format!("{{\"prompt\": [{}]}}", vec!["[1]"; arrays].join(","));
        // The object and the outer array are two containers.
        let items = MAX_CONTAINERS;
        assert!(parse_bounded(body(MAX_CONTAINERS - 2).as_bytes(), items).is_ok());
        assert!(matches!(
            parse_bounded(body(MAX_CONTAINERS - 1).as_bytes(), items),
            Err(BoundedJsonError::TooManyContainers)
        ));
    }

    #[test]
    fn refuses_an_array_longer_than_max_items_wherever_it_is() {
        let ids = |count: usize| vec!["7"; count].join(",");
        let flat = |count: usize| format!("{{\"prompt\": [{}]}}", ids(count));
        assert!(parse_bounded(flat(300).as_bytes(), 300).is_ok());
        assert!(matches!(
            parse_bounded(flat(301).as_bytes(), 300),
            Err(BoundedJsonError::LongArray)
        ));
        let nested = format!("{{\"junk\": {{\"a\": [[{}]]}}}}", ids(301));
        assert!(matches!(
            parse_bounded(nested.as_bytes(), 300),
            Err(BoundedJsonError::LongArray)
        ));
    }

    #[test]
    fn syntax_errors_and_trailing_text_are_syntax_errors() {
        for text in ["{\"a\": ", "{} {}", "[1,]", ""] {
            assert!(
                matches!(
                    parse_bounded(text.as_bytes(), 10),
                    Err(BoundedJsonError::Syntax(_))
                ),
                "{text:?}"
            );
        }
    }
}
