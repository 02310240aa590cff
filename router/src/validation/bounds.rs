//! The cheap checks that bound what one request can cost before it costs it: how many prompts
//! and choices, how long a prompt (before tokenizing it), and how much of the KV cache its
//! choices would reserve together (before any choice is built).

use super::ValidationError;
use crate::scheduler::blocks_for_tokens;
use crate::tokenizer::TextTokenizer;

/// Most prompts in one completions request, and inputs in one embeddings request: OpenAI's own
/// limit on a `prompt` or `input` list.
pub const MAX_PROMPTS: usize = 2048;

/// What one request may ask for, set by the operator's flags and the KV cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestBounds {
    /// `--max-choices-per-request`: `n` × prompts.
    pub max_choices_per_request: u32,
    /// `--max-request-kv-share`, kept for the error message.
    pub max_request_kv_share: f64,
    /// Tokens per KV block.
    pub block_size: u32,
    /// The share of the usable cache, in blocks, that one request's choices may reserve.
    pub max_request_blocks: u64,
}

impl RequestBounds {
    /// `share` of `usable_blocks` (at least one block, so a share never refuses everything).
    pub fn new(
        max_choices_per_request: u32,
        max_request_kv_share: f64,
        block_size: u32,
        usable_blocks: u32,
    ) -> Self {
        let max_request_blocks = ((f64::from(usable_blocks) * max_request_kv_share) as u64).max(1);
        Self {
            max_choices_per_request,
            max_request_kv_share,
            block_size,
            max_request_blocks,
        }
    }

    /// `n` × `prompts` against `--max-choices-per-request`, and the prompt count against
    /// [`MAX_PROMPTS`]: checked before any prompt is converted or tokenized.
    pub(super) fn check_choices(
        &self,
        prompts: usize,
        n: u32,
        param: &str,
    ) -> Result<(), ValidationError> {
        if prompts > MAX_PROMPTS {
            return Err(ValidationError::invalid(
                param,
                format!("`{param}` has {prompts} entries; at most {MAX_PROMPTS} are accepted"),
            ));
        }
        let choices = prompts as u64 * u64::from(n);
        if choices > u64::from(self.max_choices_per_request) {
            return Err(ValidationError::invalid(
                if prompts > 1 { param } else { "n" },
                format!(
                    "the request asks for {choices} choices (n = {n} × {prompts} prompts), but \
                     this server accepts at most {} per request (--max-choices-per-request)",
                    self.max_choices_per_request
                ),
            ));
        }
        Ok(())
    }

    /// The KV blocks all choices would reserve together (`n` × blocks of prompt + completion
    /// per prompt) against `--max-request-kv-share`. `tokens` holds prompt + completion per
    /// prompt.
    pub(super) fn check_kv_demand(
        &self,
        tokens: impl Iterator<Item = u64>,
        n: u32,
        param: &str,
    ) -> Result<(), ValidationError> {
        let per_choice: u64 = tokens
            .map(|tokens| blocks_for_tokens(tokens, self.block_size))
            .sum();
        let demand = per_choice.saturating_mul(u64::from(n));
        if demand > self.max_request_blocks {
            return Err(ValidationError::Invalid {
                param: param.to_owned(),
                code: "kv_share_exceeded",
                message: format!(
                    "the request's choices would reserve {demand} KV-cache blocks together \
                     (n × prompts × blocks of prompt + max_tokens), but one request may use at \
                     most {} blocks, {} of the cache (--max-request-kv-share); lower `n`, the \
                     number of prompts or `max_tokens`",
                    self.max_request_blocks, self.max_request_kv_share
                ),
            });
        }
        Ok(())
    }
}

/// What the prompt sources check before they tokenize or convert anything.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimits {
    pub request: RequestBounds,
    pub n: u32,
    pub max_input_tokens: u32,
}

/// A prompt over `--max-input-tokens`.
pub(super) fn too_long(param: &str, tokens: &str, max_input_tokens: u32) -> ValidationError {
    ValidationError::Invalid {
        param: param.to_owned(),
        code: "context_length_exceeded",
        message: format!(
            "the prompt has {tokens} tokens, but this server accepts at most {max_input_tokens} \
             input tokens (--max-input-tokens)"
        ),
    }
}

/// Refuses, without tokenizing it, a text too long to be `max_input_tokens` tokens: every token
/// covers at most the tokenizer's longest token in bytes (see
/// `TextTokenizer::max_bytes_per_token`).
pub(super) fn check_text_length(
    tokenizer: &TextTokenizer,
    text: &str,
    max_input_tokens: u32,
    param: &str,
) -> Result<(), ValidationError> {
    let Some(bytes_per_token) = tokenizer.max_bytes_per_token() else {
        return Ok(());
    };
    let at_least = text.len().div_ceil(bytes_per_token.max(1));
    if at_least > max_input_tokens as usize {
        return Err(too_long(
            param,
            &format!("at least {at_least}"),
            max_input_tokens,
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_and_prompt_count_are_bounded() {
        let bounds = RequestBounds::new(8, 0.5, 4, 100);
        assert_eq!(bounds.max_request_blocks, 50);
        assert!(bounds.check_choices(2, 4, "prompt").is_ok());
        let error = bounds.check_choices(3, 3, "prompt").unwrap_err();
        assert_eq!(error.param(), Some("prompt"));
        assert!(error.to_string().contains("--max-choices-per-request"));
        assert_eq!(
            bounds.check_choices(1, 9, "prompt").unwrap_err().param(),
            Some("n")
        );
        let many = RequestBounds::new(u32::MAX, 0.5, 4, 100);
        assert!(many.check_choices(MAX_PROMPTS + 1, 1, "prompt").is_err());
    }

    #[test]
    fn kv_demand_counts_every_choice_of_every_prompt() {
        let bounds = RequestBounds::new(512, 0.5, 4, 100);
        // (8 + 8) tokens = 4 blocks; 2 prompts × n = 6 → 48 blocks, under 50.
        assert!(bounds
            .check_kv_demand([16u64, 16].into_iter(), 6, "prompt")
            .is_ok());
        // n = 7 → 56 blocks.
        let error = bounds
            .check_kv_demand([16u64, 16].into_iter(), 7, "prompt")
            .unwrap_err();
        assert_eq!(error.code(), "kv_share_exceeded");
        assert!(error.to_string().contains("--max-request-kv-share"));
    }
}
