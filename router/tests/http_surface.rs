//! `/v1/models`, `/health`, `/info`: shapes against OpenAI's schema and what they report.

mod http_common;

use axum::http::StatusCode;
use http_common::openapi::assert_schema;
use http_common::*;
use quiver_router::shard::FakeRpc;

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
    assert_eq!(limits["max_batch_prefill_tokens"], 4096);
    // The fake reports 256 blocks of 4 tokens.
    assert_eq!(limits["block_size"], 4);
    assert_eq!(limits["num_blocks"], 256);
    assert_eq!(limits["max_batch_total_tokens"], 1024);
}
