//! The completions `prompt` and its four shapes.

use serde_json::Value;

use super::ValidationError;

/// One completions prompt before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists.
pub(super) fn parse_prompt(prompt: Value) -> Result<Vec<PromptInput>, ValidationError> {
    const SHAPES: &str = "`prompt` must be a string, a list of strings, a list of token ids or a list of lists of token ids";
    let items = match prompt {
        Value::String(text) => return Ok(vec![PromptInput::Text(text)]),
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => {
            return Err(ValidationError::invalid(
                "prompt",
                "`prompt` must not be an empty list",
            ))
        }
        _ => return Err(ValidationError::invalid("prompt", SHAPES)),
    };
    if items.iter().all(Value::is_string) {
        return Ok(items
            .into_iter()
            .map(|item| PromptInput::Text(item.as_str().unwrap_or_default().to_owned()))
            .collect());
    }
    if items.iter().all(Value::is_number) {
        return Ok(vec![PromptInput::Ids(token_ids(&items, "prompt")?)]);
    }
    if items.iter().all(Value::is_array) {
        return items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let ids = item.as_array().map(Vec::as_slice).unwrap_or_default();
                token_ids(ids, &format!("prompt[{i}]")).map(PromptInput::Ids)
            })
            .collect();
    }
    Err(ValidationError::invalid("prompt", SHAPES))
}

fn token_ids(items: &[Value], param: &str) -> Result<Vec<u32>, ValidationError> {
    items
        .iter()
        .map(|item| {
            item.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| {
                    ValidationError::invalid(param, format!("{param}: `{item}` is not a token id"))
                })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        assert_eq!(
            parse_prompt(json!("hi")).unwrap(),
            vec![PromptInput::Text("hi".into())]
        );
        assert_eq!(
            parse_prompt(json!(["a", "b"])).unwrap(),
            vec![PromptInput::Text("a".into()), PromptInput::Text("b".into())]
        );
        assert_eq!(
            parse_prompt(json!([1, 2])).unwrap(),
            vec![PromptInput::Ids(vec![1, 2])]
        );
        assert_eq!(
            parse_prompt(json!([[1], [2, 3]])).unwrap(),
            vec![PromptInput::Ids(vec![1]), PromptInput::Ids(vec![2, 3])]
        );
        for bad in [
            json!([]),
            json!(5),
            json!(["a", 1]),
            json!([-1]),
            json!([1.5]),
            json!({"a": 1}),
        ] {
            assert_eq!(
                parse_prompt(bad.clone())
                    .unwrap_err()
                    .param()
                    .map(|p| &p[..6]),
                Some("prompt"),
                "{bad}"
            );
        }
    }
}
