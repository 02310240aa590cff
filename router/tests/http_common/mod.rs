//! Shared fixture of the HTTP tests: the real router (validation, scheduler, detokenizer, stop
//! strings) in process over `FakeShard`, a tiny character-level tokenizer and chat template
//! built here, request helpers, and the reference the tests compare against.
//!
//! The reference is independent of the code under test: the fake's documented token rule
//! (`fake_next_token`), this file's own character table for token ↔ text, and OpenAI's schema
//! (`openapi`).
#![allow(dead_code)]

pub mod adapter_root;
pub mod openapi;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::Router;
use http_body_util::BodyExt;
pub use quiver_flags::RankClass;
use quiver_router::adapters::AdapterSource;
use quiver_router::http::{self, AppState};
use quiver_router::shard::{fake_next_token, fake_next_token_for, FakeShard, ShardBackend};
use quiver_router::startup::{self, AdapterSettings, AdmissionSettings, Settings, StartupError};
use quiver_router::template::ChatTemplate;
use quiver_router::tokenizer::TextTokenizer;
use quiver_router::validation::{ModelAssets, RequestedLimits};
use serde_json::{json, Value};
use tower::ServiceExt;

/// Token ids: 0 `<|bos|>`, 1 `<|eos|>` (both special), 2 "\n", then printable ASCII
/// (" " = 3 ... "~" = 97): one token per character, so text and ids map one to one.
pub const BOS: u32 = 0;
pub const EOS: u32 = 1;
pub const VOCAB: u32 = 98;
pub const MODEL_ID: &str = "org/tiny-model";
pub const SERVED_NAME: &str = "tiny";

/// A ChatML-like template that, like many real ones, refuses a misplaced system message.
pub const TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
{% if message.role == 'system' and not loop.first %}\
{{ raise_exception('System message must be at the beginning.') }}{% endif %}\
<{{ message.role }}>{{ message.content }}\n{% endfor %}\
{% if add_generation_prompt %}<assistant>{% endif %}";

/// The text of one token under the table above ("" for the special tokens).
pub fn token_text(id: u32) -> String {
    match id {
        BOS | EOS => String::new(),
        2 => "\n".to_owned(),
        id => char::from(u8::try_from(id - 3 + 32).expect("ASCII")).to_string(),
    }
}

/// Ids of `text` under the table above (no special tokens).
pub fn text_ids(text: &str) -> Vec<u32> {
    text.chars()
        .map(|c| match c {
            '\n' => 2,
            ' '..='~' => u32::from(c) - 32 + 3,
            other => panic!("{other:?} is not in the test vocabulary"),
        })
        .collect()
}

pub fn decode(ids: &[u32]) -> String {
    ids.iter().map(|&id| token_text(id)).collect()
}

/// What the fake shard generates after a prompt ending in `last`: up to `max_tokens` ids,
/// ending early with EOS (included) unless `ignore_eos`. Returns the ids and the finish reason.
pub fn expected_generation(
    last: u32,
    max_tokens: u32,
    ignore_eos: bool,
) -> (Vec<u32>, &'static str) {
    expected_generation_for("", last, max_tokens, ignore_eos, &[EOS])
}

/// As `expected_generation`, under the fake's token rule for `adapter_id` ("" is the base
/// model), ending at any of `eos`.
pub fn expected_generation_for(
    adapter_id: &str,
    last: u32,
    max_tokens: u32,
    ignore_eos: bool,
    eos: &[u32],
) -> (Vec<u32>, &'static str) {
    let mut ids = Vec::new();
    let mut previous = last;
    while ids.len() < max_tokens as usize {
        let next = if adapter_id.is_empty() {
            fake_next_token(previous, VOCAB)
        } else {
            fake_next_token_for(previous, adapter_id, VOCAB)
        };
        ids.push(next);
        if eos.contains(&next) && !ignore_eos {
            return (ids, "stop");
        }
        previous = next;
    }
    (ids, "length")
}

/// A tokenizer.json for the table above: BPE without merges (so one token per character), a
/// `Fuse` decoder, and a post-processor that prepends `<|bos|>` with special tokens on.
pub fn tokenizer() -> tokenizers::Tokenizer {
    let mut vocab = serde_json::Map::new();
    for id in 0..VOCAB {
        let token = match id {
            BOS => "<|bos|>".to_owned(),
            EOS => "<|eos|>".to_owned(),
            id => token_text(id),
        };
        vocab.insert(token, id.into());
    }
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let bos = json!({"SpecialToken": {"id": "<|bos|>", "type_id": 0}});
    let sequence = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(BOS, "<|bos|>"), special(EOS, "<|eos|>")],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [bos, sequence("A")],
            "pair": [bos, sequence("A"), sequence("B")],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [BOS], "tokens": ["<|bos|>"]}}
        },
        "decoder": {"type": "Fuse"},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
    .to_string()
    .parse()
    .expect("the test tokenizer.json parses")
}

#[derive(Debug, Clone)]
pub struct Options {
    pub api_key: Option<String>,
    pub api_keys_file: Option<PathBuf>,
    pub served_model_name: Option<String>,
    pub max_input_tokens: u32,
    pub max_total_tokens: u32,
    pub max_concurrent_requests: u32,
    pub step_delay: Duration,
    pub with_template: bool,
    pub adapter_source: AdapterSource,
    pub adapter_root: Option<PathBuf>,
    /// `--s3-adapter-buckets`.
    pub s3_buckets: Vec<String>,
    pub preload_adapters: Vec<String>,
    pub max_active_adapters: u32,
    /// `--lora-rank-classes` (`--max-lora-rank` is 64).
    pub lora_rank_classes: Vec<RankClass>,
    /// (adapter id, rank) the fake's LoadAdapter answers; others have rank 8.
    pub adapter_ranks: Vec<(String, u32)>,
    /// How long each LoadAdapter takes in the fake shard.
    pub adapter_load_delay: Duration,
    /// (adapter id, directory) the fake's LoadAdapter answers for a hub adapter.
    pub adapter_paths: Vec<(String, String)>,
    /// The fake's `with_seeded_sampling`: sampled choices with distinct seeds differ.
    pub seeded_sampling: bool,
    /// `--tool-call-parser`.
    pub tool_call_parser: Option<quiver_router::tool_calls::ToolCallParser>,
    /// `--reasoning-parser`.
    pub reasoning_parser: Option<quiver_router::reasoning::ReasoningParserFlag>,
    /// The chat template; `TEMPLATE` by default.
    pub template: &'static str,
    /// `--metrics-open`.
    pub metrics_open: bool,
    /// `--max-logprob-entries` (unset: the router default).
    pub max_logprob_entries: Option<u64>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            api_key: None,
            api_keys_file: None,
            served_model_name: Some(SERVED_NAME.to_owned()),
            max_input_tokens: 48,
            max_total_tokens: 64,
            max_concurrent_requests: 64,
            step_delay: Duration::ZERO,
            with_template: true,
            adapter_source: AdapterSource::Hub,
            adapter_root: None,
            s3_buckets: Vec::new(),
            preload_adapters: Vec::new(),
            max_active_adapters: 4,
            lora_rank_classes: Vec::new(),
            adapter_ranks: Vec::new(),
            adapter_load_delay: Duration::ZERO,
            adapter_paths: Vec::new(),
            seeded_sampling: false,
            tool_call_parser: None,
            reasoning_parser: None,
            template: TEMPLATE,
            metrics_open: false,
            max_logprob_entries: None,
        }
    }
}

pub struct TestApp {
    pub app: Router,
    pub state: AppState,
    pub shard: Arc<FakeShard>,
}

impl TestApp {
    pub async fn start() -> Self {
        Self::with_options(Options::default()).await
    }

    pub async fn with_options(options: Options) -> Self {
        match Self::try_with_options(options).await {
            Ok(app) => app,
            Err(error) => panic!("app state starts: {error}"),
        }
    }

    pub async fn try_with_options(options: Options) -> Result<Self, StartupError> {
        let mut fake = FakeShard::new(VOCAB)
            .with_eos(EOS)
            .with_cache(4, 256)
            .with_step_delay(options.step_delay)
            .with_adapter_load_delay(options.adapter_load_delay);
        if options.seeded_sampling {
            fake = fake.with_seeded_sampling();
        }
        for (id, dir) in &options.adapter_paths {
            fake = fake.with_adapter_path(id.clone(), dir.clone());
        }
        for (id, rank) in &options.adapter_ranks {
            fake = fake.with_adapter_rank(id.clone(), *rank);
        }
        let shard = Arc::new(fake);
        let backend: Arc<dyn ShardBackend> = shard.clone();
        let info = backend.info().await.expect("fake Info");
        let template = options.with_template.then(|| {
            ChatTemplate::new(
                options.template.to_owned(),
                Some("<|bos|>".into()),
                Some("<|eos|>".into()),
            )
            .expect("the test template compiles")
        });
        let assets = ModelAssets {
            tokenizer: TextTokenizer::from_tokenizer(tokenizer()),
            template,
            adapters_own_template: false,
        };
        let settings = Settings {
            model_id: MODEL_ID.to_owned(),
            served_model_name: options.served_model_name,
            limits: RequestedLimits {
                max_input_tokens: Some(options.max_input_tokens),
                max_total_tokens: Some(options.max_total_tokens),
                max_batch_prefill_tokens: None,
            },
            max_batch_total_tokens: None,
            max_batch_size: 32,
            max_concurrent_requests: options.max_concurrent_requests,
            api_key: options.api_key,
            api_keys_file: options.api_keys_file,
            adapters: AdapterSettings {
                source: options.adapter_source,
                root: options.adapter_root,
                s3_buckets: options.s3_buckets,
                preload: options.preload_adapters,
                max_active_adapters: options.max_active_adapters,
                max_lora_rank: 64,
                lora_rank_classes: options.lora_rank_classes,
            },
            admission: AdmissionSettings {
                max_logprob_entries: options.max_logprob_entries,
                ..AdmissionSettings::default()
            },
            tool_call_parser: options.tool_call_parser,
            reasoning_parser: options.reasoning_parser,
            metrics_max_adapter_labels: 32,
            metrics_open: options.metrics_open,
            prefix_caching: true,
            chunked_prefill: true,
            prefill_pace: 0.0,
            mixed_prefill: true,
        };
        let state = startup::start(backend, info, assets, settings).await?;
        Ok(Self {
            app: http::router(state.clone()),
            state,
            shard,
        })
    }

    pub async fn send(&self, request: Request<Body>) -> (StatusCode, String) {
        let response = self
            .app
            .clone()
            .oneshot(request)
            .await
            .expect("the router answers");
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("the body arrives")
            .to_bytes();
        (
            status,
            String::from_utf8(bytes.to_vec()).expect("UTF-8 body"),
        )
    }

    /// POSTs `body` as JSON text and parses the answer as JSON.
    pub async fn post(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        self.post_raw(path, &body.to_string()).await
    }

    pub async fn post_raw(&self, path: &str, body: &str) -> (StatusCode, Value) {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_owned()))
            .expect("request");
        let (status, text) = self.send(request).await;
        (status, parse_json(&text))
    }

    /// POSTs `body` as JSON and returns the answer as text (the adapter endpoints answer
    /// plain text on success).
    pub async fn post_text(&self, path: &str, body: &Value) -> (StatusCode, String) {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        self.send(request).await
    }

    pub async fn get(&self, path: &str) -> (StatusCode, Value) {
        let (status, text) = self
            .send(Request::get(path).body(Body::empty()).expect("request"))
            .await;
        (
            status,
            if text.is_empty() {
                Value::Null
            } else {
                parse_json(&text)
            },
        )
    }

    /// POSTs a streaming request; returns the status and the `data:` payloads in order
    /// (`[DONE]` kept as the string "[DONE]").
    pub async fn stream(&self, path: &str, body: &Value) -> (StatusCode, Vec<Value>) {
        let request = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        let (status, text) = self.send(request).await;
        (status, sse_data(&text))
    }

    /// Waits until the fake shard holds no request and no pinned grammar, and the scheduler
    /// has none in flight.
    pub async fn wait_idle(&self) {
        let idle = || {
            self.shard.live_requests() == 0
                && self.shard.pinned_grammars() == 0
                && self.state.infer.scheduler().in_flight() == 0
        };
        for _ in 0..200 {
            if idle() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "still busy: {} live requests and {} pinned grammars in the shard, {} in flight",
            self.shard.live_requests(),
            self.shard.pinned_grammars(),
            self.state.infer.scheduler().in_flight()
        );
    }
}

fn parse_json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|error| panic!("not JSON ({error}): {text:?}"))
}

/// The payloads of an SSE body: each event's `data:` line; keep-alive comments skipped.
pub fn sse_data(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|event| event.lines().find_map(|line| line.strip_prefix("data: ")))
        .map(|data| {
            if data == "[DONE]" {
                Value::from("[DONE]")
            } else {
                parse_json(data)
            }
        })
        .collect()
}

/// A chat request body with one user message and the given extra fields.
pub fn chat_body(content: &str, extra: Value) -> Value {
    let mut body =
        json!({"model": SERVED_NAME, "messages": [{"role": "user", "content": content}]});
    merge(&mut body, extra);
    body
}

pub fn completion_body(prompt: Value, extra: Value) -> Value {
    let mut body = json!({"model": SERVED_NAME, "prompt": prompt});
    merge(&mut body, extra);
    body
}

fn merge(body: &mut Value, extra: Value) {
    if let (Some(body), Value::Object(extra)) = (body.as_object_mut(), extra) {
        body.extend(extra);
    }
}

/// The prompt the test template renders for one user message, as ids (BOS first, once).
pub fn chat_prompt_ids(content: &str) -> Vec<u32> {
    let mut ids = vec![BOS];
    ids.extend(text_ids(&format!("<user>{content}\n<assistant>")));
    ids
}
