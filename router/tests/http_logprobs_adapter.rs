//! Logprob tokens are spelled with the request's own tokenizer: an adapter that ships a
//! tokenizer.json of its own (here the test vocabulary with every text token's spelling rotated
//! by one) gets its tokens' text and bytes from it, not from the base model's.

mod http_common;

use axum::http::StatusCode;
use http_common::adapter_root::{adapter_dirs, local_options};
use http_common::*;
use serde_json::{json, Value};

const ADAPTER: &str = "rotated";

/// The adapter's spelling of token `id`: the base spelling of the next text token.
fn rotated(id: u32) -> String {
    match id {
        BOS | EOS => token_text(id),
        id => token_text(2 + (id - 2 + 1) % (VOCAB - 2)),
    }
}

fn rotated_tokenizer_json() -> String {
    let mut json: Value = serde_json::from_str(&tokenizer().to_string(false).unwrap()).unwrap();
    let vocab = json["model"]["vocab"].as_object_mut().unwrap();
    vocab.retain(|_, id| id.as_u64().is_some_and(|id| id < 2));
    for id in 2..VOCAB {
        vocab.insert(rotated(id), json!(id));
    }
    json.to_string()
}

#[tokio::test]
async fn an_adapters_own_tokenizer_spells_its_logprob_tokens() {
    let dirs = adapter_dirs();
    let dir = dirs.root.join(ADAPTER);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("adapter_config.json"), "{}").unwrap();
    std::fs::write(dir.join("tokenizer.json"), rotated_tokenizer_json()).unwrap();
    let app = TestApp::with_options(local_options(&dirs)).await;

    let prompt = text_ids("abc");
    let body = json!({"model": ADAPTER, "prompt": prompt, "max_tokens": 6, "logprobs": 1,
                      "ignore_eos": true, "echo": true});
    let (status, response) = app.post("/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{response}");
    let (ids, _) = expected_generation_for(ADAPTER, prompt[2], 6, true, &[EOS]);
    let all: Vec<u32> = prompt.iter().chain(&ids).copied().collect();
    let spelled: Vec<String> = all.iter().map(|&id| rotated(id)).collect();
    let choice = &response["choices"][0];
    assert_eq!(choice["logprobs"]["tokens"], json!(spelled));
    // The echoed ids are decoded with the adapter's tokenizer too.
    assert_eq!(choice["text"], spelled.concat());
    // The alternative, and the prompt token itself, both spelled by the adapter's tokenizer.
    let mut expected_top = serde_json::Map::new();
    expected_top.insert("<|bos|>".to_owned(), json!(0.0));
    expected_top.insert(
        rotated(prompt[1]),
        choice["logprobs"]["token_logprobs"][1].clone(),
    );
    assert_eq!(
        choice["logprobs"]["top_logprobs"][1],
        serde_json::Value::Object(expected_top)
    );
    assert_ne!(rotated(prompt[0]), token_text(prompt[0]));
}
