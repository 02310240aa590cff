//! Range checks of the sampling controls that bend the distribution or end a choice early:
//! OpenAI's `presence_penalty`, `frequency_penalty`, `logit_bias` and `stop`, and vLLM's
//! `stop_token_ids`. Each list has a stated bound, so one request cannot make the shard or the
//! stop-string matcher walk a million entries.

use super::ValidationError;
use crate::openai::common::GenerationParams;

/// Most `logit_bias` entries (OpenAI's own limit is the same order: a few hundred to 1024).
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;
/// Most `stop_token_ids`.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Longest stop string in bytes: every generated token is matched against each stop string.
pub const MAX_STOP_SEQUENCE_BYTES: usize = 1024;
/// OpenAI's range for both penalties and for each `logit_bias` value.
const PENALTY_RANGE: std::ops::RangeInclusive<f32> = -2.0..=2.0;
const BIAS_RANGE: std::ops::RangeInclusive<f64> = -100.0..=100.0;

/// What the controls are checked against: the model's vocabulary and `--max-stop-sequences`.
#[derive(Debug, Clone, Copy)]
pub struct ControlLimits {
    pub vocab_size: u32,
    pub max_stop_sequences: u32,
}

/// The controls, checked; all empty or 0 when the request sets none.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Controls {
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Sorted by token id, so the same request always reaches the shard the same way.
    pub logit_bias: Vec<(u32, f32)>,
    pub stop_token_ids: Vec<u32>,
    /// Non-empty stop strings, in the request's order.
    pub stop: Vec<String>,
}

pub(super) fn check_controls(
    params: &GenerationParams,
    limits: ControlLimits,
) -> Result<Controls, ValidationError> {
    Ok(Controls {
        presence_penalty: check_penalty("presence_penalty", params.presence_penalty)?,
        frequency_penalty: check_penalty("frequency_penalty", params.frequency_penalty)?,
        logit_bias: check_logit_bias(params.logit_bias.as_ref(), limits.vocab_size)?,
        stop_token_ids: check_stop_token_ids(params.stop_token_ids.as_deref(), limits.vocab_size)?,
        stop: check_stop(params, limits.max_stop_sequences)?,
    })
}

fn check_penalty(field: &str, value: Option<f32>) -> Result<f32, ValidationError> {
    let value = value.unwrap_or(0.0);
    // A JSON number too large for f32 arrives as infinity, which `contains` refuses too.
    if PENALTY_RANGE.contains(&value) {
        Ok(value)
    } else {
        Err(ValidationError::invalid(
            field,
            format!("`{field}` must be between -2 and 2, got {value}"),
        ))
    }
}

fn check_logit_bias(
    bias: Option<&std::collections::BTreeMap<String, f64>>,
    vocab_size: u32,
) -> Result<Vec<(u32, f32)>, ValidationError> {
    let Some(bias) = bias else {
        return Ok(Vec::new());
    };
    if bias.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(ValidationError::invalid(
            "logit_bias",
            format!(
                "`logit_bias` may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {}",
                bias.len()
            ),
        ));
    }
    let mut checked = Vec::with_capacity(bias.len());
    for (key, &value) in bias {
        // Decimal digits only: `parse` alone would also take "+5".
        let id = key
            .bytes()
            .all(|byte| byte.is_ascii_digit())
            .then(|| key.parse::<u32>().ok())
            .flatten()
            .filter(|&id| id < vocab_size)
            .ok_or_else(|| {
                ValidationError::invalid(
                    "logit_bias",
                    format!(
                        "`logit_bias` key {key:?} is not a token id: keys are decimal ids below \
                         the vocabulary size {vocab_size}"
                    ),
                )
            })?;
        if !BIAS_RANGE.contains(&value) {
            return Err(ValidationError::invalid(
                "logit_bias",
                format!(
                    "`logit_bias` value of token {key} must be between -100 and 100, got {value}"
                ),
            ));
        }
        checked.push((id, value as f32));
    }
    // Keys "7" and "007" name the same token: one entry, as a JSON object would have.
    checked.sort_by_key(|&(id, _)| id);
    checked.dedup_by_key(|&mut (id, _)| id);
    Ok(checked)
}

fn check_stop_token_ids(ids: Option<&[u32]>, vocab_size: u32) -> Result<Vec<u32>, ValidationError> {
    let ids = ids.unwrap_or_default();
    if ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(ValidationError::invalid(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} `stop_token_ids` are allowed, got {}",
                ids.len()
            ),
        ));
    }
    if let Some(bad) = ids.iter().find(|&&id| id >= vocab_size) {
        return Err(ValidationError::invalid(
            "stop_token_ids",
            format!(
                "`stop_token_ids` holds {bad}, out of range: the vocabulary has {vocab_size} tokens"
            ),
        ));
    }
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

fn check_stop(
    params: &GenerationParams,
    max_stop_sequences: u32,
) -> Result<Vec<String>, ValidationError> {
    let stop: Vec<String> = params
        .stop
        .iter()
        .flat_map(|stops| stops.0.iter())
        // An empty stop string would match before any text; clients mean "no stop".
        .filter(|stop| !stop.is_empty())
        .cloned()
        .collect();
    if stop.len() > max_stop_sequences as usize {
        return Err(ValidationError::invalid(
            "stop",
            format!(
                "at most {max_stop_sequences} stop sequences are allowed (--max-stop-sequences), \
                 got {}",
                stop.len()
            ),
        ));
    }
    if let Some(long) = stop
        .iter()
        .find(|stop| stop.len() > MAX_STOP_SEQUENCE_BYTES)
    {
        return Err(ValidationError::invalid(
            "stop",
            format!(
                "a stop sequence may be at most {MAX_STOP_SEQUENCE_BYTES} bytes long, got one of {}",
                long.len()
            ),
        ));
    }
    Ok(stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    const LIMITS: ControlLimits = ControlLimits {
        vocab_size: 100,
        max_stop_sequences: 16,
    };

    fn check(body: Value) -> Result<Controls, ValidationError> {
        check_controls(&serde_json::from_value(body).expect("valid params"), LIMITS)
    }

    fn refused(body: Value) -> (String, String) {
        let error = check(body.clone()).expect_err(&format!("{body} should be refused"));
        (
            error.param().unwrap_or_default().to_owned(),
            error.to_string(),
        )
    }

    #[test]
    fn absent_controls_change_nothing() {
        assert_eq!(check(json!({})).unwrap(), Controls::default());
    }

    #[test]
    fn penalties_are_taken_within_range_and_refused_outside() {
        let controls = check(json!({"presence_penalty": -2, "frequency_penalty": 2})).unwrap();
        assert_eq!(
            (controls.presence_penalty, controls.frequency_penalty),
            (-2.0, 2.0)
        );
        for field in ["presence_penalty", "frequency_penalty"] {
            for value in [json!(2.01), json!(-3), json!(1e300)] {
                let (param, message) = refused(json!({ field: value }));
                assert_eq!(param, field);
                assert!(message.contains(field), "{message}");
            }
        }
    }

    #[test]
    fn logit_bias_keys_are_token_ids_of_the_vocabulary() {
        let controls = check(json!({"logit_bias": {"99": 100, "0": -100, "5": 0.5}})).unwrap();
        assert_eq!(
            controls.logit_bias,
            vec![(0, -100.0), (5, 0.5), (99, 100.0)]
        );
        for key in ["100", "-1", "+5", " 5", "5.0", "abc", "", "99999999999"] {
            let (param, message) = refused(json!({"logit_bias": { key: 1 }}));
            assert_eq!(param, "logit_bias");
            assert!(message.contains(&format!("{key:?}")), "{message}");
        }
    }

    #[test]
    fn logit_bias_values_and_size_are_bounded() {
        for value in [100.5, -101.0] {
            let (param, message) = refused(json!({"logit_bias": {"7": value}}));
            assert_eq!(param, "logit_bias");
            assert!(message.contains("token 7"), "{message}");
        }
        let too_many: serde_json::Map<String, Value> = (0..=MAX_LOGIT_BIAS_ENTRIES)
            .map(|id| (id.to_string(), json!(1)))
            .collect();
        assert_eq!(refused(json!({ "logit_bias": too_many })).0, "logit_bias");
    }

    #[test]
    fn logit_bias_keys_naming_one_token_merge() {
        let controls = check(json!({"logit_bias": {"7": 1, "007": 1}})).unwrap();
        assert_eq!(controls.logit_bias, vec![(7, 1.0)]);
    }

    #[test]
    fn stop_token_ids_are_checked_against_the_vocabulary() {
        let controls = check(json!({"stop_token_ids": [9, 3, 9]})).unwrap();
        assert_eq!(controls.stop_token_ids, vec![3, 9]);
        assert_eq!(
            refused(json!({"stop_token_ids": [3, 100]})).0,
            "stop_token_ids"
        );
        let too_many = vec![1; MAX_STOP_TOKEN_IDS + 1];
        assert_eq!(
            refused(json!({ "stop_token_ids": too_many })).0,
            "stop_token_ids"
        );
    }

    #[test]
    fn stop_strings_are_bounded_in_number_and_length() {
        let sixteen: Vec<String> = (0..16).map(|i| format!("s{i}")).collect();
        assert_eq!(check(json!({ "stop": sixteen })).unwrap().stop.len(), 16);
        let seventeen: Vec<String> = (0..17).map(|i| format!("s{i}")).collect();
        let (param, message) = refused(json!({ "stop": seventeen }));
        assert_eq!(param, "stop");
        assert!(message.contains("--max-stop-sequences"), "{message}");
        // Empty strings are dropped before counting.
        let padded: Vec<&str> = std::iter::repeat_n("", 20).chain(["x"]).collect();
        assert_eq!(
            check(json!({ "stop": padded })).unwrap().stop,
            vec!["x".to_owned()]
        );
        let long = "x".repeat(MAX_STOP_SEQUENCE_BYTES + 1);
        assert_eq!(refused(json!({ "stop": long })).0, "stop");
        let longest = "x".repeat(MAX_STOP_SEQUENCE_BYTES);
        assert!(check(json!({ "stop": longest })).is_ok());
    }
}
