//! `/tokenize` and `/detokenize` inputs: which text is tokenized and how, and which ids can be
//! turned back into text.

use super::messages::render_chat;
use super::{ModelAssets, ValidationError};
use crate::openai::tokenize::TokenizeRequest;
use crate::tokenizer::TextTokenizer;

/// The ids of a `/tokenize` request: its `prompt` as is (special tokens on by default), or
/// its `messages` rendered with the chat template (generation prompt on, special tokens off
/// by default, since the template writes them); chat-only fields beside `prompt` are ignored,
/// as unknown fields are. No length limit applies: counting a prompt
/// that is too long for generation is one reason to call this endpoint, and the body limit
/// already bounds the work.
pub async fn tokenize_ids(
    assets: &ModelAssets,
    request: TokenizeRequest,
) -> Result<Vec<u32>, ValidationError> {
    let (text, add_special_tokens) = match (request.prompt, request.messages) {
        (Some(_), Some(_)) => {
            return Err(ValidationError::invalid(
                "messages",
                "give either `prompt` or `messages`, not both",
            ))
        }
        (Some(prompt), None) => (prompt, request.add_special_tokens.unwrap_or(true)),
        (None, messages @ Some(_)) => {
            let add_generation_prompt = request.add_generation_prompt.unwrap_or(true);
            let text = render_chat(
                assets,
                messages,
                request.tools.as_ref(),
                add_generation_prompt,
            )?;
            (text, request.add_special_tokens.unwrap_or(false))
        }
        (None, None) => return Err(ValidationError::missing("prompt")),
    };
    Ok(assets.tokenizer.encode(text, add_special_tokens).await?)
}

/// `tokens` as ids of `tokenizer`'s vocabulary (added tokens included); anything else is
/// refused, since the tokenizer would silently drop it from the text.
pub fn vocabulary_ids(
    tokenizer: &TextTokenizer,
    tokens: Option<Vec<i64>>,
) -> Result<Vec<u32>, ValidationError> {
    let tokens = tokens.ok_or_else(|| ValidationError::missing("tokens"))?;
    let vocab_size = tokenizer.vocab_size();
    tokens
        .into_iter()
        .map(|id| {
            u32::try_from(id)
                .ok()
                .filter(|&id| (id as usize) < vocab_size)
                .ok_or_else(|| {
                    ValidationError::invalid(
                        "tokens",
                        format!(
                            "token id {id} is out of range: the vocabulary has {vocab_size} tokens"
                        ),
                    )
                })
        })
        .collect()
}
