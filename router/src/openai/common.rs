//! Request fields and response pieces shared by chat and completions.

use std::fmt;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// The generation parameters both endpoints accept. Each endpoint's own fields (`messages`,
/// `prompt`) live in a separate struct read from the same JSON object, so that a type error
/// in any field is reported with that field's name (serde's `flatten` would lose it).
///
/// Every field is optional and `null` means absent, as clients send explicit nulls. Fields
/// not read here were checked against `crate::openai::fields` before: refused, or accepted
/// without effect.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[schema(
    description = "The parameters chat and completions share. Every field is optional and \
                   `null` means absent; see docs/api.md's field tables for the fields not listed."
)]
pub struct GenerationParams {
    /// "" (or absent), the served model name or the base model id: the base model.
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    /// The chat API's newer name for `max_tokens`; wins when both are set.
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub n: Option<u32>,
    pub seed: Option<Seed>,
    pub stop: Option<StopSequences>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Extension: 0 or -1 disables.
    pub top_k: Option<i64>,
    /// Extension: 0 disables.
    pub min_p: Option<f32>,
    /// Extension: 1.0 disables.
    pub repetition_penalty: Option<f32>,
    /// Extension: keep generating past EOS until the length limit.
    pub ignore_eos: Option<bool>,
    /// Extension: EOS is not honoured before this many tokens.
    pub min_tokens: Option<u32>,
    /// vLLM's extension: return prompt and completion token ids alongside the text.
    pub return_token_ids: Option<bool>,
    /// Extension: where an adapter id in `model` is looked up, `hub`, `local` or `s3` (default:
    /// `--adapter-source`).
    pub adapter_source: Option<String>,
    /// vLLM's extension: the request reuses cached prompt blocks only of requests that sent the
    /// same salt (and, with API keys, only inside its key's prefix-cache group).
    pub cache_salt: Option<String>,
    /// OpenAI's penalties, -2..=2, over the generated tokens.
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Token id (a JSON object key, so a string) → bias, -100..=100.
    pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// vLLM's extension: more token ids that end a choice with `finish_reason: "stop"`.
    pub stop_token_ids: Option<Vec<u32>>,
    /// vLLM's extension: the prompt's logprobs with this many alternatives per position.
    pub prompt_logprobs: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    /// "strict"}}`: the output is JSON (valid for the schema), enforced by a grammar.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's extension: exactly one of `json` (a schema), `regex`, `choice` (strings),
    /// `grammar` (llguidance's Lark dialect), `json_object` (`true`).
    pub structured_outputs: Option<serde_json::Value>,
    /// vLLM's older aliases of `structured_outputs.json`, `.regex`, `.choice`, `.grammar`.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<serde_json::Value>,
    pub guided_choice: Option<serde_json::Value>,
    pub guided_grammar: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// `seed`: any JSON integer; negative ones are taken modulo 2^64 so every integer a client
/// may send is a valid seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seed(pub u64);

impl<'de> Deserialize<'de> for Seed {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct SeedVisitor;
        impl Visitor<'_> for SeedVisitor {
            type Value = Seed;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Seed, E> {
                Ok(Seed(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Seed, E> {
                Ok(Seed(v as u64))
            }
        }
        deserializer.deserialize_any(SeedVisitor)
    }
}

/// `stop`: a string or a list of strings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopSequences(pub Vec<String>);

impl<'de> Deserialize<'de> for StopSequences {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StopVisitor;
        impl<'de> Visitor<'de> for StopVisitor {
            type Value = StopSequences;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of strings")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StopSequences, E> {
                Ok(StopSequences(vec![v.to_owned()]))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<StopSequences, A::Error> {
                let mut stops = Vec::new();
                while let Some(stop) = seq.next_element::<String>()? {
                    stops.push(stop);
                }
                Ok(StopSequences(stops))
            }
        }
        deserializer.deserialize_any(StopVisitor)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// Reported when the reply's thinking is split off (a thinking model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionTokensDetails>,
}

/// What OpenAI reports of the completion beyond its length: here, its thinking tokens (those of
/// the thinking block, markers included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CompletionTokensDetails {
    pub reasoning_tokens: u32,
}

/// What OpenAI reports of the prompt beyond its length: here, the prompt tokens whose KV came
/// from the prefix cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: None,
            completion_tokens_details: None,
        }
    }

    /// With `prompt_tokens_details.cached_tokens`.
    pub fn with_cached(self, cached_tokens: u32) -> Self {
        Self {
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
            ..self
        }
    }

    /// With the thinking tokens, when they were counted (`None`: no reasoning split).
    pub fn with_reasoning(self, reasoning_tokens: Option<u32>) -> Self {
        Self {
            completion_tokens_details: reasoning_tokens
                .map(|reasoning_tokens| CompletionTokensDetails { reasoning_tokens }),
            ..self
        }
    }

    /// The thinking tokens, 0 when none were counted.
    pub fn reasoning_tokens(&self) -> u32 {
        self.completion_tokens_details
            .map_or(0, |details| details.reasoning_tokens)
    }
}

/// Why a choice ended, as OpenAI spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` (or the context) reached.
    Length,
    /// The reply is tool calls (requests with `tools`).
    ToolCalls,
    /// The reply is a function call (requests with the legacy `functions`).
    FunctionCall,
}

/// The fields every response and chunk object opens with, in OpenAI's order. The objects embed
/// it with `#[serde(flatten)]`, which writes the same JSON as four fields of their own.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ObjectHeader {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
}

impl ObjectHeader {
    /// A new object: a fresh id with `id_prefix`, created now, reporting `model`.
    pub fn new(id_prefix: &str, object: &'static str, model: String) -> Self {
        Self {
            id: random_id(id_prefix),
            object,
            created: unix_now(),
            model,
        }
    }

    /// The same id, time and model on another kind of object (a response's chunks).
    pub fn with_object(&self, object: &'static str) -> Self {
        Self {
            object,
            ..self.clone()
        }
    }
}

/// A response id: `prefix` + 24 random alphanumerics (`chatcmpl-…`, `cmpl-…`).
pub fn random_id(prefix: &str) -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!(
        "{prefix}{}",
        Alphanumeric.sample_string(&mut rand::rng(), 24)
    )
}

/// Seconds since the Unix epoch, the unit of every `created` field.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or(0)
}
