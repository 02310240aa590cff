//! The models a request can name: the base model (under its served name or its id) and every
//! adapter, loaded or still to be looked up. `Models` resolves a request's `model` to the
//! adapter and the tokenizer/template it runs with, and lists the cards a caller may see.

use std::sync::Arc;

use crate::adapters::{AdapterEntry, AdapterRegistry, AdapterSource, Resolver};
use crate::error::ApiError;
use crate::openai::models::ModelCard;
use crate::tenants::Caller;
use crate::validation::ModelAssets;

/// The names the base model answers to, and when it was first served.
#[derive(Debug, Clone)]
pub struct ServedModels {
    /// `--served-model-name`, else the model id.
    pub served_name: String,
    /// `--model-id` as given (hub id or directory), also accepted in `model`.
    pub model_id: String,
    pub created: u64,
}

impl ServedModels {
    /// "" (or absent), the served name or the model id select the base model; anything else is
    /// an adapter id.
    pub fn is_base(&self, requested: &str) -> bool {
        requested.is_empty() || requested == self.served_name || requested == self.model_id
    }

    pub fn base_card(&self) -> ModelCard {
        ModelCard::base(
            self.served_name.clone(),
            self.model_id.clone(),
            self.created,
        )
    }
}

/// What a request's `model` runs with (`Models::resolve`).
pub struct ResolvedModel {
    /// "" for the base model.
    pub adapter_id: String,
    /// The adapter's LoRA rank, which picks its slot class; 0 for the base model.
    pub adapter_rank: u32,
    /// The tokenizer and chat template.
    pub assets: Arc<ModelAssets>,
}

/// The base model, the adapter registry, and where adapters not loaded yet are looked up.
#[derive(Clone)]
pub struct Models {
    pub(super) served: Arc<ServedModels>,
    base: Arc<ModelAssets>,
    pub(super) adapters: AdapterRegistry,
    pub(super) resolver: Arc<Resolver>,
}

impl Models {
    pub fn new(
        served: ServedModels,
        base: Arc<ModelAssets>,
        adapters: AdapterRegistry,
        resolver: Resolver,
    ) -> Self {
        Self {
            served: Arc::new(served),
            base,
            adapters,
            resolver: Arc::new(resolver),
        }
    }

    pub fn served(&self) -> &ServedModels {
        &self.served
    }

    /// Loaded adapters (the shutdown logs them; tests watch loads).
    pub fn adapters(&self) -> &AdapterRegistry {
        &self.adapters
    }

    /// The `model` a response reports: what the client asked for, or the served name when it
    /// left `model` empty.
    pub fn response_model(&self, requested: Option<String>) -> String {
        requested
            .filter(|model| !model.is_empty())
            .unwrap_or_else(|| self.served.served_name.clone())
    }

    /// The adapter (none for the base model) and the tokenizer/template a request's `model`
    /// runs with. An adapter not loaded yet is looked up in `adapter_source` (else
    /// `--adapter-source`) and loaded; this waits for that load, and only this request does.
    ///
    /// A model the caller's key may not use is answered exactly as a missing one, before any
    /// lookup; and for a key that cannot use every adapter, a missing adapter is answered
    /// without the lookup's detail, so the two cannot be told apart.
    pub async fn resolve(
        &self,
        caller: &Caller,
        requested: Option<&str>,
        adapter_source: Option<&str>,
    ) -> Result<ResolvedModel, ApiError> {
        let source = adapter_source
            .map(AdapterSource::parse)
            .transpose()
            .map_err(ApiError::from)?;
        let requested = requested.unwrap_or_default();
        let not_found = || ApiError::ModelNotFound(requested.to_owned());
        if self.served.is_base(requested) {
            if !caller.may_use_base_model() {
                return Err(not_found());
            }
            return Ok(ResolvedModel {
                adapter_id: String::new(),
                adapter_rank: 0,
                assets: self.base.clone(),
            });
        }
        if !caller.may_use_adapter(requested) {
            return Err(not_found());
        }
        let entry = self
            .adapters
            .acquire(requested, || self.resolver.resolve(requested, source))
            .await
            .map_err(|error| {
                if caller.is_restricted() && error.is_not_found() {
                    not_found()
                } else {
                    ApiError::from(error)
                }
            })?;
        Ok(ResolvedModel {
            adapter_id: entry.id.clone(),
            adapter_rank: entry.rank,
            assets: entry.assets.clone(),
        })
    }

    /// Every card the caller's key may use: the base model first, then the loaded adapters in
    /// load order (a fixed order, which `/v1/models`'s cursor relies on).
    pub fn cards(&self, caller: &Caller) -> Vec<ModelCard> {
        let base = caller.may_use_base_model().then(|| self.served.base_card());
        let adapters = self.adapters.list();
        let adapters = adapters
            .iter()
            .filter(|entry| caller.may_use_adapter(&entry.id))
            .map(|entry| self.adapter_card(entry));
        base.into_iter().chain(adapters).collect()
    }

    /// The card of `id` when it is listed for the caller: looking an id up never loads an
    /// adapter.
    pub fn card(&self, caller: &Caller, id: &str) -> Option<ModelCard> {
        let base = self.served.base_card();
        if base.id == id {
            return caller.may_use_base_model().then_some(base);
        }
        if !caller.may_use_adapter(id) {
            return None;
        }
        self.adapters.get(id).map(|entry| self.adapter_card(&entry))
    }

    fn adapter_card(&self, entry: &AdapterEntry) -> ModelCard {
        ModelCard::adapter(
            entry.id.clone(),
            entry.root(),
            self.served.served_name.clone(),
            entry.created,
        )
    }
}
