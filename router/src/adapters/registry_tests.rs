use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use tokio::sync::Semaphore;

use super::*;
use crate::shard::{AdapterLoad, LoadedAdapter, ShardError, ShardResult};
use crate::template::ChatTemplate;
use crate::tokenizer::TextTokenizer;

/// Loads wait for a permit of `gate` (so tests decide when they finish) and fail with `fail`
/// while it is set; unloads wait for `unload_gate`.
struct TestBackend {
    loads: AtomicUsize,
    requests: Mutex<Vec<AdapterLoad>>,
    unloads: Mutex<Vec<String>>,
    gate: Arc<Semaphore>,
    unload_gate: Arc<Semaphore>,
    fail: Mutex<Option<ShardError>>,
    path: Mutex<String>,
}

impl TestBackend {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            loads: AtomicUsize::new(0),
            requests: Mutex::new(Vec::new()),
            unloads: Mutex::new(Vec::new()),
            gate: Arc::new(Semaphore::new(0)),
            unload_gate: Arc::new(Semaphore::new(1000)),
            fail: Mutex::new(None),
            path: Mutex::new(String::new()),
        })
    }

    fn open(&self, loads: usize) {
        self.gate.add_permits(loads);
    }

    fn loads(&self) -> usize {
        self.loads.load(Ordering::SeqCst)
    }
}

impl AdapterBackend for TestBackend {
    fn load(&self, request: AdapterLoad) -> BoxFuture<'_, ShardResult<LoadedAdapter>> {
        async move {
            self.loads.fetch_add(1, Ordering::SeqCst);
            self.requests.lock().unwrap().push(request);
            self.gate.acquire().await.unwrap().forget();
            if let Some(error) = self.fail.lock().unwrap().clone() {
                return Err(error);
            }
            Ok(LoadedAdapter {
                path: self.path.lock().unwrap().clone(),
                rank: 8,
                scaling: 2.0,
                target_modules: vec!["q_proj".into(), "v_proj".into()],
            })
        }
        .boxed()
    }

    fn unload(&self, adapter_id: String) -> BoxFuture<'static, ()> {
        self.unloads.lock().unwrap().push(adapter_id);
        let gate = self.unload_gate.clone();
        async move {
            gate.acquire().await.unwrap().forget();
        }
        .boxed()
    }
}

fn base() -> Arc<ModelAssets> {
    Arc::new(ModelAssets {
        tokenizer: TextTokenizer::from_tokenizer(crate::tokenizer::test_support::byte_level_bpe()),
        template: Some(ChatTemplate::new("{{ messages[0].content }}".into(), None, None).unwrap()),
        adapters_own_template: false,
    })
}

fn hub(id: &str) -> AdapterSpec {
    AdapterSpec {
        id: id.to_owned(),
        location: AdapterLocation::Hub {
            repo: id.to_owned(),
            revision: None,
        },
    }
}

fn registry(backend: &Arc<TestBackend>) -> AdapterRegistry {
    AdapterRegistry::new(backend.clone(), base(), None)
}

/// Polls until `condition` holds (loads run on their own tasks).
async fn eventually(condition: impl Fn() -> bool) {
    for _ in 0..500 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("condition never held");
}

#[tokio::test]
async fn concurrent_requests_share_one_load() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    let waiters: Vec<_> = (0..8)
        .map(|_| {
            let registry = registry.clone();
            tokio::spawn(async move { registry.acquire("org/a", || Ok(hub("org/a"))).await })
        })
        .collect();
    eventually(|| backend.loads() == 1).await;
    // Loading blocks nobody else: an unrelated lookup answers at once.
    assert!(registry.get("org/a").is_none());
    assert!(registry.list().is_empty());
    backend.open(1);
    let mut entries = Vec::new();
    for waiter in waiters {
        entries.push(waiter.await.unwrap().unwrap());
    }
    assert_eq!(backend.loads(), 1);
    assert!(entries.iter().all(|entry| Arc::ptr_eq(entry, &entries[0])));
    let entry = &entries[0];
    assert_eq!((entry.rank, entry.scaling), (8, 2.0));
    assert_eq!(entry.source(), AdapterSource::Hub);
    let request = backend.requests.lock().unwrap()[0].clone();
    assert_eq!(
        (
            request.adapter_id.as_str(),
            request.source.as_str(),
            request.path.as_str()
        ),
        ("org/a", "hub", "")
    );
    // Ready now: no further load.
    registry.acquire("org/a", || unreachable!()).await.unwrap();
    assert_eq!(backend.loads(), 1);
}

#[tokio::test]
async fn a_failed_load_fails_its_waiters_and_is_not_remembered() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    *backend.fail.lock().unwrap() = Some(ShardError::InvalidArgument(
        "adapter hidden size 64 does not match the model's 32".into(),
    ));
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let registry = registry.clone();
            tokio::spawn(async move { registry.acquire("org/a", || Ok(hub("org/a"))).await })
        })
        .collect();
    eventually(|| backend.loads() == 1).await;
    backend.open(1);
    for waiter in waiters {
        let error = waiter.await.unwrap().unwrap_err();
        assert_eq!(error.code(), "invalid_adapter");
        assert!(error.to_string().contains("hidden size 64"), "{error}");
    }
    assert!(registry.list().is_empty());

    *backend.fail.lock().unwrap() = None;
    backend.open(1);
    registry
        .acquire("org/a", || Ok(hub("org/a")))
        .await
        .unwrap();
    assert_eq!(backend.loads(), 2);
    assert_eq!(registry.list().len(), 1);
}

#[tokio::test]
async fn shard_errors_map_to_client_and_server_errors() {
    let not_found = AdapterError::from_load(
        "org/x",
        ShardError::Status {
            rank: 0,
            code: tonic::Code::NotFound,
            message: "Repository Not Found".into(),
        },
    );
    assert!(not_found.is_not_found());
    assert_eq!(not_found.code(), "model_not_found");
    let internal = AdapterError::from_load(
        "org/x",
        ShardError::Status {
            rank: 0,
            code: tonic::Code::Internal,
            message: "boom".into(),
        },
    );
    assert!(!internal.is_client_error());
}

#[tokio::test]
async fn a_waiter_that_goes_away_does_not_cancel_the_load() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    let waiter = {
        let registry = registry.clone();
        tokio::spawn(async move { registry.acquire("org/a", || Ok(hub("org/a"))).await })
    };
    eventually(|| backend.loads() == 1).await;
    waiter.abort();
    backend.open(1);
    eventually(|| registry.get("org/a").is_some()).await;
}

#[tokio::test]
async fn unloading_refuses_new_requests_until_the_scheduler_is_done() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    backend.open(2);
    registry.load(hub("org/a")).await.unwrap();
    let gate_permits = backend.unload_gate.available_permits();
    backend.unload_gate.forget_permits(gate_permits);

    registry.unload("org/a").await.unwrap();
    assert!(registry.get("org/a").is_none());
    assert!(registry.list().is_empty());
    let refused = registry
        .acquire("org/a", || Ok(hub("org/a")))
        .await
        .unwrap_err();
    assert!(refused.is_not_found(), "{refused}");
    assert!(registry.unload("org/a").await.unwrap_err().is_not_found());
    eventually(|| backend.unloads.lock().unwrap().as_slice() == ["org/a"]).await;

    backend.unload_gate.add_permits(1);
    // Gone for good: a request may load it afresh.
    let mut reloaded = None;
    for _ in 0..500 {
        match registry.acquire("org/a", || Ok(hub("org/a"))).await {
            Ok(entry) => {
                reloaded = Some(entry);
                break;
            }
            Err(AdapterError::Unloading(_)) => tokio::time::sleep(Duration::from_millis(2)).await,
            Err(other) => panic!("{other}"),
        }
    }
    assert!(reloaded.is_some());
    assert_eq!(backend.loads(), 2);
    assert!(registry
        .unload("org/unknown")
        .await
        .unwrap_err()
        .is_not_found());
}

#[tokio::test]
async fn explicit_loads_are_idempotent_but_an_id_keeps_its_location() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    backend.open(1);
    registry.load(hub("org/a")).await.unwrap();
    registry.load(hub("org/a")).await.unwrap();
    assert_eq!(backend.loads(), 1);
    let elsewhere = AdapterSpec {
        id: "org/a".into(),
        location: AdapterLocation::Local {
            path: PathBuf::from("/adapters/a"),
        },
    };
    let error = registry.load(elsewhere).await.unwrap_err();
    assert_eq!(error.code(), "adapter_already_loaded");
    // A request does not care where the id came from.
    registry.acquire("org/a", || unreachable!()).await.unwrap();
}

#[tokio::test]
async fn adapters_are_listed_in_load_order() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    backend.open(3);
    for id in ["org/c", "org/a", "org/b"] {
        registry.load(hub(id)).await.unwrap();
    }
    let ids: Vec<_> = registry
        .list()
        .iter()
        .map(|entry| entry.id.clone())
        .collect();
    assert_eq!(ids, ["org/c", "org/a", "org/b"]);
}

#[tokio::test]
async fn local_loads_send_the_resolved_path_and_read_the_adapter_assets() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = dir.path().join("chatty");
    std::fs::create_dir(&adapter).unwrap();
    std::fs::write(
        adapter.join("chat_template.jinja"),
        "[{{ messages[0].content }}]",
    )
    .unwrap();
    let backend = TestBackend::new();
    let registry = registry(&backend);
    backend.open(1);
    let spec = AdapterSpec {
        id: "chatty".into(),
        location: AdapterLocation::Local {
            path: adapter.clone(),
        },
    };
    let entry = registry.load(spec).await.unwrap();
    let request = backend.requests.lock().unwrap()[0].clone();
    assert_eq!(request.source.as_str(), "local");
    assert_eq!(Path::new(&request.path), adapter);
    // The shard answered no path: the resolved directory is read.
    assert_eq!(entry.path, adapter);
    let rendered = entry
        .assets
        .template
        .as_ref()
        .unwrap()
        .render_with(
            &serde_json::json!([{"role": "user", "content": "hi"}]),
            None,
            true,
            None,
        )
        .unwrap();
    assert_eq!(rendered, "[hi]");
}

#[tokio::test]
async fn an_adapter_with_broken_assets_is_refused_and_unloaded_from_the_shards() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), "{not json").unwrap();
    let backend = TestBackend::new();
    *backend.path.lock().unwrap() = dir.path().display().to_string();
    let registry = registry(&backend);
    backend.open(1);
    let error = registry.load(hub("org/broken")).await.unwrap_err();
    assert_eq!(error.code(), "invalid_adapter");
    assert_eq!(backend.unloads.lock().unwrap().as_slice(), ["org/broken"]);
    assert!(registry.get("org/broken").is_none());
}

#[tokio::test]
async fn spellings_of_one_location_share_one_load_even_while_it_runs() {
    let backend = TestBackend::new();
    let registry = registry(&backend);
    let local = |id: &str| AdapterSpec {
        id: id.into(),
        location: AdapterLocation::Local {
            path: PathBuf::from("/adapters/a"),
        },
    };
    let first = tokio::spawn({
        let registry = registry.clone();
        async move { registry.acquire("a", || Ok(local("a"))).await }
    });
    eventually(|| registry.is_loading("a")).await;
    let alias = tokio::spawn({
        let registry = registry.clone();
        async move { registry.acquire("./a", || Ok(local("./a"))).await }
    });
    backend.open(1);
    let (first, alias) = (first.await.unwrap().unwrap(), alias.await.unwrap().unwrap());
    assert_eq!((first.id.as_str(), alias.id.as_str()), ("a", "a"));
    assert_eq!(backend.loads(), 1);
    // An explicit load of the same place under another name is refused, not a second copy.
    let error = registry.load(local("copy")).await.unwrap_err();
    assert_eq!(error.code(), "adapter_name_conflict");
    assert_eq!(backend.loads(), 1);
    assert_eq!(registry.list().len(), 1);
}
