//! API keys are known only by their SHA-256: the keys file stores digests, and a presented key
//! is hashed before it is compared, so a plain key is never held beyond the request that sent it.

use sha2::{Digest, Sha256};

/// A key's SHA-256.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct KeyDigest([u8; 32]);

impl KeyDigest {
    pub fn of_key(key: &str) -> Self {
        Self(Sha256::digest(key.as_bytes()).into())
    }

    /// 64 hex digits, either case (what `sha256sum` prints).
    pub fn from_hex(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.len() != 64 {
            return Err(format!(
                "`sha256` must be 64 hex digits, got {} characters",
                text.len()
            ));
        }
        let mut bytes = [0u8; 32];
        for (byte, pair) in bytes.iter_mut().zip(text.as_bytes().chunks(2)) {
            let high = hex_value(pair[0]);
            let low = hex_value(pair[1]);
            match (high, low) {
                (Some(high), Some(low)) => *byte = high << 4 | low,
                _ => return Err("`sha256` must be 64 hex digits".to_owned()),
            }
        }
        Ok(Self(bytes))
    }

    /// Compares every byte whatever differs, so response timing says nothing about how close
    /// a guess came.
    pub fn matches(&self, other: &KeyDigest) -> bool {
        self.0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
    }
}

/// Never prints the digest: it stands for a key.
impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyDigest(..)")
    }
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SHA-256 of "abc" from FIPS 180-2, appendix B.1.
    const ABC: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn hashes_as_the_standard_says() {
        assert!(KeyDigest::of_key("abc").matches(&KeyDigest::from_hex(ABC).unwrap()));
        let upper = ABC.to_uppercase();
        assert!(KeyDigest::of_key("abc").matches(&KeyDigest::from_hex(&upper).unwrap()));
        assert!(!KeyDigest::of_key("abd").matches(&KeyDigest::from_hex(ABC).unwrap()));
    }

    #[test]
    fn refuses_what_is_not_a_digest() {
        assert!(KeyDigest::from_hex("abc").is_err());
        assert!(KeyDigest::from_hex(&"g".repeat(64)).is_err());
        assert!(KeyDigest::from_hex(&"é".repeat(32)).is_err());
    }

    #[test]
    fn debug_hides_the_digest() {
        let shown = format!("{:?}", KeyDigest::from_hex(ABC).unwrap());
        assert!(!shown.contains("ba78"), "{shown}");
    }
}
