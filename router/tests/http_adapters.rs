//! LoRA adapters through the HTTP surface, over `FakeShard`: id resolution and path escapes,
//! per-adapter chat templates and EOS, `/v1/models`, `/tokenize` with an adapter. Loading and
//! unloading are in `http_adapter_loading.rs`.
//!
//! References: the fake's documented per-adapter token rule (`fake_next_token_for`), templates
//! rendered by hand in this file, the test vocabulary's character table, and OpenAI's schema.

mod http_common;

use std::path::Path;

use axum::http::StatusCode;
use http_common::adapter_root::*;
use http_common::openapi::assert_schema;
use http_common::*;
use serde_json::json;

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
            &chat_for("org/x", "hi", json!({"adapter_source": "gcs"})),
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
    assert_eq!(loads[0].source.as_str(), "local");
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
async fn models_pages_with_limit_and_after() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(Options {
        preload_adapters: vec!["team/sql".into(), "chatty".into(), "plain".into()],
        ..local_options(&dirs)
    })
    .await;
    let ids = |list: &serde_json::Value| -> Vec<String> {
        let cards = list["data"].as_array().unwrap();
        cards
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_owned())
            .collect()
    };
    // Without paging parameters: the whole list, and no cursor fields (as OpenAI's).
    let (_, all) = app.get("/v1/models").await;
    assert_eq!(ids(&all), [SERVED_NAME, "team/sql", "chatty", "plain"]);
    assert!(all.get("has_more").is_none() && all.get("last_id").is_none());

    let mut pages = Vec::new();
    let mut path = "/v1/models?limit=3".to_owned();
    loop {
        let (status, page) = app.get(&path).await;
        assert_eq!(status, StatusCode::OK, "{page}");
        assert_schema(&page, "ListModelsResponse");
        let page_ids = ids(&page);
        assert_eq!(page["first_id"], json!(page_ids.first()));
        assert_eq!(page["last_id"], json!(page_ids.last()));
        pages.push(page_ids);
        if !page["has_more"].as_bool().unwrap() {
            break;
        }
        path = format!(
            "/v1/models?limit=3&after={}",
            page["last_id"].as_str().unwrap()
        );
    }
    assert_eq!(
        pages,
        [vec![SERVED_NAME, "team/sql", "chatty"], vec!["plain"]]
    );
    // An id with a slash is a cursor too (percent-encoded by clients).
    let (_, page) = app.get("/v1/models?after=team%2Fsql").await;
    assert_eq!(ids(&page), ["chatty", "plain"]);
    assert_eq!(page["has_more"], false);

    for (query, param) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=many", "limit"),
        ("after=never-loaded", "after"),
        ("order=desc", "order"),
        ("limit=%ff", "limit"),
    ] {
        let (status, body) = app.get(&format!("/v1/models?{query}")).await;
        assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_value");
        assert_eq!(body["error"]["param"], param, "{query}: {body}");
    }
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

#[tokio::test]
async fn s3_ids_load_from_allowed_buckets_only_and_keep_their_url() {
    let app = TestApp::with_options(Options {
        s3_buckets: vec!["team-a".into()],
        ..Options::default()
    })
    .await;
    let id = "s3://team-a/adapters/sql";
    let (status, body) = app
        .post(
            "/v1/completions",
            &json!({"model": id, "prompt": "x", "max_tokens": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["model"], id);
    // Rank 0 downloads it by its id: no local path goes to the shard.
    let loads = app.shard.adapter_load_requests();
    let load = loads.last().unwrap();
    assert_eq!(
        (
            load.adapter_id.as_str(),
            load.source.as_str(),
            load.path.as_str()
        ),
        (id, "s3", "")
    );
    let (_, card) = app.get(&format!("/v1/models/{id}")).await;
    assert_eq!(card["root"], id);

    let loads_before = app.shard.adapter_load_requests().len();
    for (model, status) in [
        ("s3://team-b/adapters/sql", StatusCode::BAD_REQUEST),
        ("s3://team-a/adapters/../sql", StatusCode::BAD_REQUEST),
        ("s3://team-a/", StatusCode::BAD_REQUEST),
    ] {
        let (got, body) = app
            .post("/v1/chat/completions", &chat_for(model, "hi", json!({})))
            .await;
        assert_error(got, &body, status, "invalid_adapter_id");
        assert_eq!(body["error"]["param"], "model");
    }
    assert_eq!(app.shard.adapter_load_requests().len(), loads_before);

    // Loaded through the vLLM endpoint, an S3 adapter keeps its URL as its name.
    let (status, body) = app
        .post(
            "/v1/load_lora_adapter",
            &json!({"lora_name": "sql", "lora_path": "s3://team-a/adapters/other"}),
        )
        .await;
    assert_error(status, &body, StatusCode::BAD_REQUEST, "invalid_value");
    assert_eq!(body["error"]["param"], "lora_name");
}

/// With rank classes each adapter runs in the smallest slot its rank (LoadAdapter's answer)
/// fits, for generation and embeddings alike: the fake refuses an adapter in a slot too small
/// for it, and a rank lost on the way (0) would put every adapter in the rank-64 slot.
#[tokio::test]
async fn adapters_run_in_the_slot_class_their_rank_fits() {
    let dirs = adapter_dirs();
    let app = TestApp::with_options(Options {
        max_active_adapters: 3,
        lora_rank_classes: vec![RankClass { rank: 16, count: 2 }],
        adapter_ranks: vec![("team/sql".into(), 64)],
        ..local_options(&dirs)
    })
    .await;
    assert_eq!(app.shard.adapter_slot_ranks(), vec![16, 16, 64]);
    for model in ["team/sql", "plain"] {
        let (status, body) = app
            .post(
                "/v1/chat/completions",
                &chat_for(model, "hi", json!({"max_tokens": 6})),
            )
            .await;
        assert_eq!(status, StatusCode::OK, "{body}");
        let (text, finish, _) = expected_reply(model, &chat_prompt_ids("hi"), 6);
        assert_eq!(body["choices"][0]["message"]["content"], text, "{model}");
        assert_eq!(body["choices"][0]["finish_reason"], finish, "{model}");
    }
    let (status, body) = app
        .post("/v1/embeddings", &json!({"model": "chatty", "input": "hi"}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    // plain (rank 8) takes the first rank-16 slot; chatty the second, while plain's is idle.
    let expected =
        [("team/sql", 2), ("plain", 0), ("chatty", 1)].map(|(id, slot)| (id.to_string(), slot));
    assert_eq!(app.shard.activations(), expected);
}

#[tokio::test]
async fn rank_classes_that_leave_no_large_slot_stop_start_up() {
    let result = TestApp::try_with_options(Options {
        max_active_adapters: 2,
        lora_rank_classes: vec![RankClass { rank: 8, count: 2 }],
        ..Options::default()
    })
    .await;
    let error = result.err().expect("start-up fails").to_string();
    assert!(error.contains("--lora-rank-classes"), "{error}");
    assert!(error.contains("--max-active-adapters is 2"), "{error}");
}
