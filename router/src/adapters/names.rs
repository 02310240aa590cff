//! What a client-given adapter name may look like (`model`, `lora_name`, `lora_path`): names
//! end up in logs, metrics labels and the shards' messages, so they are bounded and printable.

use super::AdapterError;

/// The longest adapter id or name accepted, in bytes.
pub const MAX_ADAPTER_NAME_BYTES: usize = 256;
/// The longest `lora_path` accepted, in bytes (an absolute path inside the root may be long).
pub const MAX_ADAPTER_PATH_BYTES: usize = 4096;

/// Refuses control characters (C0, DEL, C1: CR/LF/NUL/ESC would forge or garble log lines) and
/// names over [`MAX_ADAPTER_NAME_BYTES`].
pub fn check_name(name: &str) -> Result<(), AdapterError> {
    check_text(name, MAX_ADAPTER_NAME_BYTES)
}

/// As [`check_name`] for a `lora_path`, up to [`MAX_ADAPTER_PATH_BYTES`].
pub fn check_path(path: &str) -> Result<(), AdapterError> {
    check_text(path, MAX_ADAPTER_PATH_BYTES)
}

fn check_text(name: &str, max_bytes: usize) -> Result<(), AdapterError> {
    let invalid = |reason: &str| AdapterError::InvalidId {
        // The name itself is not echoed: it is what is malformed.
        id: name.escape_debug().take(64).collect(),
        reason: reason.to_owned(),
    };
    if name.len() > max_bytes {
        return Err(invalid(&format!("at most {max_bytes} bytes are allowed")));
    }
    if name.chars().any(char::is_control) {
        return Err(invalid("adapter names must not contain control characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_and_long_names_are_refused() {
        for bad in ["a\nb", "a\rb", "a\0b", "a\u{1b}[31m", "a\u{85}b", "a\u{7f}"] {
            let error = check_name(bad).unwrap_err();
            assert_eq!(error.code(), "invalid_adapter_id", "{bad:?}");
            assert!(!error.to_string().chars().any(char::is_control), "{error}");
        }
        assert!(check_name(&"x".repeat(MAX_ADAPTER_NAME_BYTES)).is_ok());
        assert!(check_name(&"x".repeat(MAX_ADAPTER_NAME_BYTES + 1)).is_err());
        assert!(check_name("org/name@v1.0 é").is_ok());
        assert!(check_path(&"x".repeat(MAX_ADAPTER_PATH_BYTES)).is_ok());
        assert!(check_path("a\nb").is_err());
    }
}
