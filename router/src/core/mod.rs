//! The router's core, behind one front, `Infer`: a request's `model` resolved to an adapter
//! (`models`), validated, its grammar compiled (`grammar`), its choices scheduled and turned
//! from token events into text (`generation`: detokenizer, stop strings, metrics), charged to
//! its API key (`key_meter`) and cut at the end of a shutdown's grace period (`cutoff`). The
//! `http` layer only parses requests, calls `Infer`, and renders JSON or SSE.

mod adapter_admin;
mod cutoff;
mod embed;
mod generation;
mod grammar;
mod infer;
mod key_meter;
mod models;
mod status;

pub use cutoff::Cutoff;
pub use embed::{Embedded, EmbeddingInputs};
pub use generation::{
    prompt_cached_tokens, ChoiceEvent, ChoiceOutput, ChoiceSettings, GeneratedToken,
};
pub use infer::{Infer, InferParts, ResponseSetup, Started};
pub use models::{Models, ResolvedModel, ServedModels};
