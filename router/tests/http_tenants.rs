//! `--api-keys-file` in process, against the fake shard: what a key may name, admin-only
//! adapter management and `/metrics`, per-key 429s with their `Retry-After`, and the per-key
//! counters. The
//! launched stack repeats these with adapters (integration-tests/test_tenants.py).

mod http_common;

use std::io::Write;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use http_common::{completion_body, Options, TestApp, SERVED_NAME};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tower::ServiceExt;

const COMPLETIONS: &str = "/v1/completions";

/// The digest as `sha256sum` prints it.
fn sha256_hex(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

async fn app_with_keys() -> (TestApp, tempfile::NamedTempFile) {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    let text = format!(
        "keys:\n\
         - {{name: user, sha256: {}, base_model: true}}\n\
         - {{name: adapters-only, sha256: {}, adapters: ['org/*']}}\n\
         - {{name: ops, sha256: {}, adapters: ['*'], base_model: true, admin: true}}\n\
         - {{name: slow, sha256: {}, base_model: true, limits: {{requests_per_minute: 1}}}}\n\
         - {{name: solo, sha256: {}, base_model: true, limits: {{max_concurrent_requests: 1}}}}\n",
        sha256_hex("k-user"),
        sha256_hex("k-adapters"),
        sha256_hex("k-ops"),
        sha256_hex("k-slow"),
        sha256_hex("k-solo"),
    );
    file.write_all(text.as_bytes()).unwrap();
    let app = TestApp::with_options(Options {
        api_keys_file: Some(file.path().to_owned()),
        ..Options::default()
    })
    .await;
    (app, file)
}

fn request(method: &str, path: &str, key: &str, body: Option<&Value>) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {key}"))
        .body(body.map_or_else(Body::empty, |body| Body::from(body.to_string())))
        .unwrap()
}

async fn send(app: &TestApp, request: Request<Body>) -> (StatusCode, Option<String>, String) {
    let response = app.app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|value| value.to_str().unwrap().to_owned());
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    (
        status,
        retry_after,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

fn completion(model: &str) -> Value {
    completion_body(json!("Hi"), json!({"model": model, "max_tokens": 2}))
}

#[tokio::test]
async fn a_forbidden_base_model_answers_as_a_missing_model() {
    let (app, _file) = app_with_keys().await;
    let body = completion(SERVED_NAME);
    let (status, _, _) = send(&app, request("POST", COMPLETIONS, "k-user", Some(&body))).await;
    assert_eq!(status, StatusCode::OK);
    let forbidden = send(
        &app,
        request("POST", COMPLETIONS, "k-adapters", Some(&body)),
    )
    .await;
    let missing = send(
        &app,
        request(
            "POST",
            COMPLETIONS,
            "k-user",
            Some(&completion("no-such-model")),
        ),
    )
    .await;
    assert_eq!(forbidden.0, StatusCode::NOT_FOUND);
    assert_eq!(
        (forbidden.0, forbidden.2.replace(SERVED_NAME, "<ID>")),
        (missing.0, missing.2.replace("no-such-model", "<ID>"))
    );
    let (_, _, listed) = send(&app, request("GET", "/v1/models", "k-adapters", None)).await;
    assert_eq!(
        serde_json::from_str::<Value>(&listed).unwrap()["data"],
        json!([])
    );
    let path = format!("/v1/models/{SERVED_NAME}");
    let (status, _, _) = send(&app, request("GET", &path, "k-adapters", None)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn unknown_keys_get_401_and_non_admins_403() {
    let (app, _file) = app_with_keys().await;
    let body = json!({"lora_name": "org/a", "lora_path": "org/a"});
    for (key, expected) in [
        ("k-nobody", StatusCode::UNAUTHORIZED),
        ("k-user", StatusCode::FORBIDDEN),
    ] {
        for path in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] {
            let (status, _, text) = send(&app, request("POST", path, key, Some(&body))).await;
            assert_eq!(status, expected, "{key} {path}: {text}");
        }
    }
    // The admin gets past the check (the fake hub has no such adapter).
    let (status, _, text) = send(
        &app,
        request("POST", "/v1/unload_lora_adapter", "k-ops", Some(&body)),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{text}");
}

#[tokio::test]
async fn limits_answer_429_with_retry_after() {
    let (app, _file) = app_with_keys().await;
    let body = completion(SERVED_NAME);
    let (status, _, _) = send(&app, request("POST", COMPLETIONS, "k-slow", Some(&body))).await;
    assert_eq!(status, StatusCode::OK);
    let (status, retry, text) =
        send(&app, request("POST", COMPLETIONS, "k-slow", Some(&body))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{text}");
    let retry: u64 = retry.unwrap().parse().unwrap();
    assert!((59..=60).contains(&retry), "{retry}");
    let error: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded");
    assert_eq!(error["error"]["type"], "rate_limit_error");
}

#[tokio::test]
async fn a_stream_holds_its_place_until_its_body_is_dropped() {
    let (app, _file) = app_with_keys().await;
    let stream = completion_body(
        json!("Hi"),
        json!({"model": SERVED_NAME, "max_tokens": 3, "stream": true}),
    );
    let response = app
        .app
        .clone()
        .oneshot(request("POST", COMPLETIONS, "k-solo", Some(&stream)))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let body = completion(SERVED_NAME);
    let (status, retry, _) = send(&app, request("POST", COMPLETIONS, "k-solo", Some(&body))).await;
    assert_eq!(
        (status, retry.as_deref()),
        (StatusCode::TOO_MANY_REQUESTS, Some("1"))
    );
    let streamed = response.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&streamed).contains("[DONE]"));
    let (status, _, _) = send(&app, request("POST", COMPLETIONS, "k-solo", Some(&body))).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn metrics_count_each_keys_requests_and_tokens() {
    let (app, _file) = app_with_keys().await;
    let (_, _, text) = send(
        &app,
        request(
            "POST",
            COMPLETIONS,
            "k-user",
            Some(&completion(SERVED_NAME)),
        ),
    )
    .await;
    let usage = serde_json::from_str::<Value>(&text).unwrap()["usage"].clone();
    app.wait_idle().await;
    let (_, _, text) = send(&app, request("GET", "/metrics", "k-ops", None)).await;
    for (series, value) in [
        ("quiver_key_requests_total{key=\"user\"}", json!(1)),
        (
            "quiver_key_prompt_tokens_total{key=\"user\"}",
            usage["prompt_tokens"].clone(),
        ),
        (
            "quiver_key_generated_tokens_total{key=\"user\"}",
            usage["completion_tokens"].clone(),
        ),
    ] {
        let line = format!("{series} {value}");
        assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
    }
}

/// `/metrics` names every adapter and key: with keys configured, only an admin key reads it
/// (401 without a key, 403 for another key, as for adapter loading), unless `--metrics-open`.
/// The probes stay open.
#[tokio::test]
async fn metrics_need_an_admin_key_unless_opened() {
    let (app, _file) = app_with_keys().await;
    let anonymous = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    let (status, _, body) = send(&app, anonymous("/metrics")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "invalid_api_key");
    let (status, _, body) = send(&app, request("GET", "/metrics", "k-user", None)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(error["error"]["code"], "permission_denied");
    let (status, _, body) = send(&app, request("GET", "/metrics", "k-ops", None)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("quiver_requests_running"), "{body}");
    for probe in ["/health", "/info"] {
        assert_eq!(
            send(&app, anonymous(probe)).await.0,
            StatusCode::OK,
            "{probe}"
        );
    }

    let mut file = tempfile::NamedTempFile::new().unwrap();
    let user = sha256_hex("k-user");
    writeln!(
        file,
        "keys:\n- {{name: user, sha256: {user}, base_model: true}}"
    )
    .unwrap();
    let open = TestApp::with_options(Options {
        api_keys_file: Some(file.path().to_owned()),
        metrics_open: true,
        ..Options::default()
    })
    .await;
    let (status, _, body) = send(&open, anonymous("/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.contains("quiver_requests_running"), "{body}");
    // The other routes keep their keys.
    let (status, _, _) = send(&open, anonymous("/v1/models")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
}
