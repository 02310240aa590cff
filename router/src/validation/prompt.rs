//! The completions `prompt` and its four shapes.

use serde_json::Value;

use super::bounds::{too_long, PromptLimits};
use super::ValidationError;

/// One completions prompt before tokenization.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// `prompt` (or embeddings' `input`, named `param`): a string, a list of strings, a list of
/// token ids, or a list of token-id lists. The number of prompts and the length of each
/// token-id list are checked against `limits` before anything is converted.
pub(super) fn parse_prompt(
    prompt: Value,
    limits: &PromptLimits,
    param: &str,
) -> Result<Vec<PromptInput>, ValidationError> {
    let shapes = || {
        ValidationError::invalid(
            param,
            format!(
                "`{param}` must be a string, a list of strings, a list of token ids or a list \
                 of lists of token ids"
            ),
        )
    };
    let check_count = |count: usize| limits.request.check_choices(count, limits.n, param);
    let check_ids = |items: &[Value], param: &str| {
        if items.len() > limits.max_input_tokens as usize {
            return Err(too_long(
                param,
                &items.len().to_string(),
                limits.max_input_tokens,
            ));
        }
        token_ids(items, param)
    };
    let items = match prompt {
        Value::String(text) => {
            check_count(1)?;
            return Ok(vec![PromptInput::Text(text)]);
        }
        Value::Array(items) if !items.is_empty() => items,
        Value::Array(_) => {
            return Err(ValidationError::invalid(
                param,
                format!("`{param}` must not be an empty list"),
            ))
        }
        _ => return Err(shapes()),
    };
    if items.iter().all(Value::is_number) {
        check_count(1)?;
        return Ok(vec![PromptInput::Ids(check_ids(&items, param)?)]);
    }
    check_count(items.len())?;
    if items.iter().all(Value::is_string) {
        return Ok(items
            .into_iter()
            .map(|item| PromptInput::Text(item.as_str().unwrap_or_default().to_owned()))
            .collect());
    }
    if items.iter().all(Value::is_array) {
        return items
            .iter()
            .enumerate()
            .map(|(i, item)| {
                let ids = item.as_array().map(Vec::as_slice).unwrap_or_default();
                check_ids(ids, &format!("{param}[{i}]")).map(PromptInput::Ids)
            })
            .collect();
    }
    Err(shapes())
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
    use crate::validation::bounds::{RequestBounds, MAX_PROMPTS};
    use serde_json::json;

    const LIMITS: PromptLimits = PromptLimits {
        request: RequestBounds {
            max_choices_per_request: 4096,
            max_request_kv_share: 0.5,
            block_size: 16,
            max_request_blocks: 1000,
        },
        n: 1,
        max_input_tokens: 8,
    };

    fn parse(prompt: Value) -> Result<Vec<PromptInput>, ValidationError> {
        parse_prompt(prompt, &LIMITS, "prompt")
    }

    #[test]
    fn counts_and_id_lengths_are_refused_before_conversion() {
        let many = Value::Array(vec![json!("a"); MAX_PROMPTS + 1]);
        assert!(parse(many)
            .unwrap_err()
            .to_string()
            .contains("at most 2048"));
        let n = PromptLimits { n: 3, ..LIMITS };
        let error = parse_prompt(Value::Array(vec![json!([1]); 1366]), &n, "prompt").unwrap_err();
        assert!(
            error.to_string().contains("--max-choices-per-request"),
            "{error}"
        );
        let long = parse(json!([[1], [1, 2, 3, 4, 5, 6, 7, 8, 9]])).unwrap_err();
        assert_eq!(
            (long.code(), long.param()),
            ("context_length_exceeded", Some("prompt[1]"))
        );
        assert!(long.to_string().contains("--max-input-tokens"));
        assert_eq!(
            parse(json!([1, 1, 1, 1, 1, 1, 1, 1, 1]))
                .unwrap_err()
                .code(),
            "context_length_exceeded"
        );
    }

    #[test]
    fn prompt_shapes() {
        assert_eq!(
            parse(json!("hi")).unwrap(),
            vec![PromptInput::Text("hi".into())]
        );
        assert_eq!(
            parse(json!(["a", "b"])).unwrap(),
            vec![PromptInput::Text("a".into()), PromptInput::Text("b".into())]
        );
        assert_eq!(
            parse(json!([1, 2])).unwrap(),
            vec![PromptInput::Ids(vec![1, 2])]
        );
        assert_eq!(
            parse(json!([[1], [2, 3]])).unwrap(),
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
                parse(bad.clone()).unwrap_err().param().map(|p| &p[..6]),
                Some("prompt"),
                "{bad}"
            );
        }
    }
}
