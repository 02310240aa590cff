//! LoRA adapters through the HTTP surface, over `FakeShard`: id resolution and path escapes,
//! per-adapter chat templates and EOS, `/v1/models`, the load/unload endpoints, failed and
//! concurrent loads.
//!
//! References: the fake's documented per-adapter token rule (`fake_next_token_for`), templates
//! rendered by hand in this file, the test vocabulary's character table, and OpenAI's schema.

mod http_common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use axum::http::StatusCode;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::adapters::AdapterSource;
use serde_json::{json, Value};
use tempfile::TempDir;

/// A template unlike the base one (`<user>hi\n<assistant>`), so a prompt rendered with the
/// wrong template shows in its token count.
const ADAPTER_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
[{{ message.role }}] {{ message.content }}\n{% endfor %}\
{% if add_generation_prompt %}[assistant] {% endif %}";

/// `ADAPTER_TEMPLATE` rendered by hand for one user message (the base model's `<|bos|>`, since
/// the adapter has no special tokens of its own).
fn adapter_prompt_ids(content: &str) -> Vec<u32> {
    let mut ids = vec![BOS];
    ids.extend(text_ids(&format!("[user] {content}\n[assistant] ")));
    ids
}

/// An adapter root: `team/sql` and `plain` (adapters without files of their own), `chatty`
/// (its own chat template); beside it a `secret` directory, reachable from inside only through
/// the `escape` symlink.
struct AdapterDirs {
    _dir: TempDir,
    root: PathBuf,
    secret: PathBuf,
}

fn adapter_dirs() -> AdapterDirs {
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

fn local_options(dirs: &AdapterDirs) -> Options {
    Options {
        adapter_source: AdapterSource::Local,
        adapter_root: Some(dirs.root.clone()),
        ..Options::default()
    }
}

fn chat_for(model: &str, content: &str, extra: Value) -> Value {
    let mut body = chat_body(content, extra);
    body["model"] = json!(model);
    body
}

/// The text, finish reason and token count the fake produces for `adapter` after `prompt`.
fn expected_reply(adapter: &str, prompt: &[u32], max_tokens: u32) -> (String, &'static str, usize) {
    let last = *prompt.last().expect("a prompt");
    let (ids, finish) = expected_generation_for(adapter, last, max_tokens, false, &[EOS]);
    let shown: Vec<u32> = ids.iter().copied().filter(|&id| id != EOS).collect();
    (decode(&shown), finish, ids.len())
}

fn assert_error(status: StatusCode, body: &Value, expected: StatusCode, code: &str) {
    assert_eq!(status, expected, "{body}");
    assert_schema(body, "ErrorResponse");
    assert_eq!(body["error"]["code"], code, "{body}");
}

#[tokio::test]
async fn path_escapes_are_refused_before_reaching_the_shard() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(local_options(&dirs)).await;
    let absolute = dirs.secret.display().to_string();
    let inside_but_absolute = dirs.root.join("plain").display().to_string();
    for model in [
        absolute.as_str(),
        inside_but_absolute.as_str(),
        "../secret",
        "team/../../secret",
        "escape",
        "escape/../plain",
    ] {
        let (status, body) = app
            .post("/v1/chat/completions", &chat_for(model, "hi", json!({})))
            .await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_adapter_id");
        assert_eq!(body["error"]["param"], "model");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            !message.contains(dirs.secret.to_str().unwrap()) || model == absolute,
            "the answer must not reveal where a link points: {message}"
        );
    }
    // The same through `adapter_source` on a hub-by-default server.
    let hub_default = TestApp::with_options(Options {
        adapter_root: Some(dirs.root.clone()),
        ..Options::default()
    })
    .await;
    let (status, body) = hub_default
        .post(
            "/v1/completions",
            &json!({"model": "escape", "prompt": "x", "adapter_source": "local"}),
        )
        .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_adapter_id");
    assert!(app.shard.adapter_load_requests().is_empty());
    assert!(hub_default.shard.adapter_load_requests().is_empty());
}

#[tokio::test]
async fn unknown_and_unservable_ids_are_refused_with_the_right_code() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(local_options(&dirs)).await;
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_for("missing", "hi", json!({})),
        )
        .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");
    assert_eq!(body["error"]["param"], "model");

    // A local id on a server without --adapter-root.
    let no_root = TestApp::start().await;
    let (status, body) = no_root
        .post(
            "/v1/chat/completions",
            &chat_for("plain", "hi", json!({"adapter_source": "local"})),
        )
        .await;
    assert_error(
        status,
        &body,
        StatusCode::BAD_REQUEST,
        "adapter_root_not_set",
    );
    // A malformed hub id (owner/name[@revision]) is refused; a bare unknown name is simply
    // not a model this server has.
    let (status, body) = no_root
        .post(
            "/v1/chat/completions",
            &chat_for("org/bad name", "hi", json!({})),
        )
        .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_adapter_id");
    let (status, body) = no_root
        .post("/v1/chat/completions", &chat_for("gpt-4", "hi", json!({})))
        .await;
    assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");
    let (status, body) = no_root
        .post(
            "/v1/chat/completions",
            &chat_for("org/x", "hi", json!({"adapter_source": "s3"})),
        )
        .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_value");
    assert_eq!(body["error"]["param"], "adapter_source");
    assert!(app.shard.adapter_load_requests().is_empty());
    assert!(no_root.shard.adapter_load_requests().is_empty());
}

#[tokio::test]
async fn an_adapter_with_its_own_chat_template_is_rendered_with_it() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(local_options(&dirs)).await;
    let extra = json!({"max_tokens": 6, "return_token_ids": true});
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_for("chatty", "hi", extra.clone()),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_schema(&body, "CreateChatCompletionResponse");
    assert_eq!(body["model"], "chatty");
    let expected_prompt = adapter_prompt_ids("hi");
    let base_prompt = chat_prompt_ids("hi");
    assert_ne!(expected_prompt.len(), base_prompt.len());
    assert_eq!(
        body["usage"]["prompt_tokens"],
        json!(expected_prompt.len()),
        "{body}"
    );
    assert_eq!(body["prompt_token_ids"], json!(expected_prompt));
    let (text, finish, tokens) = expected_reply("chatty", &expected_prompt, 6);
    assert_eq!(body["choices"][0]["message"]["content"], text);
    assert_eq!(body["choices"][0]["finish_reason"], finish);
    assert_eq!(body["usage"]["completion_tokens"], json!(tokens));

    // The local load sent the checked, canonical directory.
    let loads = app.shard.adapter_load_requests();
    assert_eq!(loads.len(), 1);
    assert_eq!(loads[0].adapter_id, "chatty");
    assert_eq!(loads[0].source, "local");
    assert_eq!(Path::new(&loads[0].path), dirs.root.join("chatty"));

    // The base model keeps its own template.
    let (status, base) = app
        .post("/v1/chat/completions", &chat_body("hi", extra))
        .await;
    assert_eq!(status, StatusCode::OK, "{base}");
    assert_eq!(base["usage"]["prompt_tokens"], json!(base_prompt.len()));
    assert_eq!(base["model"], SERVED_NAME);

    // Streaming goes through the same assets.
    let (status, events) = app
        .stream(
            "/v1/chat/completions",
            &chat_for(
                "chatty",
                "hi",
                json!({"max_tokens": 6, "stream": true, "stream_options": {"include_usage": true}}),
            ),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let mut streamed = String::new();
    for event in &events[..events.len() - 1] {
        assert_schema(event, "CreateChatCompletionStreamResponse");
        assert_eq!(event["model"], "chatty");
        if let Some(content) = event["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(content);
        }
    }
    assert_eq!(streamed, text);
    let usage = &events[events.len() - 2]["usage"];
    assert_eq!(usage["prompt_tokens"], json!(expected_prompt.len()));
    assert_eq!(events.last().unwrap(), "[DONE]");
    // Loaded once, however many requests.
    assert_eq!(app.shard.adapter_load_requests().len(), 1);
}

#[tokio::test]
async fn an_adapter_tokenizer_ends_generation_on_its_own_eos() {
    let dirs = adapter_dirs();
    let adapter = "own-eos";
    let dir = dirs.root.join(adapter);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        tokenizer().to_string(false).unwrap(),
    )
    .unwrap();
    // The adapter's EOS: the third token the fake generates for it, a plain character the
    // base tokenizer does not stop on.
    let prompt = chat_prompt_ids("hi");
    let (chain, _) = expected_generation_for(adapter, *prompt.last().unwrap(), 8, true, &[]);
    let (position, &eos) = chain
        .iter()
        .enumerate()
        .skip(1)
        .find(|&(i, &id)| id > 2 && !chain[..i].contains(&id))
        .expect("a printable token early in the fake's sequence");
    std::fs::write(
        dir.join("tokenizer_config.json"),
        json!({"eos_token": token_text(eos)}).to_string(),
    )
    .unwrap();

    let app = TestApp::with_options(local_options(&dirs)).await;
    let (status, body) = app
        .post(
            "/v1/chat/completions",
            &chat_for(adapter, "hi", json!({"max_tokens": 8})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], json!(prompt.len()));
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(body["usage"]["completion_tokens"], json!(position + 1));
    assert_eq!(
        body["choices"][0]["message"]["content"],
        decode(&chain[..position])
    );
}

#[tokio::test]
async fn models_lists_the_base_model_first_then_every_adapter() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(Options {
        preload_adapters: vec!["team/sql".into(), "chatty".into()],
        ..local_options(&dirs)
    })
    .await;
    let (status, list) = app.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    assert_schema(&list, "ListModelsResponse");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|card| card["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [SERVED_NAME, "team/sql", "chatty"]);
    for card in list["data"].as_array().unwrap() {
        assert_schema(card, "Model");
        assert_eq!(card["object"], "model");
        assert_eq!(card["owned_by"], "quiver");
        assert!(card["created"].as_u64().unwrap() > 1_700_000_000);
    }
    assert!(list["data"][0].get("parent").is_none());
    let sql = &list["data"][1];
    assert_eq!(sql["parent"], SERVED_NAME);
    // Relative to the adapter root: server paths are not the clients' business.
    assert_eq!(sql["root"], "team/sql");

    // Ids with a slash are retrievable; lookups never load anything.
    let (status, card) = app.get("/v1/models/team/sql").await;
    assert_eq!(status, StatusCode::OK, "{card}");
    assert_schema(&card, "Model");
    assert_eq!(&card, sql);
    let loads_before = app.shard.adapter_load_requests().len();
    for unknown in ["/v1/models/plain", "/v1/models/org/unknown"] {
        let (status, body) = app.get(unknown).await;
        assert_error(status, &body, StatusCode::NOT_FOUND, "model_not_found");
    }
    assert_eq!(app.shard.adapter_load_requests().len(), loads_before);

    // An adapter loaded on demand joins the list.
    let (status, _) = app
        .post(
            "/v1/completions",
            &json!({"model": "plain", "prompt": "x", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let (_, list) = app.get("/v1/models").await;
    assert_eq!(list["data"].as_array().unwrap().len(), 4);
    assert_eq!(list["data"][3]["id"], "plain");
}

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
        while !app.state.adapters.is_loading(adapter) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let base = app
            .post(
                "/v1/chat/completions",
                &chat_body("hi", json!({"max_tokens": 4})),
            )
            .await;
        let still_loading = app.state.adapters.is_loading(adapter);
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
    assert_eq!(loads[0].source, "hub");
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

#[tokio::test]
async fn tokenize_loads_the_adapter_and_renders_its_own_template() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(local_options(&dirs)).await;
    let messages = json!([{"role": "user", "content": "hi"}]);
    let (status, body) = app
        .post(
            "/tokenize",
            &json!({"model": "chatty", "messages": messages}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["tokens"], json!(adapter_prompt_ids("hi")));
    // Loaded on first use, as a generation request would.
    assert_eq!(app.shard.adapter_load_requests().len(), 1);
    let (_, base) = app.post("/tokenize", &json!({"messages": messages})).await;
    assert_eq!(base["tokens"], json!(chat_prompt_ids("hi")));
    let (status, missing) = app
        .post("/detokenize", &json!({"model": "missing", "tokens": [5]}))
        .await;
    assert_error(status, &missing, StatusCode::NOT_FOUND, "model_not_found");
}
