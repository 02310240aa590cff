//! How many logprob entries one response may carry (`--max-logprob-entries`). Every position a
//! choice reports (an echoed or `prompt_logprobs` prompt token, a generated token) carries its
//! token and its alternatives, and the router holds them all until the answer is written: a
//! 77 KB request (64 prompts of 400 token ids, `n: 8`, `echo`, `logprobs: 5`, `max_tokens: 100`)
//! once asked for 1.5 million of them, a 32 MB answer. Such a request is refused before it is
//! scheduled, with the product that made the number.

use super::logprobs::{LogprobOptions, MAX_COMPLETION_LOGPROBS};
use super::ValidationError;

/// The router default's floor: a few chat choices of a whole context with 20 alternatives.
pub const MIN_DEFAULT_LOGPROB_ENTRIES: u64 = 1 << 18;

/// `--max-logprob-entries` when not set: at least a whole context echoed with completions'
/// largest `logprobs` (lm-eval's loglikelihood requests: one prompt, `echo`, `logprobs` 1..5).
pub fn default_max_logprob_entries(max_total_tokens: u32) -> u64 {
    let per_position = u64::from(MAX_COMPLETION_LOGPROBS) + 1;
    (u64::from(max_total_tokens) * per_position).max(MIN_DEFAULT_LOGPROB_ENTRIES)
}

/// The logprob entries a request's choices would report, by part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobEntries {
    choices: u64,
    /// Prompt positions reported, summed over the choices, and entries per position.
    prompt_positions: u64,
    prompt_width: u64,
    /// Generated positions (`max_tokens`), summed over the choices, and entries per position.
    generated_positions: u64,
    generated_width: u64,
}

impl LogprobEntries {
    /// `prompts` holds each prompt's length and `max_tokens`; each prompt has `n` choices.
    pub fn of(options: &LogprobOptions, prompts: impl Iterator<Item = (u64, u64)>, n: u32) -> Self {
        let n = u64::from(n);
        let prompt_width = options
            .shard_prompt_logprobs()
            .map_or(0, |k| u64::from(k) + 1);
        let generated_width = options.tokens.map_or(0, |k| u64::from(k) + 1);
        let mut entries = Self {
            choices: 0,
            prompt_positions: 0,
            prompt_width,
            generated_positions: 0,
            generated_width,
        };
        for (prompt, max_new_tokens) in prompts {
            entries.choices += n;
            if prompt_width > 0 {
                entries.prompt_positions += prompt.saturating_mul(n);
            }
            if generated_width > 0 {
                entries.generated_positions += max_new_tokens.saturating_mul(n);
            }
        }
        entries
    }

    pub fn total(&self) -> u64 {
        let prompt = self.prompt_positions.saturating_mul(self.prompt_width);
        let generated = self
            .generated_positions
            .saturating_mul(self.generated_width);
        prompt.saturating_add(generated)
    }

    /// The product, in words: `(P echoed prompt tokens + G max_tokens over C choices) × W`.
    fn product(&self) -> String {
        let over = format!("over {} choices", self.choices);
        let alternatives = |width: u64| format!("({} alternatives + 1)", width - 1);
        match (self.prompt_width, self.generated_width) {
            (0, width) => format!(
                "({} max_tokens {over}) × {}",
                self.generated_positions,
                alternatives(width)
            ),
            (width, 0) => format!(
                "({} prompt tokens {over}) × {}",
                self.prompt_positions,
                alternatives(width)
            ),
            (prompt, generated) if prompt == generated => format!(
                "({} prompt tokens + {} max_tokens, {over}) × {}",
                self.prompt_positions,
                self.generated_positions,
                alternatives(prompt)
            ),
            (prompt, generated) => format!(
                "{} prompt tokens × {} + {} max_tokens × {}, {over}",
                self.prompt_positions,
                alternatives(prompt),
                self.generated_positions,
                alternatives(generated)
            ),
        }
    }
}

/// Refuses a request whose choices would report more than `limit` logprob entries.
pub(super) fn check_logprob_entries(
    entries: &LogprobEntries,
    limit: u64,
) -> Result<(), ValidationError> {
    let total = entries.total();
    if total <= limit {
        return Ok(());
    }
    let param = if entries.generated_width > 0 {
        "logprobs"
    } else {
        "prompt_logprobs"
    };
    Err(ValidationError::Invalid {
        param: param.to_owned(),
        code: "logprob_entries_exceeded",
        message: format!(
            "the response would carry {total} logprob entries ({}), but this server returns at \
             most {limit} per response (--max-logprob-entries); lower `n`, the number of \
             alternatives, `max_tokens` or the number of prompts, or leave out `echo`",
            entries.product()
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(tokens: Option<u32>, prompt: Option<u32>, echo: bool) -> LogprobOptions {
        LogprobOptions {
            tokens,
            prompt,
            echo,
            drop_generation: false,
        }
    }

    #[test]
    fn the_amplifying_request_of_issue_48_is_counted_and_refused() {
        // 64 prompts of 400 tokens, n = 8, echo, logprobs 5, max_tokens 100.
        let echo5 = options(Some(5), None, true);
        let entries = LogprobEntries::of(&echo5, std::iter::repeat_n((400, 100), 64), 8);
        assert_eq!(entries.total(), 64 * 8 * (400 + 100) * 6);
        let error = check_logprob_entries(&entries, default_max_logprob_entries(4096))
            .unwrap_err()
            .to_string();
        assert!(
            error.contains(
                "1536000 logprob entries ((204800 prompt tokens + 51200 max_tokens, over 512 \
                 choices) × (5 alternatives + 1))"
            ),
            "{error}"
        );
        assert!(error.contains("--max-logprob-entries"), "{error}");
    }

    #[test]
    fn a_whole_context_echoed_with_five_alternatives_fits_the_default() {
        for max_total_tokens in [1024, 4096, 32_768, 131_072] {
            // lm-eval's loglikelihood: the longest prompt, echo, logprobs 1..5, one token.
            for k in 1..=MAX_COMPLETION_LOGPROBS {
                let entries = LogprobEntries::of(
                    &options(Some(k), None, true),
                    std::iter::once((u64::from(max_total_tokens) - 1, 1)),
                    1,
                );
                let limit = default_max_logprob_entries(max_total_tokens);
                assert!(
                    check_logprob_entries(&entries, limit).is_ok(),
                    "{k} {limit}"
                );
            }
        }
    }

    #[test]
    fn only_what_is_reported_counts() {
        let none = LogprobEntries::of(&LogprobOptions::default(), std::iter::once((400, 100)), 8);
        assert_eq!(none.total(), 0);
        // Chat: generated tokens only, top_logprobs 20.
        let chat = LogprobEntries::of(
            &options(Some(20), None, false),
            std::iter::once((400, 100)),
            2,
        );
        assert_eq!(chat.total(), 2 * 100 * 21);
        // logprobs without echo: the prompt is not reported.
        let plain = LogprobEntries::of(
            &options(Some(5), None, false),
            std::iter::once((400, 100)),
            1,
        );
        assert_eq!(plain.total(), 100 * 6);
        // prompt_logprobs alone: prompt positions only, named by their field.
        let prompt = LogprobEntries::of(
            &options(None, Some(3), false),
            std::iter::once((400, 100)),
            1,
        );
        assert_eq!(prompt.total(), 400 * 4);
        let error = check_logprob_entries(&prompt, 1599).unwrap_err();
        assert_eq!(
            (error.param(), error.code()),
            (Some("prompt_logprobs"), "logprob_entries_exceeded")
        );
        assert!(check_logprob_entries(&prompt, 1600).is_ok());
        // Different widths are summed part by part.
        let mixed = LogprobEntries::of(
            &options(Some(1), Some(4), true),
            std::iter::once((10, 3)),
            1,
        );
        assert_eq!(mixed.total(), 10 * 5 + 3 * 2);
        let message = check_logprob_entries(&mixed, 1).unwrap_err().to_string();
        assert!(
            message.contains(
                "10 prompt tokens × (4 alternatives + 1) + 3 max_tokens × (1 alternatives + 1)"
            ),
            "{message}"
        );
    }
}
