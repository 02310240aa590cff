//! `GET /openapi.json`: an OpenAPI 3.1 document, open without a key, whose `$ref`s resolve and
//! whose operations are exactly the routes the router serves, read from the router itself: a
//! route added without an operation (or an operation left without its route) fails here.

mod http_common;

use std::collections::BTreeSet;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_common::*;
use serde_json::Value;
use tower::ServiceExt;

const METHODS: [Method; 5] = [
    Method::GET,
    Method::POST,
    Method::PUT,
    Method::PATCH,
    Method::DELETE,
];

async fn document(app: &TestApp) -> Value {
    let (status, document) = app.get("/openapi.json").await;
    assert_eq!(status, StatusCode::OK, "{document}");
    document
}

/// The paths the router matches, from its `Debug` output (axum has no public route list):
/// the `path_router` part, before the fallback router's own catch-all paths.
fn routed_paths(app: &TestApp) -> Vec<String> {
    let debug = format!("{:?}", app.app);
    let start = debug.find("path_router").expect("a path router");
    let end = debug.find("fallback_router").expect("a fallback router");
    let paths: Vec<String> = debug[start..end]
        .split("RouteId(")
        .skip(1)
        .filter_map(|entry| {
            let (_, rest) = entry.split_once("): \"")?;
            rest.split_once('"').map(|(path, _)| path.to_owned())
        })
        .collect();
    assert!(
        paths.iter().any(|path| path == "/health"),
        "axum's Debug output changed; no routes found in {debug}"
    );
    paths
}

/// `METHOD path` for each method a routed path answers with anything but 405.
async fn served_operations(app: &TestApp) -> BTreeSet<String> {
    let mut served = BTreeSet::new();
    for path in routed_paths(app) {
        // `{*id}` is axum's spelling of a path parameter that may hold `/`.
        let documented = path.replace("{*", "{");
        let concrete = documented.replace("{id}", "x");
        for method in METHODS {
            let request = Request::builder()
                .method(method.clone())
                .uri(&concrete)
                .header("content-type", "application/json")
                .body(Body::from("{}"))
                .expect("request");
            let response = app.app.clone().oneshot(request).await.expect("infallible");
            if response.status() != StatusCode::METHOD_NOT_ALLOWED {
                served.insert(format!("{method} {documented}"));
            }
        }
    }
    served
}

fn documented_operations(document: &Value) -> BTreeSet<String> {
    let paths = document["paths"].as_object().expect("paths");
    paths
        .iter()
        .flat_map(|(path, item)| {
            let item = item.as_object().expect("a path item");
            item.keys()
                .map(move |method| format!("{} {path}", method.to_uppercase()))
        })
        .collect()
}

fn collect_refs<'a>(value: &'a Value, refs: &mut Vec<&'a str>) {
    match value {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("$ref", Value::String(target)) => refs.push(target),
                    _ => collect_refs(value, refs),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect_refs(item, refs)),
        _ => {}
    }
}

#[tokio::test]
async fn every_route_is_documented_and_every_operation_is_routed() {
    let app = TestApp::start().await;
    let served = served_operations(&app).await;
    let documented = documented_operations(&document(&app).await);
    assert_eq!(served, documented);
    assert!(served.contains("GET /openapi.json"));
}

#[tokio::test]
async fn the_document_is_openapi_3_1_served_without_a_key_and_its_refs_resolve() {
    let app = TestApp::with_options(Options {
        api_key: Some("secret".to_owned()),
        ..Options::default()
    })
    .await;
    let document = document(&app).await;
    let version = document["openapi"].as_str().expect("openapi");
    assert!(version.starts_with("3.1."), "{version}");
    assert_eq!(document["info"]["title"], "quiver");

    let mut refs = Vec::new();
    collect_refs(&document, &mut refs);
    assert!(refs.len() > 20, "{refs:?}");
    for target in refs {
        let pointer = target.strip_prefix('#').expect("a local $ref");
        assert!(document.pointer(pointer).is_some(), "{target} is missing");
    }

    // OpenAPI requires a description on every response; the keyed operations say so.
    for (operation, item) in operations(&document) {
        let responses = item["responses"].as_object().expect("responses");
        assert!(responses.contains_key("200"), "{operation}");
        for (status, response) in responses {
            assert!(
                response["description"].is_string(),
                "{operation} {status} has no description"
            );
        }
        let keyed = item.get("security").is_some();
        assert_eq!(keyed, responses.contains_key("401"), "{operation}");
    }
}

fn operations(document: &Value) -> Vec<(String, &Value)> {
    let paths = document["paths"].as_object().expect("paths");
    paths
        .iter()
        .flat_map(|(path, item)| {
            let item = item.as_object().expect("a path item");
            item.iter()
                .map(move |(method, operation)| (format!("{method} {path}"), operation))
        })
        .collect()
}

#[tokio::test]
async fn the_extensions_and_hand_written_shapes_are_documented() {
    let app = TestApp::start().await;
    let document = document(&app).await;
    let schemas = &document["components"]["schemas"];
    let params = &schemas["GenerationParams"]["properties"];
    for field in [
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "min_tokens",
        "return_token_ids",
        "adapter_source",
        "stop_token_ids",
        "prompt_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
    ] {
        assert!(params.get(field).is_some(), "{field} is not documented");
    }
    let stop: Vec<&str> = schemas["StopSequences"]["oneOf"]
        .as_array()
        .expect("stop is a string or a list")
        .iter()
        .map(|shape| shape["type"].as_str().expect("a type"))
        .collect();
    assert_eq!(stop, ["string", "array"]);
    assert_eq!(schemas["Seed"]["type"], "integer");
    assert_eq!(schemas["Prompt"]["oneOf"].as_array().map(Vec::len), Some(4));
    assert_eq!(schemas["ChatFields"]["required"][0], "messages");
}
