//! `/v1/embeddings`' `input`: the token ids of each input, checked as completions prompts are
//! (the same four shapes, lengths and vocabulary), except that nothing is generated. Inputs are
//! not choices: `--max-choices-per-request` does not count them. OpenAI's own limits do: at
//! most 2,048 inputs, and 300,000 tokens over all of them.

use serde_json::Value;

use super::bounds::{check_text_length, PromptLimits, RequestBounds};
use super::prompt::{parse_prompt, PromptInput};
use super::{ModelAssets, ValidationError, Validator};

/// Most tokens over all inputs of one request, as OpenAI's embeddings endpoint allows.
const MAX_EMBEDDING_REQUEST_TOKENS: u64 = 300_000;

impl Validator {
    /// Each input's token ids, in input order: texts tokenized (with the tokenizer's special
    /// tokens unless `add_special_tokens` is false), ids taken as they are. Errors name the
    /// input (`input[2]`) when there are several.
    pub async fn embedding_inputs(
        &self,
        assets: &ModelAssets,
        input: Option<Value>,
        add_special_tokens: bool,
    ) -> Result<Vec<Vec<u32>>, ValidationError> {
        let limits = PromptLimits {
            // Only their count bounds the inputs: at most `MAX_PROMPTS` (2,048, OpenAI's limit
            // on inputs too), checked by `parse_prompt`.
            request: RequestBounds {
                max_choices_per_request: u32::MAX,
                ..self.bounds
            },
            n: 1,
            max_input_tokens: self.limits.max_input_tokens,
        };
        let input = input.ok_or_else(|| ValidationError::missing("input"))?;
        let inputs = parse_prompt(input, &limits, "input")?;
        let several = inputs.len() > 1;
        let param = |index: usize| match several {
            true => format!("input[{index}]"),
            false => "input".to_owned(),
        };
        // Every text first: a long one late in the list is refused before any is tokenized.
        for (index, input) in inputs.iter().enumerate() {
            if let PromptInput::Text(text) = input {
                if text.is_empty() {
                    return Err(ValidationError::invalid(
                        param(index),
                        format!("`{}` is an empty string", param(index)),
                    ));
                }
                check_text_length(
                    &assets.tokenizer,
                    text,
                    limits.max_input_tokens,
                    &param(index),
                )?;
            }
        }
        let mut all = Vec::with_capacity(inputs.len());
        let mut tokens = 0u64;
        for (index, input) in inputs.into_iter().enumerate() {
            let ids = match input {
                PromptInput::Text(text) => {
                    assets.tokenizer.encode(text, add_special_tokens).await?
                }
                PromptInput::Ids(ids) => ids,
            };
            self.check_prompt_ids(&ids, &param(index))?;
            tokens += ids.len() as u64;
            if tokens > MAX_EMBEDDING_REQUEST_TOKENS {
                return Err(ValidationError::Invalid {
                    param: "input".to_owned(),
                    code: "context_length_exceeded",
                    message: format!(
                        "the inputs up to `{}` have {tokens} tokens together; at most \
                         {MAX_EMBEDDING_REQUEST_TOKENS} are accepted over all inputs of one \
                         request",
                        param(index)
                    ),
                });
            }
            all.push(ids);
        }
        Ok(all)
    }
}
