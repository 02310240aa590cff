//! `/tokenize` and `/detokenize` inputs: which text is tokenized and how, and which ids can be
//! turned back into text.

use super::messages::render_chat;
use super::{ModelAssets, ValidationError};
use crate::openai::tokenize::TokenizeRequest;
use crate::tokenizer::TextTokenizer;

/// The ids of a `/tokenize` request: its `prompt` as is (special tokens on by default), or
/// its `messages` rendered with the chat template (generation prompt on, special tokens off
/// by default, since the template writes them); chat-only fields beside `prompt` are ignored,
/// as unknown fields are. A text longer than `--max-input-tokens` is counted (that is one reason
/// to call this endpoint), but one that cannot fit the model's context, `max_model_len`, is
/// refused without tokenizing it (see [`check_fits_context`]).
pub async fn tokenize_ids(
    assets: &ModelAssets,
    request: TokenizeRequest,
    max_model_len: u32,
) -> Result<Vec<u32>, ValidationError> {
    let param = if request.prompt.is_some() {
        "prompt"
    } else {
        "messages"
    };
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
                request.chat_template_kwargs.as_ref(),
            )?;
            (text, request.add_special_tokens.unwrap_or(false))
        }
        (None, None) => return Err(ValidationError::missing("prompt")),
    };
    check_fits_context(&assets.tokenizer, &text, max_model_len, param)?;
    Ok(assets.tokenizer.encode(text, add_special_tokens).await?)
}

/// Refuses a text whose byte length alone shows it has more than `max_model_len` tokens (each
/// token covers at most `max_bytes_per_token` bytes), before tokenizing it: a body near the
/// size limit would otherwise cost the router hundreds of MB for a count no request could use.
fn check_fits_context(
    tokenizer: &TextTokenizer,
    text: &str,
    max_model_len: u32,
    param: &str,
) -> Result<(), ValidationError> {
    let Some(bytes_per_token) = tokenizer.max_bytes_per_token() else {
        return Ok(());
    };
    let at_least = text.len().div_ceil(bytes_per_token.max(1));
    if at_least <= max_model_len as usize {
        return Ok(());
    }
    Err(ValidationError::Invalid {
        param: param.to_owned(),
        code: "context_length_exceeded",
        message: format!(
            "the text has at least {at_least} tokens, more than the model's context of \
             {max_model_len} (--max-total-tokens)"
        ),
    })
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
