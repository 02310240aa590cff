//! Incremental detokenization: token ids in, text out, one token at a time.
//!
//! Decoding each token on its own is wrong twice over: a byte-level BPE token can hold half a
//! UTF-8 character, and sentencepiece decoders drop the leading space of the first token they
//! see. So each step decodes a short window twice — `prefix` (tokens already turned into text)
//! and `prefix + new tokens` — and emits the difference, but only once it no longer ends in
//! U+FFFD (an incomplete character). The window then slides forward to the last complete
//! point. This is the prefix/read-offset scheme of TGI and vLLM.

use crate::tokenizer::{TextTokenizer, TokenizerError};

const REPLACEMENT: char = '\u{FFFD}';

pub struct IncrementalDetokenizer {
    tokenizer: TextTokenizer,
    skip_special_tokens: bool,
    /// Token ids from `prefix_offset` on (older ones are dropped as the window slides).
    ids: Vec<u32>,
    /// `ids[..prefix_offset]` is no longer needed; `ids[prefix_offset..read_offset]` is context
    /// whose text has already been emitted; `ids[read_offset..]` has not been emitted yet.
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDetokenizer {
    /// A detokenizer for generated text that starts from nothing.
    pub fn new(tokenizer: TextTokenizer, skip_special_tokens: bool) -> Self {
        Self {
            tokenizer,
            skip_special_tokens,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }

    /// Adds one generated token; returns the text that became complete (often empty).
    pub fn push(&mut self, token_id: u32) -> Result<String, TokenizerError> {
        self.ids.push(token_id);
        let prefix_text = self.decode(self.prefix_offset..self.read_offset)?;
        let full_text = self.decode(self.prefix_offset..self.ids.len())?;
        if full_text.ends_with(REPLACEMENT) {
            // Possibly half a character: wait for the tokens that complete it.
            return Ok(String::new());
        }
        let new_text = text_after(&prefix_text, &full_text);
        if new_text.is_empty() {
            return Ok(String::new());
        }
        let new_text = new_text.to_owned();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        // Drop ids that can no longer be part of a window.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(new_text)
    }

    /// Text still held back at the end of generation (an incomplete character is emitted as
    /// U+FFFD here, exactly as decoding all ids at once would show it).
    pub fn finish(&mut self) -> String {
        let texts = (
            self.decode(self.prefix_offset..self.read_offset),
            self.decode(self.prefix_offset..self.ids.len()),
        );
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        match texts {
            (Ok(prefix_text), Ok(full_text)) => text_after(&prefix_text, &full_text).to_owned(),
            _ => String::new(),
        }
    }

    fn decode(&self, range: std::ops::Range<usize>) -> Result<String, TokenizerError> {
        if range.is_empty() {
            return Ok(String::new());
        }
        self.tokenizer
            .decode(&self.ids[range], self.skip_special_tokens)
    }
}

/// The part of `full` after `prefix`. Normally `prefix` is a prefix of `full`; when it is not
/// (the context began or ended inside a character the new tokens completed), the text after
/// their longest common prefix is new.
fn text_after<'a>(prefix: &str, full: &'a str) -> &'a str {
    if let Some(rest) = full.strip_prefix(prefix) {
        return rest;
    }
    let common = prefix
        .char_indices()
        .zip(full.chars())
        .find(|((_, a), b)| a != b)
        .map_or(prefix.len().min(full.len()), |((idx, _), _)| idx);
    &full[common..]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support;

    /// Streams `ids` one by one; returns the chunks (including what `finish` returns).
    fn stream(tokenizer: &TextTokenizer, ids: &[u32], skip: bool) -> Vec<String> {
        let mut detok = IncrementalDetokenizer::new(tokenizer.clone(), skip);
        let mut chunks: Vec<String> = ids.iter().map(|id| detok.push(*id).unwrap()).collect();
        chunks.push(detok.finish());
        chunks
    }

    fn assert_stream_matches_decode(tokenizer: &TextTokenizer, ids: &[u32], skip: bool) {
        let chunks = stream(tokenizer, ids, skip);
        let expected = tokenizer.decode(ids, skip).unwrap();
        assert_eq!(chunks.concat(), expected, "ids {ids:?}");
        for chunk in &chunks {
            assert!(
                !chunk.contains(REPLACEMENT),
                "chunk {chunk:?} of {chunks:?}"
            );
        }
    }

    const TEXTS: &[&str] = &[
        "hello world",
        "你好，世界。新的汉字 👋🏽 emoji 😀🎉🦀 mixed: héllo wörld",
        "🦀🦀 ȝ 𝄞 rare chars ﷽ at the end 😀",
        "  leading and trailing spaces  \n\n and lines",
    ];

    #[test]
    fn byte_level_stream_equals_full_decode_without_partial_chars() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::byte_level_bpe());
        let mut split_chars = 0;
        for text in TEXTS {
            let ids = tokenizer.encode_blocking(text, false).unwrap();
            // The test only means something if some characters really span several tokens.
            split_chars += ids
                .iter()
                .filter(|id| {
                    tokenizer
                        .decode(&[**id], false)
                        .unwrap()
                        .contains(REPLACEMENT)
                })
                .count();
            assert_stream_matches_decode(&tokenizer, &ids, false);
        }
        assert!(split_chars > 5, "too few split characters: {split_chars}");
    }

    #[test]
    fn skip_special_tokens_in_stream() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::byte_level_bpe());
        let ids = tokenizer
            .encode_blocking("<|bos|>你好 😀<|eos|> world<|eos|>", false)
            .unwrap();
        assert_stream_matches_decode(&tokenizer, &ids, true);
        assert_stream_matches_decode(&tokenizer, &ids, false);
        assert_eq!(stream(&tokenizer, &ids, true).concat(), "你好 😀 world");
    }

    #[test]
    fn sentencepiece_style_keeps_spaces_and_byte_fallback_chars() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::sentencepiece_style());
        for text in [
            "hello world, the café!",
            "hello 世界 😀 world",
            "Hello  World",
        ] {
            let ids = tokenizer.encode_blocking(text, false).unwrap();
            assert_eq!(tokenizer.decode(&ids, false).unwrap(), text);
            assert_stream_matches_decode(&tokenizer, &ids, false);
        }
    }

    #[test]
    fn unfinished_character_is_flushed_by_finish() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::byte_level_bpe());
        let ids = tokenizer.encode_blocking("ab🦀", false).unwrap();
        let cut = &ids[..ids.len() - 1];
        let chunks = stream(&tokenizer, cut, false);
        assert_eq!(chunks.concat(), tokenizer.decode(cut, false).unwrap());
        assert!(chunks.last().unwrap().contains(REPLACEMENT));
        assert!(chunks[..chunks.len() - 1]
            .iter()
            .all(|chunk| !chunk.contains(REPLACEMENT)));
    }
}
