//! Range checks of the parameters chat and completions share, with OpenAI's defaults.

use super::controls::{check_controls, ControlLimits};
use super::structured::{output_grammar, OutputGrammar};
use super::{ResponseOptions, ValidationError, MAX_N};
use crate::openai::common::GenerationParams;
use crate::scheduler::SamplingParams;

/// `GenerationParams` checked, before the prompt is known.
#[derive(Debug, Clone)]
pub(super) struct CheckedParams {
    pub sampling: SamplingParams,
    /// `None`: seed each choice randomly.
    pub seed: Option<u64>,
    pub n: u32,
    /// With the field name it came from, for error messages.
    pub max_tokens: Option<(u32, &'static str)>,
    pub min_tokens: u32,
    pub ignore_eos: bool,
    /// The client's `stop_token_ids`, in the vocabulary; honoured even with `ignore_eos`.
    pub stop_token_ids: Vec<u32>,
    pub options: ResponseOptions,
    /// The output constraint, if the request asks for one.
    pub grammar: Option<OutputGrammar>,
    /// vLLM's `cache_salt`: this request reuses cached prompt blocks only of requests with the
    /// same salt (inside its key's prefix-cache group).
    pub cache_salt: Option<String>,
}

/// The longest `cache_salt` accepted, in bytes: it is hashed into every prompt block's name.
const MAX_CACHE_SALT_BYTES: usize = 1024;

/// Range checks of the shared parameters; OpenAI's defaults where absent. `max_tokens: 0` is
/// allowed only with completions' `echo` (see `logprobs::apply_logprobs`).
pub(super) fn check_params(
    params: &GenerationParams,
    echo: bool,
    limits: ControlLimits,
) -> Result<CheckedParams, ValidationError> {
    let temperature = params.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ValidationError::invalid(
            "temperature",
            format!("`temperature` must be between 0 and 2, got {temperature}"),
        ));
    }
    let top_p = params.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ValidationError::invalid(
            "top_p",
            format!("`top_p` must be greater than 0 and at most 1, got {top_p}"),
        ));
    }
    let top_k = match params.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        k => {
            return Err(ValidationError::invalid(
                "top_k",
                format!("`top_k` must be -1 or 0 (disabled) or positive, got {k}"),
            ))
        }
    };
    let min_p = params.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(ValidationError::invalid(
            "min_p",
            format!("`min_p` must be between 0 and 1, got {min_p}"),
        ));
    }
    let repetition_penalty = params.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
        return Err(ValidationError::invalid(
            "repetition_penalty",
            format!("`repetition_penalty` must be greater than 0, got {repetition_penalty}"),
        ));
    }
    let n = params.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(ValidationError::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_N}, got {n}"),
        ));
    }
    let max_tokens = match (params.max_completion_tokens, params.max_tokens) {
        (Some(tokens), _) => Some((tokens, "max_completion_tokens")),
        (None, Some(tokens)) => Some((tokens, "max_tokens")),
        (None, None) => None,
    };
    match max_tokens {
        Some((0, field)) if !echo => {
            return Err(ValidationError::invalid(
                field,
                format!("`{field}` must be at least 1 (0 is allowed only with `echo`)"),
            ));
        }
        _ => {}
    }
    let controls = check_controls(params, limits)?;
    let grammar = output_grammar(params)?;
    let stream = params.stream.unwrap_or(false);
    let cache_salt = params.cache_salt.clone();
    if let Some(salt) = &cache_salt {
        if salt.is_empty() || salt.len() > MAX_CACHE_SALT_BYTES {
            return Err(ValidationError::invalid(
                "cache_salt",
                format!("`cache_salt` must be 1 to {MAX_CACHE_SALT_BYTES} bytes"),
            ));
        }
    }
    Ok(CheckedParams {
        sampling: SamplingParams {
            temperature,
            top_p,
            top_k,
            min_p,
            repetition_penalty,
            presence_penalty: controls.presence_penalty,
            frequency_penalty: controls.frequency_penalty,
            logit_bias: controls.logit_bias,
            ..SamplingParams::default()
        },
        seed: params.seed.map(|seed| seed.0),
        n,
        max_tokens,
        min_tokens: params.min_tokens.unwrap_or(0),
        ignore_eos: params.ignore_eos.unwrap_or(false),
        stop_token_ids: controls.stop_token_ids,
        options: ResponseOptions {
            stream,
            include_usage: stream
                && params
                    .stream_options
                    .as_ref()
                    .and_then(|options| options.include_usage)
                    .unwrap_or(false),
            return_token_ids: params.return_token_ids.unwrap_or(false),
            stop: controls.stop,
            n,
            ..ResponseOptions::default()
        },
        grammar,
        cache_salt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const LIMITS: ControlLimits = ControlLimits {
        vocab_size: 100,
        max_stop_sequences: 4,
    };

    fn check(body: Value) -> Result<CheckedParams, ValidationError> {
        check_params(&params(body), false, LIMITS)
    }

    fn params(body: Value) -> GenerationParams {
        serde_json::from_value(body).expect("valid params")
    }

    fn param_of(result: Result<CheckedParams, ValidationError>) -> String {
        result
            .expect_err("should be refused")
            .param()
            .unwrap_or_default()
            .to_owned()
    }

    #[test]
    fn openai_defaults_apply() {
        let checked = check(json!({})).unwrap();
        assert_eq!(checked.sampling.temperature, 1.0);
        assert_eq!(checked.sampling.top_p, 1.0);
        assert_eq!(checked.n, 1);
        assert_eq!(checked.max_tokens, None);
        assert!(!checked.options.stream);
    }

    #[test]
    fn out_of_range_parameters_are_named() {
        for (body, param) in [
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": -0.1}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.01}), "top_p"),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"repetition_penalty": 0}), "repetition_penalty"),
            (json!({"n": 0}), "n"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (
                json!({"max_completion_tokens": 0, "max_tokens": 5}),
                "max_completion_tokens",
            ),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"logit_bias": {"100": 1}}), "logit_bias"),
            (json!({"stop_token_ids": [100]}), "stop_token_ids"),
        ] {
            assert_eq!(param_of(check(body.clone())), param, "{body}");
        }
    }

    #[test]
    fn boundaries_are_accepted() {
        let checked = check(json!({
            "temperature": 0, "top_p": 1, "top_k": -1, "stop": "x", "seed": -1,
            "stream": true, "stream_options": {"include_usage": true}
        }))
        .unwrap();
        assert_eq!(checked.sampling.temperature, 0.0);
        assert_eq!(checked.sampling.top_k, 0);
        assert_eq!(checked.seed, Some(u64::MAX));
        assert_eq!(checked.options.stop, vec!["x".to_owned()]);
        assert!(checked.options.include_usage);
        let controls = check(json!({
            "presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"3": 5},
            "stop_token_ids": [7]
        }))
        .unwrap();
        assert_eq!(controls.sampling.presence_penalty, 0.5);
        assert_eq!(controls.sampling.frequency_penalty, -1.0);
        assert_eq!(controls.sampling.logit_bias, vec![(3, 5.0)]);
        assert_eq!(controls.stop_token_ids, vec![7]);
        assert_eq!(
            check(json!({"temperature": 2}))
                .unwrap()
                .sampling
                .temperature,
            2.0
        );
    }
}
