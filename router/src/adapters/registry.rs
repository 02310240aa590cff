//! The adapters this router serves: id → loading | ready | unloading.
//!
//! A load runs once per id on its own task; every request for that id awaits the same shared
//! future, so concurrent requests cause one `LoadAdapter` and requests for other adapters (or
//! the base model) never wait on it. A request dropped while it waits does not cancel the load
//! for the others. A failed load answers every waiting request with the same error and is not
//! remembered: the next request tries again. Unloading removes the id at once (new requests
//! get 404) and hands the adapter to the scheduler, which lets its requests finish.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use futures::future::{BoxFuture, Shared};
use futures::FutureExt;

use super::{
    adapter_assets, AdapterBackend, AdapterError, AdapterLocation, AdapterSource, AdapterSpec,
};
use crate::openai::common::unix_now;
use crate::shard::AdapterLoad;
use crate::validation::ModelAssets;

/// A loaded adapter.
#[derive(Clone)]
pub struct AdapterEntry {
    /// What clients send in `model`.
    pub id: String,
    pub location: AdapterLocation,
    /// The local directory the shard loaded it from (a hub adapter's download).
    pub path: PathBuf,
    pub rank: u32,
    pub scaling: f32,
    pub target_modules: Vec<String>,
    /// When it finished loading (Unix seconds), for `/v1/models`.
    pub created: u64,
    /// Its own tokenizer/template where it has them, the base model's otherwise.
    pub assets: Arc<ModelAssets>,
    /// A local adapter's directory relative to the adapter root: what clients may see of it.
    shown_root: String,
    /// When its load started, so `/v1/models` lists adapters in the order they arrived.
    order: u64,
}

impl AdapterEntry {
    pub fn source(&self) -> AdapterSource {
        self.location.source()
    }

    /// What the adapter was loaded from, as `/v1/models` reports it in `root` (vLLM's
    /// convention): the hub id, or the directory relative to the adapter root (server paths
    /// are not the clients' business).
    pub fn root(&self) -> String {
        match &self.location {
            AdapterLocation::Hub {
                repo,
                revision: Some(revision),
            } => format!("{repo}@{revision}"),
            AdapterLocation::Hub { repo, .. } => repo.clone(),
            AdapterLocation::Local { .. } => self.shown_root.clone(),
            AdapterLocation::S3(location) => location.to_string(),
        }
    }
}

impl std::fmt::Debug for AdapterEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterEntry")
            .field("id", &self.id)
            .field("location", &self.location)
            .field("path", &self.path)
            .field("rank", &self.rank)
            .field("scaling", &self.scaling)
            .field("target_modules", &self.target_modules)
            .finish_non_exhaustive()
    }
}

type LoadResult = Result<Arc<AdapterEntry>, AdapterError>;
type LoadFuture = Shared<BoxFuture<'static, LoadResult>>;

enum State {
    Loading {
        location: AdapterLocation,
        load: LoadFuture,
        /// Tells this load's completion apart from a later load of the same id.
        generation: u64,
    },
    Ready(Arc<AdapterEntry>),
    /// Removed, waiting for its requests to finish before the shards forget it; a new load of
    /// the id now would race with that unload.
    Unloading,
}

impl State {
    /// Where the adapter is (being) loaded from; an unloading one holds no location any more.
    fn location(&self) -> Option<&AdapterLocation> {
        match self {
            Self::Loading { location, .. } => Some(location),
            Self::Ready(entry) => Some(&entry.location),
            Self::Unloading => None,
        }
    }
}

/// The adapters by id, and the id each location is loaded (or loading) under: a first request
/// for a new id finds whether its directory is loaded already without walking every adapter.
#[derive(Default)]
struct States {
    by_id: HashMap<String, State>,
    by_location: HashMap<AdapterLocation, String>,
}

impl States {
    fn get(&self, id: &str) -> Option<&State> {
        self.by_id.get(id)
    }

    fn values(&self) -> impl Iterator<Item = &State> {
        self.by_id.values()
    }

    /// The id and state of what is (being) loaded from `location`.
    fn at(&self, location: &AdapterLocation) -> Option<(&str, &State)> {
        let (id, state) = self.by_id.get_key_value(self.by_location.get(location)?)?;
        Some((id.as_str(), state))
    }

    fn insert(&mut self, id: String, state: State) {
        self.unindex(&id);
        if let Some(location) = state.location() {
            self.by_location.insert(location.clone(), id.clone());
        }
        self.by_id.insert(id, state);
    }

    fn remove(&mut self, id: &str) -> Option<State> {
        self.unindex(id);
        self.by_id.remove(id)
    }

    fn unindex(&mut self, id: &str) {
        if let Some(location) = self.by_id.get(id).and_then(State::location) {
            if self
                .by_location
                .get(location)
                .is_some_and(|indexed| indexed == id)
            {
                self.by_location.remove(location);
            }
        }
    }
}

/// Cheap, cloneable handle to the registry.
#[derive(Clone)]
pub struct AdapterRegistry {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn AdapterBackend>,
    base: Arc<ModelAssets>,
    /// Canonical `--adapter-root`: a local adapter's files must resolve inside it.
    adapter_root: Option<PathBuf>,
    states: Mutex<States>,
    counter: AtomicU64,
}

/// What to do after looking at an id's state under the lock (the lock is never held across
/// an await).
enum Next {
    Done(LoadResult),
    Wait(LoadFuture),
    Start,
}

impl AdapterRegistry {
    pub fn new(
        backend: Arc<dyn AdapterBackend>,
        base: Arc<ModelAssets>,
        adapter_root: Option<PathBuf>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                backend,
                base,
                adapter_root,
                states: Mutex::new(States::default()),
                counter: AtomicU64::new(0),
            }),
        }
    }

    /// The adapter `id` for a request: ready, or loaded now (awaiting a load already under way).
    /// `resolve` says where an id not loaded yet comes from; it runs only for such ids.
    pub async fn acquire(
        &self,
        id: &str,
        resolve: impl FnOnce() -> Result<AdapterSpec, AdapterError>,
    ) -> LoadResult {
        match self.lookup(id, None) {
            Next::Done(result) => return result,
            Next::Wait(load) => return load.await,
            Next::Start => {}
        }
        // Resolution touches the file system: done outside the lock, then checked again.
        let spec = resolve()?;
        self.load_checked(spec, false).await
    }

    /// The id and state of the adapter loaded (or loading) from `location`, under any id.
    fn by_location<'a>(states: &'a States, location: &AdapterLocation) -> Option<(&'a str, Next)> {
        let (id, state) = states.at(location)?;
        match state {
            State::Ready(entry) => Some((id, Next::Done(Ok(entry.clone())))),
            State::Loading { load, .. } => Some((id, Next::Wait(load.clone()))),
            State::Unloading => None,
        }
    }

    /// Loads `spec` unless it is loaded already (then this is a no-op). An id that is loaded or
    /// loading from somewhere else is refused: ids must keep meaning one adapter.
    pub async fn load(&self, spec: AdapterSpec) -> LoadResult {
        self.load_checked(spec, true).await
    }

    /// With `strict`, an id already taken by another location is refused; without, whatever
    /// the id names is used (a request does not care where an adapter came from). A location
    /// already loaded under another id is that adapter (`./x` and `x` are one load); an explicit
    /// load of it under a second name is refused, so one directory is one adapter.
    async fn load_checked(&self, spec: AdapterSpec, strict: bool) -> LoadResult {
        let load = {
            let mut states = self.states();
            let location = strict.then_some(&spec.location);
            match Self::decide(&states, &spec.id, location) {
                Next::Done(result) => return result,
                Next::Wait(load) => load,
                Next::Start => match Self::by_location(&states, &spec.location) {
                    Some((loaded_as, _)) if strict => {
                        return Err(AdapterError::Conflict {
                            id: spec.id,
                            reason: format!("the same adapter is already loaded as `{loaded_as}`"),
                        })
                    }
                    Some((_, Next::Done(result))) => return result,
                    Some((_, Next::Wait(load))) => load,
                    Some((_, Next::Start)) | None => self.start_load(&mut states, spec),
                },
            }
        };
        load.await
    }

    /// A ready adapter, without loading anything (`/v1/models/{id}`).
    pub fn get(&self, id: &str) -> Option<Arc<AdapterEntry>> {
        match self.states().get(id) {
            Some(State::Ready(entry)) => Some(entry.clone()),
            _ => None,
        }
    }

    /// Whether a load of `id` is under way (tests).
    #[cfg(any(test, feature = "test-support"))]
    pub fn is_loading(&self, id: &str) -> bool {
        matches!(self.states().get(id), Some(State::Loading { .. }))
    }

    /// Every ready adapter, in load order.
    pub fn list(&self) -> Vec<Arc<AdapterEntry>> {
        let mut entries: Vec<_> = self
            .states()
            .values()
            .filter_map(|state| match state {
                State::Ready(entry) => Some(entry.clone()),
                _ => None,
            })
            .collect();
        entries.sort_by_key(|entry| entry.order);
        entries
    }

    /// Removes `id`: new requests for it are refused at once; the scheduler lets its running
    /// and queued requests finish, then the shards forget it. A load under way is waited for
    /// first. Unknown (or already unloading) ids are `NotFound`.
    pub async fn unload(&self, id: &str) -> Result<(), AdapterError> {
        loop {
            let loading = {
                let mut states = self.states();
                match states.get(id) {
                    Some(State::Ready(_)) => {
                        states.insert(id.to_owned(), State::Unloading);
                        break;
                    }
                    Some(State::Loading { load, .. }) => load.clone(),
                    None | Some(State::Unloading) => {
                        return Err(AdapterError::NotFound {
                            id: id.to_owned(),
                            detail: ": no adapter by that name is loaded".to_owned(),
                        })
                    }
                }
            };
            // Whatever the outcome, look again: ready → unload, failed → unknown.
            let _ = loading.await;
        }
        tracing::info!(adapter = ?id, "unloading adapter");
        // Handed over before this returns, so the scheduler orders it after every request it
        // already has for the adapter.
        let unloading = self.inner.backend.unload(id.to_owned());
        let inner = self.inner.clone();
        let id = id.to_owned();
        tokio::spawn(async move {
            unloading.await;
            let mut states = lock(&inner.states);
            if matches!(states.get(&id), Some(State::Unloading)) {
                states.remove(&id);
            }
            tracing::info!(adapter = ?id, "adapter unloaded");
        });
        Ok(())
    }

    fn states(&self) -> MutexGuard<'_, States> {
        lock(&self.inner.states)
    }

    fn lookup(&self, id: &str, location: Option<&AdapterLocation>) -> Next {
        Self::decide(&self.states(), id, location)
    }

    /// The state of `id` → the answer. With `location` (an explicit load), a different
    /// location already under that id is refused.
    fn decide(states: &States, id: &str, location: Option<&AdapterLocation>) -> Next {
        let clash = |loaded: &AdapterLocation| {
            Next::Done(Err(AdapterError::AlreadyLoaded {
                id: id.to_owned(),
                loaded: loaded.to_string(),
            }))
        };
        match states.get(id) {
            None => Next::Start,
            Some(State::Unloading) => Next::Done(Err(AdapterError::Unloading(id.to_owned()))),
            Some(State::Ready(entry)) => match location {
                Some(location) if *location != entry.location => clash(&entry.location),
                _ => Next::Done(Ok(entry.clone())),
            },
            Some(State::Loading {
                location: loading,
                load,
                ..
            }) => match location {
                Some(location) if location != loading => clash(loading),
                _ => Next::Wait(load.clone()),
            },
        }
    }

    /// Spawns the load (so it completes even if every waiting request goes away) and records
    /// it as loading. Called with the lock held, so the task's completion, which takes the
    /// lock, always finds the `Loading` state this inserts.
    fn start_load(&self, states: &mut States, spec: AdapterSpec) -> LoadFuture {
        let generation = self.inner.counter.fetch_add(1, Ordering::Relaxed);
        let inner = self.inner.clone();
        let task_spec = spec.clone();
        let task = tokio::spawn(async move {
            let result = inner.load_entry(task_spec.clone(), generation).await;
            inner.finish(&task_spec, generation, &result);
            result
        });
        let id = spec.id.clone();
        let load = async move {
            task.await.unwrap_or_else(|error| {
                Err(AdapterError::LoadFailed {
                    id,
                    message: format!("the load task failed: {error}"),
                })
            })
        }
        .boxed()
        .shared();
        tracing::info!(adapter = ?spec.id, from = ?spec.location, "loading adapter");
        states.insert(
            spec.id,
            State::Loading {
                location: spec.location,
                load: load.clone(),
                generation,
            },
        );
        load
    }
}

impl Inner {
    /// `LoadAdapter` on the shards, then the adapter's own tokenizer/template. `order` is when
    /// the load started, so `--preload-adapters` are listed in the order given.
    async fn load_entry(&self, spec: AdapterSpec, order: u64) -> LoadResult {
        let (path, revision) = match &spec.location {
            AdapterLocation::Hub { revision, .. } => {
                (String::new(), revision.clone().unwrap_or_default())
            }
            AdapterLocation::Local { path } => (path.display().to_string(), String::new()),
            // Rank 0 downloads it by its id.
            AdapterLocation::S3(_) => (String::new(), String::new()),
        };
        let request = AdapterLoad {
            adapter_id: spec.id.clone(),
            source: spec.location.source(),
            path,
            revision,
        };
        let loaded = self
            .backend
            .load(request)
            .await
            .map_err(|error| AdapterError::from_load(&spec.id, error))?;
        let path = match (&spec.location, loaded.path.is_empty()) {
            (AdapterLocation::Local { path }, true) => path.clone(),
            _ => PathBuf::from(&loaded.path),
        };
        let base = self.base.clone();
        let (id, dir) = (spec.id.clone(), path.clone());
        let root = match &spec.location {
            AdapterLocation::Local { .. } => self.adapter_root.clone(),
            AdapterLocation::Hub { .. } | AdapterLocation::S3(_) => None,
        };
        let shown_root = match (&spec.location, &root) {
            (AdapterLocation::Local { path }, Some(root)) => path
                .strip_prefix(root)
                .map(|relative| relative.display().to_string())
                .unwrap_or_default(),
            _ => String::new(),
        };
        let assets =
            tokio::task::spawn_blocking(move || adapter_assets(&id, &dir, root.as_deref(), &base))
                .await
                .unwrap_or_else(|error| {
                    Err(AdapterError::LoadFailed {
                        id: spec.id.clone(),
                        message: format!("reading the adapter's tokenizer failed: {error}"),
                    })
                });
        let assets = match assets {
            Ok(assets) => assets,
            Err(error) => {
                // Not servable after all: do not leave it in the shards' memory.
                self.backend.unload(spec.id.clone()).await;
                return Err(error);
            }
        };
        Ok(Arc::new(AdapterEntry {
            id: spec.id,
            location: spec.location,
            path,
            rank: loaded.rank,
            scaling: loaded.scaling,
            target_modules: loaded.target_modules,
            created: unix_now(),
            assets: Arc::new(assets),
            shown_root,
            order,
        }))
    }

    /// Records the outcome of load `generation`: ready, or forgotten if it failed.
    fn finish(&self, spec: &AdapterSpec, generation: u64, result: &LoadResult) {
        let mut states = lock(&self.states);
        let current = matches!(
            states.get(&spec.id),
            Some(State::Loading { generation: g, .. }) if *g == generation
        );
        if !current {
            return;
        }
        match result {
            Ok(entry) => {
                tracing::info!(
                    adapter = ?entry.id,
                    rank = entry.rank,
                    scaling = entry.scaling,
                    target_modules = ?entry.target_modules,
                    path = %entry.path.display(),
                    "adapter loaded"
                );
                states.insert(spec.id.clone(), State::Ready(entry.clone()));
            }
            Err(error) => {
                tracing::warn!(adapter = ?spec.id, error = ?error.to_string(), "adapter load failed");
                states.remove(&spec.id);
            }
        }
    }
}

/// The map stays consistent even if a thread panicked while holding the lock (every update is
/// a single insert or remove), so a poisoned lock is still usable.
fn lock(states: &Mutex<States>) -> MutexGuard<'_, States> {
    states
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
