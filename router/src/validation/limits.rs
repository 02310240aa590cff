//! The served length limits: defaults derived from the model's context, and the checks that
//! the operator's flags fit together.

/// The served length limits, resolved once at start-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_batch_prefill_tokens: u32,
}

/// The limits as the operator gave them (`None`: derive a default).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestedLimits {
    pub max_input_tokens: Option<u32>,
    pub max_total_tokens: Option<u32>,
    pub max_batch_prefill_tokens: Option<u32>,
}

/// `--max-batch-prefill-tokens` with chunked prefill. Half of 4,096: 32 streams of 128-token
/// prompts arriving together go in over two steps, and the first half starts streaming after
/// half the time, which halves the median time to first token for the same throughput
/// (docs/prefix-caching.md has the figures).
const DEFAULT_CHUNK_BUDGET: u32 = 2048;

impl Limits {
    /// Fills in defaults from the model's context length and checks that the limits fit
    /// together; the error says which flags clash. With `chunked_prefill` a prompt longer than
    /// `max_batch_prefill_tokens` is computed over several steps, so the budget may be smaller.
    pub fn resolve(
        requested: RequestedLimits,
        max_position_embeddings: u32,
        chunked_prefill: bool,
    ) -> Result<Self, String> {
        let context = max_position_embeddings;
        let max_total_tokens = requested.max_total_tokens.unwrap_or(context.min(4096));
        if max_total_tokens < 2 {
            return Err(format!(
                "--max-total-tokens ({max_total_tokens}) must be at least 2"
            ));
        }
        if context > 0 && max_total_tokens > context {
            return Err(format!(
                "--max-total-tokens ({max_total_tokens}) exceeds the model's context length \
                 (max_position_embeddings = {context})"
            ));
        }
        let max_input_tokens = requested.max_input_tokens.unwrap_or(max_total_tokens - 1);
        if max_input_tokens == 0 || max_input_tokens >= max_total_tokens {
            return Err(format!(
                "--max-input-tokens ({max_input_tokens}) must be at least 1 and less than \
                 --max-total-tokens ({max_total_tokens})"
            ));
        }
        let max_batch_prefill_tokens =
            requested
                .max_batch_prefill_tokens
                .unwrap_or(if chunked_prefill {
                    DEFAULT_CHUNK_BUDGET
                } else {
                    max_input_tokens.max(4096)
                });
        if max_batch_prefill_tokens == 0 {
            return Err("--max-batch-prefill-tokens must be at least 1".to_string());
        }
        if !chunked_prefill && max_batch_prefill_tokens < max_input_tokens {
            return Err(format!(
                "--max-batch-prefill-tokens ({max_batch_prefill_tokens}) must be at least \
                 --max-input-tokens ({max_input_tokens}) without --chunked-prefill, or the \
                 longest prompt could never run"
            ));
        }
        Ok(Self {
            max_input_tokens,
            max_total_tokens,
            max_batch_prefill_tokens,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_defaults_and_conflicts() {
        let limits = Limits::resolve(RequestedLimits::default(), 8192, false).unwrap();
        assert_eq!(
            limits,
            Limits {
                max_input_tokens: 4095,
                max_total_tokens: 4096,
                max_batch_prefill_tokens: 4096
            }
        );
        let small = Limits::resolve(RequestedLimits::default(), 512, false).unwrap();
        assert_eq!(
            (
                small.max_input_tokens,
                small.max_total_tokens,
                small.max_batch_prefill_tokens
            ),
            (511, 512, 4096)
        );
        let clash = RequestedLimits {
            max_input_tokens: Some(100),
            max_total_tokens: Some(100),
            ..Default::default()
        };
        assert!(Limits::resolve(clash, 512, false)
            .unwrap_err()
            .contains("--max-input-tokens (100)"));
        let too_long = RequestedLimits {
            max_total_tokens: Some(1024),
            ..Default::default()
        };
        assert!(Limits::resolve(too_long, 512, false)
            .unwrap_err()
            .contains("max_position_embeddings = 512"));
        let prefill = RequestedLimits {
            max_batch_prefill_tokens: Some(10),
            ..Default::default()
        };
        assert!(Limits::resolve(prefill, 512, false)
            .unwrap_err()
            .contains("--max-batch-prefill-tokens (10)"));
        // Chunked prefill runs a long prompt over several steps of a small budget.
        let chunked = Limits::resolve(prefill, 512, true).unwrap();
        assert_eq!(chunked.max_batch_prefill_tokens, 10);
        let default = Limits::resolve(RequestedLimits::default(), 32768, true).unwrap();
        assert_eq!(
            (default.max_input_tokens, default.max_batch_prefill_tokens),
            (4095, 2048)
        );
    }
}
