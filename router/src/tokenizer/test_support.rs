//! Tiny tokenizers built in-process for the router's unit tests (nothing is downloaded).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainer, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// Text with accents, CJK and emoji (a skin-tone modifier makes a two-code-point cluster), so
/// that the trained vocabulary merges some multi-byte characters and leaves others as bytes.
pub const CORPUS: &[&str] = &[
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld — naïve café, déjà vu",
    "你好，世界。你好吗？世界很大。",
    "emoji 👋🏽 wave 😀 grin 🎉 party 👋🏽 again",
    "the world says hello to the world",
];

/// A GPT-2 style byte-level BPE (ByteLevel pre-tokenizer and decoder) trained on [`CORPUS`]
/// with a deliberately small vocabulary, plus special tokens `<|bos|>` and `<|eos|>`.
pub fn byte_level_bpe() -> Tokenizer {
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    let mut trainer: TrainerWrapper = BpeTrainer::builder()
        .vocab_size(330)
        .min_frequency(1)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![
            AddedToken::from("<|bos|>", true),
            AddedToken::from("<|eos|>", true),
        ])
        .build()
        .into();
    tokenizer
        .train(&mut trainer, CORPUS.iter())
        .expect("training a tiny BPE succeeds");
    tokenizer
}

/// A Llama-2 style sentencepiece tokenizer written as tokenizer.json: `▁` for spaces, byte
/// fallback for characters outside the vocabulary (every CJK character and emoji here), and the
/// `Replace → ByteFallback → Fuse → Strip` decoder that drops the leading space.
pub fn sentencepiece_style() -> Tokenizer {
    let mut vocab = serde_json::Map::new();
    for token in ["<unk>", "<s>", "</s>"] {
        vocab.insert(token.into(), vocab.len().into());
    }
    for byte in 0..=255u8 {
        vocab.insert(format!("<0x{byte:02X}>"), vocab.len().into());
    }
    for ch in "▁abcdefghijklmnopqrstuvwxyzHW,.!é".chars() {
        vocab.insert(ch.to_string(), vocab.len().into());
    }
    let mut merges = Vec::new();
    for word in ["▁hello", "▁world", "▁the", "▁café"] {
        let chars: Vec<char> = word.chars().collect();
        for end in 2..=chars.len() {
            let left: String = chars[..end - 1].iter().collect();
            let merged: String = chars[..end].iter().collect();
            if !vocab.contains_key(&merged) {
                merges.push(serde_json::json!([left, chars[end - 1].to_string()]));
                vocab.insert(merged, vocab.len().into());
            }
        }
    }
    let special = |id: usize, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        ]},
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}
        ]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    json.to_string()
        .parse()
        .expect("hand-written tokenizer.json parses")
}

/// A directory under the system temp dir, removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(label: &str) -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let unique = format!(
            "quiver-router-{label}-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(unique);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create temp dir");
        Self(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
