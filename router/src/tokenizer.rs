//! Tokenization with the Hugging Face `tokenizers` crate, plus the model's special tokens.
//!
//! Encoding a long prompt takes milliseconds of CPU, so `encode` runs on tokio's blocking pool
//! and never stalls the async runtime that serves streams.

use std::sync::Arc;

use serde_json::Value as Json;

use crate::files::{ConfinedDir, FileError};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// Names the file within its directory only, never a server path.
    #[error("cannot load tokenizer: {0}")]
    Load(#[from] FileError),
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("detokenization failed: {0}")]
    Decode(String),
    /// The blocking worker running the tokenizer died (panicked or the runtime is shutting down).
    #[error("tokenizer worker failed: {0}")]
    Worker(String),
}

/// The special tokens a model declares, as strings (`"<s>"`, `"<|im_end|>"`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<String>,
    pub eos: Option<String>,
}

impl SpecialTokens {
    /// Reads `bos_token`/`eos_token` from `tokenizer_config.json`, then fills what is missing
    /// from `special_tokens_map.json`. Each is a string or an AddedToken object
    /// (`{"content": "<s>", ...}`); `null` or absent means the model has none.
    pub fn from_dir(dir: &ConfinedDir) -> Result<Self, TokenizerError> {
        let mut tokens = SpecialTokens::default();
        for file in ["tokenizer_config.json", "special_tokens_map.json"] {
            let Some(config) = dir.read_json(file)? else {
                continue;
            };
            tokens.bos = tokens
                .bos
                .or_else(|| token_content(config.get("bos_token")));
            tokens.eos = tokens
                .eos
                .or_else(|| token_content(config.get("eos_token")));
        }
        Ok(tokens)
    }
}

/// The text of a special-token entry: `"<s>"` or `{"content": "<s>", ...}`.
fn token_content(entry: Option<&Json>) -> Option<String> {
    match entry? {
        Json::String(text) => Some(text.clone()),
        Json::Object(fields) => fields.get("content")?.as_str().map(str::to_owned),
        _ => None,
    }
}

/// A loaded tokenizer with its special tokens. Clone is cheap (shared).
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tokenizer: tokenizers::Tokenizer,
    special: SpecialTokens,
    stop_token_ids: Vec<u32>,
    /// See [`TextTokenizer::max_bytes_per_token`].
    max_bytes_per_token: Option<usize>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("special", &self.inner.special)
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json` and the special tokens of a model (or adapter) directory. Stop
    /// ids also include `generation_config.json`'s `eos_token_id` (an id or a list), which is
    /// what transformers' `generate` stops on (e.g. Llama 3's `<|eot_id|>`).
    pub fn from_dir(dir: &ConfinedDir) -> Result<Self, TokenizerError> {
        const FILE: &str = "tokenizer.json";
        let missing = || FileError::Unreadable {
            file: FILE.to_owned(),
            kind: "not found".to_owned(),
        };
        let bytes = dir.read(FILE)?.ok_or_else(missing)?;
        // The parser's message can quote the file or give a position in it: logged, not shown.
        let tokenizer = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|error| {
            tracing::warn!(dir = ?dir.path(), %error, "invalid tokenizer.json");
            FileError::Invalid {
                file: FILE.to_owned(),
                what: "tokenizer",
            }
        })?;
        let special = SpecialTokens::from_dir(dir)?;
        let generation_eos = dir
            .read_json("generation_config.json")?
            .and_then(|config| config.get("eos_token_id").cloned())
            .map(|ids| token_ids(&ids))
            .unwrap_or_default();
        Ok(Self::build(tokenizer, special, generation_eos))
    }

    /// Wraps an in-memory tokenizer that has no config files (tests).
    #[cfg(any(test, feature = "test-support"))]
    pub fn from_tokenizer(tokenizer: tokenizers::Tokenizer) -> Self {
        Self::build(tokenizer, SpecialTokens::default(), Vec::new())
    }

    fn build(
        tokenizer: tokenizers::Tokenizer,
        special: SpecialTokens,
        generation_eos: Vec<u32>,
    ) -> Self {
        // Ids come from the vocabulary, added tokens included (tokenizer.json's `added_tokens`).
        let id_of =
            |token: &Option<String>| token.as_deref().and_then(|t| tokenizer.token_to_id(t));
        let mut stop_token_ids: Vec<u32> = id_of(&special.eos).into_iter().collect();
        for id in generation_eos {
            if !stop_token_ids.contains(&id) {
                stop_token_ids.push(id);
            }
        }
        let max_bytes_per_token = max_bytes_per_token(&tokenizer);
        Self {
            inner: Arc::new(Inner {
                tokenizer,
                special,
                stop_token_ids,
                max_bytes_per_token,
            }),
        }
    }

    /// The most bytes of input text one token can stand for, so that a text of B bytes has at
    /// least B / this many tokens and can be refused as too long without tokenizing it.
    /// `None` when this tokenizer can drop input text (then no such bound holds).
    pub fn max_bytes_per_token(&self) -> Option<usize> {
        self.inner.max_bytes_per_token
    }

    /// Token ids of `text`. With `add_special_tokens` the tokenizer's post-processor adds what
    /// the model expects (e.g. BOS); a rendered chat prompt already holds them, so pass `false`.
    pub async fn encode(
        &self,
        text: String,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.encode_blocking(&text, add_special_tokens))
            .await
            .map_err(|err| TokenizerError::Worker(err.to_string()))?
    }

    /// The same as [`TextTokenizer::encode`] on the calling thread (for code already off the
    /// runtime, and tests).
    pub fn encode_blocking(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.inner
            .tokenizer
            .encode(text, add_special_tokens)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|err| TokenizerError::Encode(err.to_string()))
    }

    /// [`TextTokenizer::decode`] on the blocking pool: a long id list is not free.
    pub async fn decode_off_runtime(
        &self,
        ids: Vec<u32>,
        skip_special_tokens: bool,
    ) -> Result<String, TokenizerError> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.decode(&ids, skip_special_tokens))
            .await
            .map_err(|err| TokenizerError::Worker(err.to_string()))?
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|err| TokenizerError::Decode(err.to_string()))
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.inner.special.bos.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.inner.special.eos.as_deref()
    }

    /// Every id that ends generation: the tokenizer's EOS plus `generation_config.json`'s.
    pub fn stop_token_ids(&self) -> &[u32] {
        &self.inner.stop_token_ids
    }

    /// Vocabulary size including added tokens: every valid id is below it.
    pub fn vocab_size(&self) -> usize {
        self.inner.tokenizer.get_vocab_size(true)
    }

    /// The id of `text` when it is an added token of the tokenizer, and whether it is special.
    /// A family's markers (`<tool_call>`, `</think>`) are added tokens in most tokenizers: the
    /// grammar writes them by id, and a special one must be kept by the detokenizer.
    pub fn added_token(&self, text: &str) -> Option<(u32, bool)> {
        self.inner
            .tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .find(|(_, token)| token.content == text)
            .map(|(id, token)| (id, token.special))
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner.tokenizer
    }
}

/// Normalizers such as NFC can merge a few input bytes into fewer (three Hangul jamo, 9 bytes,
/// into one 3-byte syllable), so a token may stand for up to this many times its own length.
const NORMALIZATION_SLACK: usize = 4;

/// Pipeline steps that drop input text, so a long text can be few tokens: whitespace splitters
/// (BERT-style), stripping and cleaning normalizers.
const DROPPING_STEPS: [&str; 7] = [
    "Strip",
    "StripAccents",
    "BertNormalizer",
    "Nmt",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
];

/// The longest vocabulary entry in bytes, times [`NORMALIZATION_SLACK`]. A vocabulary entry's
/// text is never shorter than the input it covers: byte-level BPE spells each byte as one
/// character of one or two bytes, Metaspace's `▁` (3 bytes) stands for one space, and a
/// byte-fallback token (`<0x0A>`) for one byte. `None` for tokenizers that drop input
/// (`DROPPING_STEPS`, an empty `Replace`, or unknown characters fused into one token).
fn max_bytes_per_token(tokenizer: &tokenizers::Tokenizer) -> Option<usize> {
    let config: Json = serde_json::from_str(&tokenizer.to_string(false).ok()?).ok()?;
    let drops = |step: &Json| {
        let mut found = false;
        visit_steps(step, &mut |step| {
            let kind = step.get("type").and_then(Json::as_str).unwrap_or_default();
            let empty_replace =
                kind == "Replace" && step.get("content").and_then(Json::as_str) == Some("");
            found |= DROPPING_STEPS.contains(&kind) || empty_replace;
        });
        found
    };
    let model = &config["model"];
    let fuses_unknown =
        model["fuse_unk"].as_bool() == Some(true) && model["byte_fallback"].as_bool() != Some(true);
    if drops(&config["normalizer"]) || drops(&config["pre_tokenizer"]) || fuses_unknown {
        return None;
    }
    let longest = tokenizer.get_vocab(true).keys().map(String::len).max()?;
    Some(longest.max(1) * NORMALIZATION_SLACK)
}

/// Calls `visit` on every object of a normalizer or pre-tokenizer tree (sequences nest).
fn visit_steps(value: &Json, visit: &mut impl FnMut(&Json)) {
    match value {
        Json::Object(fields) => {
            visit(value);
            fields.values().for_each(|field| visit_steps(field, visit));
        }
        Json::Array(items) => items.iter().for_each(|item| visit_steps(item, visit)),
        _ => {}
    }
}

/// `eos_token_id` as generation_config.json writes it: one id or a list of ids.
fn token_ids(value: &Json) -> Vec<u32> {
    let as_id = |v: &Json| v.as_u64().and_then(|id| u32::try_from(id).ok());
    match value {
        Json::Array(items) => items.iter().filter_map(as_id).collect(),
        other => as_id(other).into_iter().collect(),
    }
}

#[cfg(test)]
pub(crate) mod test_support;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_accept_strings_objects_and_fallback_file() {
        let dir = test_support::TempDir::new("special-tokens");
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": null}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("special_tokens_map.json"),
            r#"{"bos_token": "<ignored>", "eos_token": "</s>"}"#,
        )
        .unwrap();
        let tokens = SpecialTokens::from_dir(&ConfinedDir::model_dir(dir.path()).unwrap()).unwrap();
        assert_eq!(tokens.bos.as_deref(), Some("<s>"));
        assert_eq!(tokens.eos.as_deref(), Some("</s>"));
    }

    #[test]
    fn from_dir_resolves_ids_and_generation_stop_ids() {
        let dir = test_support::TempDir::new("tokenizer-dir");
        let tokenizer = test_support::byte_level_bpe();
        tokenizer
            .save(dir.path().join("tokenizer.json"), false)
            .unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": "<|bos|>", "eos_token": "<|eos|>"}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [2, 1]}"#,
        )
        .unwrap();
        let loaded = TextTokenizer::from_dir(&ConfinedDir::model_dir(dir.path()).unwrap()).unwrap();
        let eos = tokenizer.token_to_id("<|eos|>").unwrap();
        assert_eq!(loaded.eos_token(), Some("<|eos|>"));
        assert_eq!(loaded.stop_token_ids()[0], eos);
        assert!(loaded.stop_token_ids().contains(&2) && loaded.stop_token_ids().contains(&1));
    }

    #[test]
    fn a_text_has_at_least_its_bytes_over_the_bound_tokens() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::byte_level_bpe());
        let bound = tokenizer
            .max_bytes_per_token()
            .expect("byte-level BPE keeps every byte");
        for text in [
            "héllo 世界 👋🏽 <|eos|>",
            "aaaaaaaaaaaaaaaaaaaaaaaaa",
            " \n\n\t  x",
        ] {
            let tokens = tokenizer.encode_blocking(text, false).unwrap().len();
            assert!(
                tokens >= text.len().div_ceil(bound),
                "{text:?}: {tokens} tokens"
            );
        }
        let mut bert = test_support::byte_level_bpe();
        bert.with_pre_tokenizer(Some(
            tokenizers::pre_tokenizers::whitespace::WhitespaceSplit,
        ));
        assert_eq!(
            TextTokenizer::from_tokenizer(bert).max_bytes_per_token(),
            None
        );
    }

    #[tokio::test]
    async fn encode_on_blocking_pool_round_trips() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::byte_level_bpe());
        let text = "héllo 世界 👋🏽 <|eos|>";
        let ids = tokenizer.encode(text.to_owned(), false).await.unwrap();
        assert_eq!(ids, tokenizer.encode_blocking(text, false).unwrap());
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
        let eos = tokenizer.inner().token_to_id("<|eos|>").unwrap();
        assert_eq!(ids.last(), Some(&eos), "special token is matched whole");
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), "héllo 世界 👋🏽 ");
    }
}
