//! `FakeShard`'s LoRA adapters: what LoadAdapter, ActivateAdapter and UnloadAdapter do, and the
//! checks that make the router's adapter bookkeeping visible in tests.
//!
//! - **LoadAdapter** succeeds for any id (again and again: it is idempotent) unless a test made
//!   that id fail (`fail_adapter_load`, `fail_adapter_load_with`). The `path` it answers is the
//!   one `with_adapter_path` gave for the id, else the request's `path`, else (a hub download on
//!   rank 0) `fake-hub/<id>`. A rank other than 0 asked to download a hub adapter itself (source
//!   "hub" with no path) refuses: only rank 0 downloads. A "local" load without a path, an empty
//!   id or an unknown source are refused too. Every request is recorded
//!   (`adapter_load_requests`), failed ones included. Rank 8 (or `with_adapter_rank`'s),
//!   scaling 2, targets q/v.
//! - **ActivateAdapter** needs a slot below the slot count (Warmup's `max_active_adapters`, or
//!   `with_adapter_slots` / `with_adapter_slot_ranks` for tests that skip Warmup), a loaded
//!   adapter that is not active in another slot, whose rank the slot holds (Warmup's
//!   `slot_ranks`; without them any rank fits: the fake checks no `max_lora_rank`), and a slot
//!   that no live request uses (the proto forbids activating a slot under running requests,
//!   whichever adapter it holds). `fail_adapter_activation(id)` makes
//!   every activation of `id` fail with `Internal` and leaves the slot empty. Successful
//!   activations are recorded in order (`activations`).
//!   With `with_adapter_activation_delay` each activation takes that long (the copy), and the
//!   slot changes at its end.
//! - **PrefetchAdapter** needs a loaded adapter; it is recorded in order (`prefetches`) and
//!   answers true (the fake keeps every loaded adapter in memory).
//! - **UnloadAdapter** refuses while live requests use the adapter, else forgets it (host copy
//!   and slot). Unknown ids are fine. Recorded in order (`unloaded_adapters`).
//! - **Prefill** of a request whose adapter is not active in a slot is refused (`check_servable`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use quiver_flags::AdapterSource;

use super::{invalid, FakeRpc, FakeShard, State};
use crate::shard::{AdapterLoad, LoadedAdapter, ShardError, ShardResult};

/// The rank LoadAdapter reports for an adapter `with_adapter_rank` did not name.
const DEFAULT_RANK: u32 = 8;

#[derive(Debug, Default)]
pub(super) struct AdapterState {
    /// Slot → the adapter it holds.
    slots: Vec<Option<String>>,
    /// Slot → the largest rank it holds (Warmup's `slot_ranks`); empty: any rank.
    slot_ranks: Vec<u32>,
    /// Loaded adapter id → its path.
    loaded: HashMap<String, String>,
    /// Paths tests chose per id (`with_adapter_path`).
    paths: HashMap<String, String>,
    /// Ranks tests chose per id (`with_adapter_rank`).
    ranks: HashMap<String, u32>,
    load_failures: HashMap<String, (tonic::Code, String)>,
    activation_failures: HashSet<String>,
    load_requests: Vec<AdapterLoad>,
    activations: Vec<(String, u32)>,
    prefetches: Vec<String>,
    unloads: Vec<String>,
}

impl AdapterState {
    /// Warmup (re)allocates the slots, all empty: `slots` of them, each holding up to its rank
    /// in `slot_ranks` (empty: any rank). Refused, as a real shard refuses it, when the ranks
    /// are not one per slot.
    pub(super) fn set_slots(&mut self, slots: u32, slot_ranks: Vec<u32>) -> ShardResult<()> {
        if !slot_ranks.is_empty() && slot_ranks.len() != slots as usize {
            return Err(invalid(format!(
                "{} slot ranks for {slots} adapter slots",
                slot_ranks.len()
            )));
        }
        self.slots = vec![None; slots as usize];
        self.slot_ranks = slot_ranks;
        Ok(())
    }

    fn rank_of(&self, adapter_id: &str) -> u32 {
        self.ranks.get(adapter_id).copied().unwrap_or(DEFAULT_RANK)
    }

    fn slot_of(&self, adapter_id: &str) -> Option<usize> {
        self.slots
            .iter()
            .position(|held| held.as_deref() == Some(adapter_id))
    }

    /// A request may run only on the base model or an adapter active in a slot.
    pub(super) fn check_servable(&self, request_id: u64, adapter_id: &str) -> ShardResult<()> {
        if adapter_id.is_empty() || self.slot_of(adapter_id).is_some() {
            return Ok(());
        }
        Err(invalid(format!(
            "request {request_id}: adapter {adapter_id:?} is not active in any slot"
        )))
    }
}

/// Live requests that run on `adapter_id`, sorted.
fn users(state: &State, adapter_id: &str) -> Vec<u64> {
    let mut ids: Vec<u64> = state
        .requests
        .iter()
        .filter(|(_, r)| r.adapter_id == adapter_id)
        .map(|(id, _)| *id)
        .collect();
    ids.sort_unstable();
    ids
}

impl FakeShard {
    /// Adapter slots for tests that do not call Warmup (Warmup sets them from
    /// `max_active_adapters`).
    pub fn with_adapter_slots(mut self, slots: u32) -> Self {
        self.state_mut()
            .adapters
            .set_slots(slots, Vec::new())
            .expect("no slot ranks to check");
        self
    }

    /// One adapter slot per rank, holding adapters up to that rank, for tests that do not call
    /// Warmup (Warmup sets them from `slot_ranks`).
    pub fn with_adapter_slot_ranks(mut self, ranks: &[u32]) -> Self {
        self.state_mut()
            .adapters
            .set_slots(ranks.len() as u32, ranks.to_vec())
            .expect("one rank per slot");
        self
    }

    /// The rank LoadAdapter reports for `adapter_id` (default 8), which ActivateAdapter checks
    /// against the slot's.
    pub fn with_adapter_rank(mut self, adapter_id: impl Into<String>, rank: u32) -> Self {
        self.state_mut()
            .adapters
            .ranks
            .insert(adapter_id.into(), rank);
        self
    }

    /// The directory LoadAdapter answers for `adapter_id` (where the router looks for the
    /// adapter's own tokenizer and chat template).
    pub fn with_adapter_path(
        mut self,
        adapter_id: impl Into<String>,
        dir: impl Into<String>,
    ) -> Self {
        self.state_mut()
            .adapters
            .paths
            .insert(adapter_id.into(), dir.into());
        self
    }

    /// Time each LoadAdapter takes (to let requests pile up behind a load).
    pub fn with_adapter_load_delay(mut self, delay: Duration) -> Self {
        self.adapter_load_delay = delay;
        self
    }

    /// Time each ActivateAdapter takes (the copy into the slot runs beside the steps).
    pub fn with_adapter_activation_delay(mut self, delay: Duration) -> Self {
        self.adapter_activation_delay = delay;
        self
    }

    /// Every PrefetchAdapter in order.
    pub fn prefetches(&self) -> Vec<String> {
        self.lock().adapters.prefetches.clone()
    }

    /// Makes every LoadAdapter of `adapter_id` fail with `InvalidArgument` and `message`.
    pub fn fail_adapter_load(&self, adapter_id: impl Into<String>, message: impl Into<String>) {
        self.fail_adapter_load_with(adapter_id, tonic::Code::InvalidArgument, message);
    }

    /// Makes every LoadAdapter of `adapter_id` fail with `code` (e.g. `NotFound`) and `message`.
    pub fn fail_adapter_load_with(
        &self,
        adapter_id: impl Into<String>,
        code: tonic::Code,
        message: impl Into<String>,
    ) {
        self.lock()
            .adapters
            .load_failures
            .insert(adapter_id.into(), (code, message.into()));
    }

    /// Makes every ActivateAdapter of `adapter_id` fail with `Internal` (the slot ends empty).
    pub fn fail_adapter_activation(&self, adapter_id: impl Into<String>) {
        self.lock()
            .adapters
            .activation_failures
            .insert(adapter_id.into());
    }

    /// What each slot holds, by slot.
    pub fn active_adapters(&self) -> Vec<Option<String>> {
        self.lock().adapters.slots.clone()
    }

    /// The largest rank of each slot, by slot, as Warmup gave them (empty: any rank).
    pub fn adapter_slot_ranks(&self) -> Vec<u32> {
        self.lock().adapters.slot_ranks.clone()
    }

    /// Successful activations in order: (adapter id, slot).
    pub fn activations(&self) -> Vec<(String, u32)> {
        self.lock().adapters.activations.clone()
    }

    /// Successful activations of `adapter_id`.
    pub fn activation_count(&self, adapter_id: &str) -> usize {
        let state = self.lock();
        let activations = &state.adapters.activations;
        activations
            .iter()
            .filter(|(id, _)| id == adapter_id)
            .count()
    }

    /// Adapters loaded and not unloaded, sorted.
    pub fn loaded_adapters(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.lock().adapters.loaded.keys().cloned().collect();
        ids.sort_unstable();
        ids
    }

    /// Every LoadAdapter request received, in order (failed ones too).
    pub fn adapter_load_requests(&self) -> Vec<AdapterLoad> {
        self.lock().adapters.load_requests.clone()
    }

    /// Every UnloadAdapter that succeeded, in order.
    pub fn unloaded_adapters(&self) -> Vec<String> {
        self.lock().adapters.unloads.clone()
    }

    fn state_mut(&mut self) -> &mut State {
        self.state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub(super) fn load_adapter_now(&self, request: AdapterLoad) -> ShardResult<LoadedAdapter> {
        let mut guard = self.begin(FakeRpc::LoadAdapter)?;
        let adapters = &mut guard.adapters;
        adapters.load_requests.push(request.clone());
        let id = &request.adapter_id;
        if id.is_empty() {
            return Err(invalid("LoadAdapter without an adapter id".to_string()));
        }
        if let Some((code, message)) = adapters.load_failures.get(id) {
            return Err(match code {
                tonic::Code::InvalidArgument => ShardError::InvalidArgument(message.clone()),
                code => ShardError::Status {
                    rank: self.rank as usize,
                    code: *code,
                    message: message.clone(),
                },
            });
        }
        let downloads = match request.source {
            AdapterSource::Hub | AdapterSource::S3 => request.path.is_empty(),
            AdapterSource::Local if request.path.is_empty() => {
                return Err(invalid(format!(
                    "local adapter {id:?} comes without a path"
                )))
            }
            AdapterSource::Local => false,
        };
        if downloads && self.rank != 0 {
            return Err(invalid(format!(
                "rank {} was asked to download adapter {id:?}: only rank 0 downloads",
                self.rank
            )));
        }
        let path = match adapters.paths.get(id) {
            Some(path) => path.clone(),
            None if downloads => format!("fake-hub/{id}"),
            None => request.path.clone(),
        };
        adapters.loaded.insert(id.clone(), path.clone());
        Ok(LoadedAdapter {
            path,
            rank: adapters.rank_of(id),
            scaling: 2.0,
            target_modules: vec!["q_proj".to_string(), "v_proj".to_string()],
        })
    }

    pub(super) fn activate_adapter_now(
        &self,
        adapter_id: String,
        slot_id: u32,
    ) -> ShardResult<bool> {
        let mut guard = self.begin(FakeRpc::ActivateAdapter)?;
        let state = &mut *guard;
        let (id, slot) = (&adapter_id, slot_id as usize);
        let slot_count = state.adapters.slots.len();
        if slot >= slot_count {
            return Err(invalid(format!(
                "slot {slot} is outside the {slot_count} adapter slots Warmup prepared"
            )));
        }
        if !state.adapters.loaded.contains_key(id) {
            return Err(invalid(format!("adapter {id:?} is not loaded")));
        }
        if let Some(other) = state.adapters.slot_of(id).filter(|&other| other != slot) {
            return Err(invalid(format!(
                "adapter {id:?} is already active in slot {other}"
            )));
        }
        let rank = state.adapters.rank_of(id);
        if let Some(&held) = state
            .adapters
            .slot_ranks
            .get(slot)
            .filter(|&&held| rank > held)
        {
            return Err(invalid(format!(
                "adapter {id:?} has rank {rank}, but slot {slot} holds ranks up to {held}"
            )));
        }
        if let Some(current) = &state.adapters.slots[slot] {
            let running = users(state, current);
            if !running.is_empty() {
                return Err(invalid(format!(
                    "slot {slot} holds adapter {current:?}, which running requests {running:?} use"
                )));
            }
        }
        if state.adapters.activation_failures.contains(id) {
            state.adapters.slots[slot] = None;
            return Err(ShardError::Status {
                rank: self.rank as usize,
                code: tonic::Code::Internal,
                message: format!("injected failure activating adapter {id:?}"),
            });
        }
        state.adapters.slots[slot] = Some(id.clone());
        state.adapters.activations.push((id.clone(), slot_id));
        state.stats.activate_calls += 1;
        // The fake keeps every loaded adapter in memory.
        Ok(true)
    }

    pub(super) fn prefetch_adapter_now(&self, adapter_id: String) -> ShardResult<bool> {
        let mut guard = self.begin(FakeRpc::PrefetchAdapter)?;
        let state = &mut *guard;
        if !state.adapters.loaded.contains_key(&adapter_id) {
            return Err(invalid(format!("adapter {adapter_id:?} is not loaded")));
        }
        state.adapters.prefetches.push(adapter_id);
        Ok(true)
    }

    pub(super) fn unload_adapter_now(&self, adapter_id: String) -> ShardResult<()> {
        let mut guard = self.begin(FakeRpc::UnloadAdapter)?;
        let state = &mut *guard;
        let id = &adapter_id;
        let running = users(state, id);
        if !running.is_empty() {
            return Err(invalid(format!(
                "adapter {id:?} is still used by running requests {running:?}"
            )));
        }
        state.adapters.loaded.remove(id);
        if let Some(slot) = state.adapters.slot_of(id) {
            state.adapters.slots[slot] = None;
        }
        state.adapters.unloads.push(id.clone());
        Ok(())
    }
}
