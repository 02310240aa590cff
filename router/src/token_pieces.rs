//! One token's own text and bytes, for logprob responses (`token`, `bytes`).
//!
//! Decoding a token alone is not enough: a byte-level BPE token can be half a UTF-8 character,
//! which decodes to U+FFFD and loses its bytes. So the bytes come from the vocabulary entry
//! itself where the tokenizer says how it maps to bytes (GPT-2's byte-to-character table for
//! byte-level BPE, `<0xHH>` byte-fallback pieces, sentencepiece's `▁` for a space), and the text
//! is those bytes read as UTF-8 (U+FFFD where incomplete). Anything else is decoded alone.

use std::collections::HashMap;
use std::sync::LazyLock;

use tokenizers::DecoderWrapper;

use crate::tokenizer::TextTokenizer;

/// What a token stands for on its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPiece {
    pub text: String,
    pub bytes: Vec<u8>,
    /// A special token: generated text does not contain it (skip_special_tokens).
    pub special: bool,
}

impl TokenPiece {
    /// Characters this token adds to a decoded text: 0 for a special token, else the UTF-8
    /// sequences its bytes start (a continuation byte continues a character already counted).
    pub fn text_chars(&self) -> usize {
        if self.special {
            return 0;
        }
        self.bytes.iter().filter(|&&b| b & 0xC0 != 0x80).count()
    }
}

/// GPT-2's table from the printable characters of byte-level BPE back to the bytes they spell.
static BYTE_LEVEL_CHARS: LazyLock<HashMap<char, u8>> = LazyLock::new(|| {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap_or('\u{FFFD}')
            };
            (c, b)
        })
        .collect()
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Spelling {
    ByteLevel,
    Metaspace,
    Other,
}

fn spelling(decoder: Option<&DecoderWrapper>) -> Spelling {
    match decoder {
        Some(DecoderWrapper::ByteLevel(_)) => Spelling::ByteLevel,
        Some(DecoderWrapper::Metaspace(_)) => Spelling::Metaspace,
        Some(DecoderWrapper::Sequence(sequence)) => sequence
            .get_decoders()
            .iter()
            .map(|decoder| spelling(Some(decoder)))
            .find(|&s| s != Spelling::Other)
            // Llama/Mistral spell spaces with `Replace("▁", " ")` in a sequence.
            .unwrap_or(if format!("{sequence:?}").contains('▁') {
                Spelling::Metaspace
            } else {
                Spelling::Other
            }),
        _ => Spelling::Other,
    }
}

/// `<0xHH>`: sentencepiece's byte-fallback piece for one byte.
fn byte_fallback(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// The text and bytes of token `id` under `tokenizer`.
pub fn token_piece(tokenizer: &TextTokenizer, id: u32) -> TokenPiece {
    let inner = tokenizer.inner();
    let added = inner.get_added_vocabulary();
    let raw = inner.id_to_token(id);
    if let Some(content) = added.simple_id_to_token(id) {
        let special = added.is_special_token(&content);
        return TokenPiece {
            bytes: content.clone().into_bytes(),
            text: content,
            special,
        };
    }
    let bytes = raw.as_deref().and_then(|raw| {
        if let Some(byte) = byte_fallback(raw) {
            return Some(vec![byte]);
        }
        match spelling(inner.get_decoder()) {
            Spelling::ByteLevel => raw
                .chars()
                .map(|c| BYTE_LEVEL_CHARS.get(&c).copied())
                .collect::<Option<Vec<u8>>>(),
            Spelling::Metaspace => Some(raw.replace('▁', " ").into_bytes()),
            Spelling::Other => None,
        }
    });
    let bytes = bytes.unwrap_or_else(|| {
        tokenizer
            .decode(&[id], false)
            .unwrap_or_default()
            .into_bytes()
    });
    TokenPiece {
        text: String::from_utf8_lossy(&bytes).into_owned(),
        bytes,
        special: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::test_support;

    /// The pieces of `text`'s tokens: their bytes joined, and their character count.
    fn joined(tokenizer: &TextTokenizer, text: &str) -> (Vec<TokenPiece>, Vec<u8>, usize) {
        let ids = tokenizer.encode_blocking(text, false).unwrap();
        let pieces: Vec<TokenPiece> = ids.iter().map(|&id| token_piece(tokenizer, id)).collect();
        let bytes = pieces.iter().flat_map(|p| p.bytes.clone()).collect();
        let chars = pieces.iter().map(TokenPiece::text_chars).sum();
        (pieces, bytes, chars)
    }

    #[test]
    fn byte_level_pieces_keep_their_true_bytes() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::byte_level_bpe());
        // "ß" is not in the training corpus: two byte tokens, each half a character.
        let (pieces, bytes, chars) = joined(&tokenizer, "a ß");
        assert_eq!(bytes, "a ß".as_bytes());
        assert_eq!(chars, 3);
        assert_eq!(pieces.last().unwrap().text, "\u{FFFD}");
        let eos = tokenizer.inner().token_to_id("<|eos|>").unwrap();
        let piece = token_piece(&tokenizer, eos);
        assert!(piece.special);
        assert_eq!((piece.text.as_str(), piece.text_chars()), ("<|eos|>", 0));
    }

    #[test]
    fn sentencepiece_pieces_spell_spaces_and_fallback_bytes() {
        let tokenizer = TextTokenizer::from_tokenizer(test_support::sentencepiece_style());
        let (pieces, bytes, chars) = joined(&tokenizer, "hello 你");
        assert_eq!(String::from_utf8(bytes).unwrap(), " hello 你");
        assert_eq!(chars, " hello 你".chars().count());
        assert!(pieces
            .iter()
            .any(|piece| piece.bytes.len() == 1 && piece.bytes[0] >= 0x80));
    }

    #[test]
    fn the_byte_table_is_gpt2s() {
        assert_eq!(BYTE_LEVEL_CHARS.len(), 256);
        assert_eq!(BYTE_LEVEL_CHARS[&'Ġ'], b' ');
        assert_eq!(BYTE_LEVEL_CHARS[&'Ċ'], b'\n');
        assert_eq!(BYTE_LEVEL_CHARS[&'a'], b'a');
        assert_eq!(byte_fallback("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback("<0x0A"), None);
    }
}
