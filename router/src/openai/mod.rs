//! OpenAI's wire types, one module per API surface.
//!
//! These are plain data: deserialized request bodies and serialized responses, field for field
//! as OpenAI's schema names them (plus the documented extensions). What the values mean and
//! whether they are allowed is decided in `crate::validation`.

pub mod adapters;
pub mod chat;
pub mod common;
pub mod completions;
pub mod embeddings;
pub mod error;
pub mod field_schemas;
pub mod fields;
pub mod logprobs;
pub mod models;
pub mod responses_request;
pub mod schema;
pub mod tokenize;

#[cfg(test)]
mod header_tests;
