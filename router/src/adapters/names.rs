//! What a client-given adapter name may look like (`model`, `lora_name`, `lora_path`): names
//! end up in logs, metrics labels and the shards' messages, so they are bounded and printable.

use super::AdapterError;

/// The longest adapter id or name accepted, in bytes.
pub const MAX_ADAPTER_NAME_BYTES: usize = 256;

/// Refuses control characters (C0, DEL, C1: CR/LF/NUL/ESC would forge or garble log lines) and
/// names over [`MAX_ADAPTER_NAME_BYTES`].
pub fn check_name(name: &str) -> Result<(), AdapterError> {
    let invalid = |reason: &str| AdapterError::InvalidId {
        // The name itself is not echoed: it is what is malformed.
        id: name.escape_debug().take(64).collect(),
        reason: reason.to_owned(),
    };
    if name.len() > MAX_ADAPTER_NAME_BYTES {
        return Err(invalid(&format!(
            "adapter names are at most {MAX_ADAPTER_NAME_BYTES} bytes"
        )));
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
    }
}
