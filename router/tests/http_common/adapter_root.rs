//! The adapter root the adapter HTTP tests share: adapter directories (one with its own chat
//! template, one reachable only through a symlink out of the root), the options that serve
//! them, and the replies the fake gives for them.

use std::path::PathBuf;

use axum::http::StatusCode;
use quiver_router::adapters::AdapterSource;
use serde_json::{json, Value};
use tempfile::TempDir;

use super::openapi::assert_schema;
use super::*;

/// A template unlike the base one (`<user>hi\n<assistant>`), so a prompt rendered with the
/// wrong template shows in its token count.
pub const ADAPTER_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
[{{ message.role }}] {{ message.content }}\n{% endfor %}\
{% if add_generation_prompt %}[assistant] {% endif %}";

/// `ADAPTER_TEMPLATE` rendered by hand for one user message (the base model's `<|bos|>`, since
/// the adapter has no special tokens of its own).
pub fn adapter_prompt_ids(content: &str) -> Vec<u32> {
    let mut ids = vec![BOS];
    ids.extend(text_ids(&format!("[user] {content}\n[assistant] ")));
    ids
}

/// An adapter root: `team/sql` and `plain` (adapters without files of their own), `chatty`
/// (its own chat template); beside it a `secret` directory, reachable from inside only through
/// the `escape` symlink.
pub struct AdapterDirs {
    _dir: TempDir,
    pub root: PathBuf,
    pub secret: PathBuf,
}

pub fn adapter_dirs() -> AdapterDirs {
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join("adapters");
    let secret = dir.path().join("secret");
    for adapter in ["team/sql", "plain", "chatty"] {
        std::fs::create_dir_all(root.join(adapter)).unwrap();
        std::fs::write(root.join(adapter).join("adapter_config.json"), "{}").unwrap();
    }
    std::fs::write(root.join("chatty/chat_template.jinja"), ADAPTER_TEMPLATE).unwrap();
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::write(secret.join("adapter_config.json"), "{}").unwrap();
    std::os::unix::fs::symlink(&secret, root.join("escape")).unwrap();
    AdapterDirs {
        _dir: dir,
        root: root.canonicalize().unwrap(),
        secret: secret.canonicalize().unwrap(),
    }
}

pub fn local_options(dirs: &AdapterDirs) -> Options {
    Options {
        adapter_source: AdapterSource::Local,
        adapter_root: Some(dirs.root.clone()),
        ..Options::default()
    }
}

pub fn chat_for(model: &str, content: &str, extra: Value) -> Value {
    let mut body = chat_body(content, extra);
    body["model"] = json!(model);
    body
}

/// The text, finish reason and token count the fake produces for `adapter` after `prompt`.
pub fn expected_reply(
    adapter: &str,
    prompt: &[u32],
    max_tokens: u32,
) -> (String, &'static str, usize) {
    let last = *prompt.last().expect("a prompt");
    let (ids, finish) = expected_generation_for(adapter, last, max_tokens, false, &[EOS]);
    let shown: Vec<u32> = ids.iter().copied().filter(|&id| id != EOS).collect();
    (decode(&shown), finish, ids.len())
}

pub fn assert_error(status: StatusCode, body: &Value, expected: StatusCode, code: &str) {
    assert_eq!(status, expected, "{body}");
    assert_schema(body, "ErrorResponse");
    assert_eq!(body["error"]["code"], code, "{body}");
}
