//! The logprob fields (chat `logprobs`/`top_logprobs`, completions `logprobs`/`echo`/
//! `best_of`, vLLM's `prompt_logprobs`) checked, and what they change about the request: the
//! alternatives the shard reports, the choices generated per prompt, `max_tokens: 0`.
//! A request that asks for none of them costs nothing more.

use super::params::CheckedParams;
use super::{ValidationError, MAX_N};
use crate::openai::common::GenerationParams;

/// OpenAI's bound on chat `top_logprobs` (and ours on `prompt_logprobs`).
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// OpenAI's bound on completions `logprobs`.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// The logprob fields of one endpoint, as sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LogprobFields {
    Chat {
        logprobs: Option<bool>,
        top_logprobs: Option<i64>,
    },
    Completions {
        logprobs: Option<i64>,
        echo: Option<bool>,
        best_of: Option<u32>,
    },
}

impl LogprobFields {
    /// Completions' `echo`, which also allows `max_tokens: 0`.
    pub fn echo(&self) -> bool {
        matches!(
            self,
            Self::Completions {
                echo: Some(true),
                ..
            }
        )
    }
}

/// What the response reports besides the text; all off unless asked.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogprobOptions {
    /// Report each generated token's logprob with this many alternatives.
    pub tokens: Option<u32>,
    /// vLLM's `prompt_logprobs`, with this many alternatives.
    pub prompt: Option<u32>,
    /// Completions: the prompt's text (and, with `tokens`, its logprobs) before the completion.
    pub echo: bool,
    /// `max_tokens: 0` with `echo`: the one token generated is dropped.
    pub drop_generation: bool,
}

impl LogprobOptions {
    /// The alternatives per prompt position the shard must compute, `None` for none (the cheap
    /// prefill): for `prompt_logprobs`, and for the echoed prompt's entries.
    pub fn shard_prompt_logprobs(&self) -> Option<u32> {
        let echoed = self.tokens.filter(|_| self.echo);
        self.prompt.max(echoed)
    }
}

/// `0..=max`, named `param` in the error.
fn bounded(value: i64, max: u32, param: &str) -> Result<u32, ValidationError> {
    u32::try_from(value)
        .ok()
        .filter(|&v| v <= max)
        .ok_or_else(|| {
            ValidationError::invalid(
                param,
                format!("`{param}` must be between 0 and {max}, got {value}"),
            )
        })
}

/// Checks the logprob fields and applies them to `checked`: the shard's `top_logprobs`,
/// `best_of` choices generated per prompt (`checked.n`, while `options.n` keeps what is
/// returned), and `max_tokens: 0` with `echo` run as one token that is dropped.
pub(super) fn apply_logprobs(
    fields: LogprobFields,
    params: &GenerationParams,
    checked: &mut CheckedParams,
) -> Result<(), ValidationError> {
    let mut options = LogprobOptions::default();
    let n = checked.n;
    let mut best_of = n;
    match fields {
        LogprobFields::Chat {
            logprobs,
            top_logprobs,
        } => {
            let top = top_logprobs
                .map(|top| bounded(top, MAX_TOP_LOGPROBS, "top_logprobs"))
                .transpose()?;
            if logprobs == Some(true) {
                options.tokens = Some(top.unwrap_or(0));
            } else if top.is_some() {
                return Err(ValidationError::invalid(
                    "top_logprobs",
                    "`top_logprobs` requires `logprobs` to be true",
                ));
            }
        }
        LogprobFields::Completions {
            logprobs,
            echo,
            best_of: asked,
        } => {
            options.tokens = logprobs
                .map(|k| bounded(k, MAX_COMPLETION_LOGPROBS, "logprobs"))
                .transpose()?;
            options.echo = echo == Some(true);
            if let Some(asked) = asked {
                best_of = check_best_of(asked, n, checked.options.stream)?;
            }
        }
    }
    options.prompt = params
        .prompt_logprobs
        .map(|k| bounded(k, MAX_TOP_LOGPROBS, "prompt_logprobs"))
        .transpose()?;
    if let Some((0, field)) = checked.max_tokens {
        // `check_params` lets 0 through only with `echo`: the shard needs one token to run
        // the prefill that computes the prompt's logprobs.
        checked.max_tokens = Some((1, field));
        options.drop_generation = true;
    }
    checked.sampling.top_logprobs = options.tokens.unwrap_or(0);
    checked.n = best_of;
    checked.options.n = n;
    checked.options.logprobs = options;
    Ok(())
}

/// `best_of` alone over `--max-choices-per-request` is named as such (the shared choice check
/// would name `n`).
pub(super) fn check_best_of_bound(
    checked: &CheckedParams,
    max_choices: u32,
) -> Result<(), ValidationError> {
    if checked.n > checked.options.n && checked.n > max_choices {
        return Err(ValidationError::invalid(
            "best_of",
            format!(
                "`best_of` is {}, but this server accepts at most {max_choices} choices per \
                 request (--max-choices-per-request)",
                checked.n
            ),
        ));
    }
    Ok(())
}

fn check_best_of(best_of: u32, n: u32, stream: bool) -> Result<u32, ValidationError> {
    if best_of < n || best_of > MAX_N {
        return Err(ValidationError::invalid(
            "best_of",
            format!("`best_of` must be at least `n` ({n}) and at most {MAX_N}, got {best_of}"),
        ));
    }
    if best_of > n && stream {
        return Err(ValidationError::invalid(
            "best_of",
            "`best_of` greater than `n` cannot be streamed: the best choices are known only \
             once all have finished",
        ));
    }
    Ok(best_of)
}

#[cfg(test)]
mod tests {
    use super::super::params::check_params;
    use super::*;
    use serde_json::json;

    fn apply(fields: LogprobFields, body: serde_json::Value) -> Result<CheckedParams, String> {
        let params: GenerationParams = serde_json::from_value(body).unwrap();
        let limits = super::super::ControlLimits {
            vocab_size: 1000,
            max_stop_sequences: 16,
        };
        let mut checked =
            check_params(&params, fields.echo(), limits).map_err(|e| e.to_string())?;
        apply_logprobs(fields, &params, &mut checked)
            .map_err(|e| e.param().unwrap_or_default().to_owned())?;
        Ok(checked)
    }

    fn chat(logprobs: Option<bool>, top_logprobs: Option<i64>) -> LogprobFields {
        LogprobFields::Chat {
            logprobs,
            top_logprobs,
        }
    }

    fn completions(logprobs: Option<i64>, echo: bool, best_of: Option<u32>) -> LogprobFields {
        LogprobFields::Completions {
            logprobs,
            echo: Some(echo),
            best_of,
        }
    }

    #[test]
    fn nothing_asked_costs_nothing() {
        let checked = apply(chat(None, None), json!({})).unwrap();
        assert_eq!(checked.options.logprobs, LogprobOptions::default());
        assert_eq!(checked.sampling.top_logprobs, 0);
        assert_eq!(checked.options.logprobs.shard_prompt_logprobs(), None);
    }

    #[test]
    fn refusals_name_their_param() {
        for (fields, body, param) in [
            (chat(None, Some(3)), json!({}), "top_logprobs"),
            (chat(Some(false), Some(0)), json!({}), "top_logprobs"),
            (chat(Some(true), Some(21)), json!({}), "top_logprobs"),
            (chat(Some(true), Some(-1)), json!({}), "top_logprobs"),
            (completions(Some(6), false, None), json!({}), "logprobs"),
            (
                completions(None, false, Some(1)),
                json!({"n": 2}),
                "best_of",
            ),
            (
                completions(None, false, Some(3)),
                json!({"stream": true}),
                "best_of",
            ),
            (
                chat(None, None),
                json!({"prompt_logprobs": 21}),
                "prompt_logprobs",
            ),
        ] {
            assert_eq!(
                apply(fields, body.clone()).unwrap_err(),
                param,
                "{fields:?} {body}"
            );
        }
    }

    #[test]
    fn max_tokens_zero_needs_echo() {
        assert!(apply(completions(None, false, None), json!({"max_tokens": 0})).is_err());
        let checked = apply(completions(Some(2), true, None), json!({"max_tokens": 0})).unwrap();
        assert_eq!(checked.max_tokens, Some((1, "max_tokens")));
        assert!(checked.options.logprobs.drop_generation);
        assert_eq!(checked.options.logprobs.shard_prompt_logprobs(), Some(2));
    }

    #[test]
    fn best_of_generates_more_choices_than_it_returns() {
        let checked = apply(completions(Some(0), false, Some(3)), json!({"n": 2})).unwrap();
        assert_eq!((checked.n, checked.options.n), (3, 2));
        let streamed = apply(
            completions(None, false, Some(2)),
            json!({"n": 2, "stream": true}),
        )
        .unwrap();
        assert_eq!(streamed.n, 2);
    }

    #[test]
    fn best_of_over_the_choice_bound_is_named() {
        let checked = apply(completions(None, false, Some(9)), json!({"n": 2})).unwrap();
        let error = check_best_of_bound(&checked, 8).unwrap_err();
        assert_eq!(error.param(), Some("best_of"));
        assert!(check_best_of_bound(&checked, 9).is_ok());
    }

    #[test]
    fn prompt_logprobs_cover_the_echoed_prompt_too() {
        let checked = apply(
            completions(Some(5), true, None),
            json!({"prompt_logprobs": 2}),
        )
        .unwrap();
        assert_eq!(checked.options.logprobs.shard_prompt_logprobs(), Some(5));
        let chat = apply(chat(Some(true), Some(4)), json!({"prompt_logprobs": 0})).unwrap();
        assert_eq!(chat.sampling.top_logprobs, 4);
        assert_eq!(chat.options.logprobs.shard_prompt_logprobs(), Some(0));
    }
}
