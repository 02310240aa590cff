//! `/v1/models`, `/health`, `/info`, `/metrics`: shapes against OpenAI's schema and what they report.

mod http_common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::shard::FakeRpc;
use serde_json::json;
use tower::ServiceExt;

#[tokio::test]
async fn models_list_the_base_model_under_its_served_name() {
    let app = TestApp::start().await;
    let (status, list) = app.get("/v1/models").await;
    assert_eq!(status, StatusCode::OK);
    assert_schema(&list, "ListModelsResponse");
    assert_eq!(list["object"], "list");
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), 1);
    let card = &data[0];
    assert_schema(card, "Model");
    assert_eq!(card["id"], SERVED_NAME);
    assert_eq!(card["object"], "model");
    assert_eq!(card["owned_by"], "quiver");
    assert!(card["created"].as_u64().unwrap() > 1_700_000_000);

    let (status, retrieved) = app.get(&format!("/v1/models/{SERVED_NAME}")).await;
    assert_eq!(status, StatusCode::OK);
    assert_schema(&retrieved, "Model");
    assert_eq!(&retrieved, card);
}

#[tokio::test]
async fn hub_ids_with_a_slash_are_retrievable() {
    let app = TestApp::with_options(Options {
        served_model_name: None,
        ..Options::default()
    })
    .await;
    let (_, list) = app.get("/v1/models").await;
    assert_eq!(list["data"][0]["id"], MODEL_ID);
    let (status, card) = app.get(&format!("/v1/models/{MODEL_ID}")).await;
    assert_eq!(status, StatusCode::OK, "{card}");
    assert_eq!(card["id"], MODEL_ID);
}

#[tokio::test]
async fn health_follows_the_shard() {
    let app = TestApp::start().await;
    let (status, _) = app.get("/health").await;
    assert_eq!(status, StatusCode::OK);
    app.shard.fail_next(FakeRpc::Health);
    let (status, body) = app.get("/health").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_schema(&body, "ErrorResponse");
    let (status, _) = app.get("/health").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn info_reports_model_and_limits() {
    let app = TestApp::start().await;
    let (status, info) = app.get("/info").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(info["model_id"], MODEL_ID);
    assert_eq!(info["served_model_name"], SERVED_NAME);
    assert_eq!(info["model_type"], "fake");
    assert_eq!(info["dtype"], "float32");
    assert_eq!(info["device"], "cpu");
    assert_eq!(info["vocab_size"], VOCAB);
    assert_eq!(info["version"], env!("CARGO_PKG_VERSION"));
    let limits = &info["limits"];
    assert_eq!(limits["max_input_tokens"], 48);
    assert_eq!(limits["max_total_tokens"], 64);
    assert_eq!(limits["max_batch_prefill_tokens"], 2048);
    assert_eq!(limits["max_stop_sequences"], 16);
    // The fake reports 256 blocks of 4 tokens.
    assert_eq!(limits["block_size"], 4);
    assert_eq!(limits["num_blocks"], 256);
    assert_eq!(limits["max_batch_total_tokens"], 1024);
}

/// `name value` lines of a Prometheus text body.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

async fn scrape(app: &TestApp) -> String {
    let request = Request::get("/metrics").body(Body::empty()).unwrap();
    let (status, text) = app.send(request).await;
    assert_eq!(status, StatusCode::OK);
    text
}

#[tokio::test]
async fn metrics_show_load_and_count_tokens() {
    let app = TestApp::with_options(Options {
        step_delay: Duration::from_millis(5),
        ..Options::default()
    })
    .await;
    let idle = scrape(&app).await;
    assert_eq!(metric(&idle, "quiver_kv_blocks_total"), 256);
    assert_eq!(metric(&idle, "quiver_kv_blocks_free"), 256);
    assert_eq!(metric(&idle, "quiver_requests_running"), 0);

    let body = completion_body(json!("ab"), json!({"max_tokens": 5, "ignore_eos": true}));
    let (status, _) = app.post("/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK);
    let after = scrape(&app).await;
    assert_eq!(metric(&after, "quiver_prompt_tokens_total"), 3);
    assert_eq!(metric(&after, "quiver_generated_tokens_total"), 5);
    assert_eq!(metric(&after, "quiver_requests_finished_total"), 1);

    // A running stream holds blocks; leaving gives them back.
    let body = completion_body(
        json!("ab"),
        json!({"max_tokens": 50, "ignore_eos": true, "stream": true}),
    );
    let response = app
        .app
        .clone()
        .oneshot(
            Request::post("/v1/completions")
                .body(Body::from(body.to_string()))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut stream = response.into_body();
    // The scheduler publishes its load after each step: wait for a few tokens.
    for _ in 0..3 {
        stream.frame().await.unwrap().unwrap();
    }
    let busy = scrape(&app).await;
    assert_eq!(metric(&busy, "quiver_requests_running"), 1);
    // 3 prompt + 50 new tokens in blocks of 4.
    assert_eq!(metric(&busy, "quiver_kv_blocks_free"), 256 - 14);
    drop(stream);
    app.wait_idle().await;
    assert_eq!(metric(&scrape(&app).await, "quiver_kv_blocks_free"), 256);
}

#[tokio::test]
async fn metrics_count_responses_and_time_requests_per_adapter() {
    let app = TestApp::start().await;
    let body = completion_body(json!("ab"), json!({"max_tokens": 4, "ignore_eos": true}));
    assert_eq!(app.post("/v1/completions", &body).await.0, StatusCode::OK);
    let refused = completion_body(json!("ab"), json!({"max_tokens": -1}));
    let (status, error) = app.post("/v1/completions", &refused).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let code = error["error"]["code"].as_str().unwrap().to_owned();
    let (status, _) = app.get("/no/such/route").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let text = scrape(&app).await;
    let http = "quiver_http_requests_total";
    for (labels, count) in [
        (
            "endpoint=\"/v1/completions\",status=\"200\",code=\"none\"",
            1,
        ),
        (
            &*format!("endpoint=\"/v1/completions\",status=\"400\",code=\"{code}\""),
            1,
        ),
        (
            "endpoint=\"unmatched\",status=\"404\",code=\"not_found\"",
            1,
        ),
    ] {
        assert_eq!(
            metric(&text, &format!("{http}{{{labels}}}")),
            count,
            "{labels}"
        );
    }
    // One request of four tokens on the base model, labelled with its served name.
    let (_, models) = app.get("/v1/models").await;
    let served = models["data"][0]["id"].as_str().unwrap().to_owned();
    let base = format!("{{adapter=\"{served}\"}}");
    for (name, value) in [
        ("quiver_request_time_to_first_token_seconds_count", 1),
        ("quiver_request_inter_token_latency_seconds_count", 3),
        ("quiver_request_duration_seconds_count", 1),
        ("quiver_request_queue_seconds_count", 1),
        ("quiver_request_generation_tokens_sum", 4),
        ("quiver_request_prompt_tokens_sum", 3),
    ] {
        assert_eq!(metric(&text, &format!("{name}{base}")), value, "{name}");
    }
    // The GIE gauges: idle again, the cache the fake shard reports (256 blocks of 4).
    assert_eq!(metric(&text, "vllm:num_requests_running"), 0);
    assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), 0);
    let info = "vllm:cache_config_info{block_size=\"4\",num_gpu_blocks=\"256\"}";
    assert_eq!(metric(&text, info), 1);
}
