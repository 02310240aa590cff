//! Adapters loaded and unloaded while the router runs, over `FakeShard`: preloads, the
//! load/unload endpoints, failed and concurrent loads, unloading under load, and one adapter per
//! directory (aliases share a load, names cannot squat).
//!
//! References: the fake's documented per-adapter token rule (`fake_next_token_for`), the test
//! vocabulary's character table, and OpenAI's schema.

mod http_common;

use std::time::Duration;

use axum::http::StatusCode;
use http_common::adapter_root::*;
use http_common::openapi::assert_schema;
use http_common::*;
use serde_json::{json, Value};

#[tokio::test]
async fn a_failed_preload_stops_start_up() {
    let dirs = adapter_dirs();
    let result = TestApp::try_with_options(Options {
        preload_adapters: vec!["plain".into(), "missing".into()],
        ..local_options(&dirs)
    })
    .await;
    let error = result.err().expect("start-up fails").to_string();
    assert!(error.contains("missing"), "{error}");
}

#[tokio::test]
async fn adapters_load_and_unload_at_run_time() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(Options {
        adapter_root: Some(dirs.root.clone()),
        ..Options::default()
    })
    .await;
    let load = json!({"lora_name": "sql", "lora_path": "team/sql", "adapter_source": "local"});
    let (status, text) = app.post_text("/v1/load_lora_adapter", &load).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert!(text.contains("sql"), "{text}");
    // Idempotent for the same path; the same name elsewhere is refused.
    let (status, _) = app.post_text("/v1/load_lora_adapter", &load).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(app.shard.adapter_load_requests().len(), 1);
    let (status, body) = app
        .post(
            "/v1/load_lora_adapter",
            &json!({"lora_name": "sql", "lora_path": "plain", "adapter_source": "local"}),
        )
        .await;
    assert_error(
        status,
        &body,
        StatusCode::BAD_REQUEST,
        "adapter_already_loaded",
    );
    // An absolute path (as vLLM clients send) is local, and must be inside the root.
    let inside = dirs.root.join("plain").display().to_string();
    let (status, text) = app
        .post_text(
            "/v1/load_lora_adapter",
            &json!({"lora_name": "plain-abs", "lora_path": inside}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let outside = dirs.secret.display().to_string();
    let (status, body) = app
        .post(
            "/v1/load_lora_adapter",
            &json!({"lora_name": "evil", "lora_path": outside}),
        )
        .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_adapter_id");
    assert_eq!(body["error"]["param"], "lora_path");
    let (status, body) = app
        .post("/v1/load_lora_adapter", &json!({"lora_path": "team/sql"}))
        .await;
    assert_error(
        status,
        &body,
        StatusCode::BAD_REQUEST,
        "missing_required_parameter",
    );
    assert_eq!(app.shard.adapter_load_requests().len(), 2);

    // Served under its name, with its own token sequence.
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_for("sql", "hi", json!({"max_tokens": 5})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], "sql");
    let (text, _, _) = expected_reply("sql", &chat_prompt_ids("hi"), 5);
    assert_eq!(body["choices"][0]["message"]["content"], text);
    let (_, list) = app.get("/v1/models").await;
    let sql = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|card| card["id"] == "sql")
        .expect("sql is listed");
    // Relative to the adapter root: server paths are not the clients' business.
    assert_eq!(sql["root"], "team/sql");

    let (status, text) = app
        .post_text("/v1/unload_lora_adapter", &json!({"lora_name": "sql"}))
        .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let (status, body) = app
        .post("/v1/chat/completions", &chat_for("sql", "hi", json!({})))
        .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");
    let (_, list) = app.get("/v1/models").await;
    assert!(list["data"]
        .as_array()
        .unwrap()
        .iter()
        .all(|card| card["id"] != "sql"));
    let (status, body) = app.get("/v1/models/sql").await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");
    let (status, body) = app
        .post(
            "/v1/unload_lora_adapter",
            &json!({"lora_name": "never-loaded"}),
        )
        .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");
    for _ in 0..200 {
        if app.shard.unloaded_adapters().contains(&"sql".to_owned()) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!(
        "the shard never unloaded sql: {:?}",
        app.shard.unloaded_adapters()
    );
}

#[tokio::test]
async fn a_failed_load_fails_its_requests_and_nothing_else() {
    let app = TestApp::start().await;
    app.shard
        .fail_adapter_load("org/too-big", "adapter rank 128 exceeds --max-lora-rank 64");
    app.shard.fail_adapter_load_with(
        "org/gone",
        tonic::Code::NotFound,
        "Repository Not Found for org/gone",
    );
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_for("org/too-big", "hi", json!({})),
        )
        .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_adapter");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rank 128"),
        "{body}"
    );
    let (status, body) = app
        .post(
            "/v1/completions",
            &json!({"model": "org/gone", "prompt": "x"}),
        )
        .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");

    // The base model and other adapters are unaffected.
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_body("hi", json!({"max_tokens": 4})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_for("org/fine", "hi", json!({"max_tokens": 4})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (text, _, _) = expected_reply("org/fine", &chat_prompt_ids("hi"), 4);
    assert_eq!(body["choices"][0]["message"]["content"], text);

    // A failure is not remembered: the next request tries again.
    let (status, _) = app
        .post(
            "/v1/chat/completions",
            &chat_for("org/too-big", "hi", json!({})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let attempts = app
        .shard
        .adapter_load_requests()
        .iter()
        .filter(|request| request.adapter_id == "org/too-big")
        .count();
    assert_eq!(attempts, 2);
    let (_, list) = app.get("/v1/models").await;
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|card| card["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [SERVED_NAME, "org/fine"]);
    app.wait_idle().await;
}

#[tokio::test]
async fn requests_for_an_adapter_still_loading_share_one_load_and_block_nobody() {
    let app = TestApp::with_options(Options {
        adapter_load_delay: Duration::from_millis(1500),
        ..Options::default()
    })
    .await;
    let adapter = "org/slow@v2";
    let bodies: Vec<Value> = (0..6)
        .map(|i| chat_for(adapter, &format!("q{i}"), json!({"max_tokens": 4})))
        .collect();
    let waiting = futures::future::join_all(
        bodies
            .iter()
            .map(|body| app.post("/v1/chat/completions", body)),
    );
    let meanwhile = async {
        while !app.state.infer.models().adapters().is_loading(adapter) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let base = app
            .post(
                "/v1/chat/completions",
                &chat_body("hi", json!({"max_tokens": 4})),
            )
            .await;
        let still_loading = app.state.infer.models().adapters().is_loading(adapter);
        (base, still_loading)
    };
    let (answers, ((base_status, base_body), still_loading)) = tokio::join!(waiting, meanwhile);
    assert_eq!(base_status, StatusCode::OK, "{base_body}");
    assert!(
        still_loading,
        "the base request waited for the adapter load"
    );
    for (i, (status, body)) in answers.into_iter().enumerate() {
        assert_eq!(status, StatusCode::OK, "{body}");
        assert_schema(&body, "CreateChatCompletionResponse");
        assert_eq!(body["model"], adapter);
        let (text, _, _) = expected_reply(adapter, &chat_prompt_ids(&format!("q{i}")), 4);
        assert_eq!(body["choices"][0]["message"]["content"], text);
    }
    let loads = app.shard.adapter_load_requests();
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].adapter_id, adapter);
    assert_eq!(loads[0].source.as_str(), "hub");
    assert_eq!(loads[0].revision, "v2");
    assert!(loads[0].path.is_empty());
    app.wait_idle().await;
}

#[tokio::test]
async fn unloading_lets_running_requests_finish() {
    let app = TestApp::with_options(Options {
        step_delay: Duration::from_millis(20),
        ..Options::default()
    })
    .await;
    let adapter = "org/busy";
    let body = chat_for(adapter, "hi", json!({"max_tokens": 12, "ignore_eos": true}));
    let running = app.post("/v1/chat/completions", &body);
    let unload = async {
        while app.shard.live_requests() == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let (status, text) = app
            .post_text("/v1/unload_lora_adapter", &json!({"lora_name": adapter}))
            .await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let (status, refused) = app
            .post("/v1/chat/completions", &chat_for(adapter, "hi", json!({})))
            .await;
        assert_error(status, &refused, StatusCode::NOT_FOUND, "model_not_found");
        // The running request still holds it.
        assert!(app.shard.unloaded_adapters().is_empty());
    };
    let ((status, body), ()) = tokio::join!(running, unload);
    assert_eq!(status, StatusCode::OK, "{body}");
    let last = *chat_prompt_ids("hi").last().unwrap();
    let (ids, _) = expected_generation_for(adapter, last, 12, true, &[EOS]);
    let shown: Vec<u32> = ids.iter().copied().filter(|&id| id != EOS).collect();
    assert_eq!(body["choices"][0]["message"]["content"], decode(&shown));
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    for _ in 0..200 {
        if app.shard.unloaded_adapters() == [adapter] {
            app.wait_idle().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("never unloaded: {:?}", app.shard.unloaded_adapters());
}

#[tokio::test]
async fn one_directory_is_one_adapter_and_names_cannot_squat() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(local_options(&dirs)).await;
    for spelling in ["plain", "./plain", "plain/", "././plain/."] {
        let (status, body) = app
            .post(
                "/v1/chat/completions",
                &chat_for(spelling, "hi", json!({"max_tokens": 2})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{spelling}: {body}");
        assert_eq!(body["model"], spelling);
    }
    assert_eq!(app.shard.adapter_load_requests().len(), 1);
    let load = |name: &str, path: &str| json!({"lora_name": name, "lora_path": path, "adapter_source": "local"});
    // `chatty` is another directory's id; `org/x` a hub id; `plain` is loaded as `plain`.
    for (name, path) in [
        ("chatty", "team/sql"),
        ("org/x", "team/sql"),
        ("copy", "plain"),
    ] {
        let (status, body) = app.post("/v1/load_lora_adapter", &load(name, path)).await;
        assert_error(status, &body, StatusCode::CONFLICT, "adapter_name_conflict");
        assert_eq!(body["error"]["param"], "lora_name");
    }
    for name in ["a\r\nforged", "a\u{0}", &"n".repeat(257)] {
        let (status, body) = app
            .post("/v1/load_lora_adapter", &load(name, "team/sql"))
            .await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_adapter_id");
        assert_eq!(body["error"]["param"], "lora_name");
    }
    assert_eq!(app.shard.adapter_load_requests().len(), 1);
}
