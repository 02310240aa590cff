//! OpenAPI schemas of the request bodies read as two structs from one JSON object (see
//! `GenerationParams`): the endpoint's own fields and the shared parameters. The fields' own
//! schemas are in `field_schemas.rs`.

use utoipa::openapi::schema::{AllOfBuilder, Schema};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::chat::ChatFields;
use super::common::GenerationParams;
use super::completions::CompletionFields;

/// `all_of` a `ToSchema` type by reference, registering it (and what it refers to) as a
/// component.
fn reference<T: ToSchema>(schemas: &mut Vec<(String, RefOr<Schema>)>) {
    schemas.push((T::name().into_owned(), T::schema()));
    T::schemas(schemas);
}

/// One request body read as two structs from the same JSON object (see `GenerationParams`).
fn both<A: ToSchema, B: ToSchema>() -> RefOr<Schema> {
    AllOfBuilder::new()
        .item(Ref::from_schema_name(A::name()))
        .item(Ref::from_schema_name(B::name()))
        .into()
}

/// The body of `POST /v1/chat/completions`.
pub struct ChatCompletionRequest;

impl PartialSchema for ChatCompletionRequest {
    fn schema() -> RefOr<Schema> {
        both::<ChatFields, GenerationParams>()
    }
}

impl ToSchema for ChatCompletionRequest {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        reference::<ChatFields>(schemas);
        reference::<GenerationParams>(schemas);
    }
}

/// The body of `POST /v1/completions`.
pub struct CompletionRequest;

impl PartialSchema for CompletionRequest {
    fn schema() -> RefOr<Schema> {
        both::<CompletionFields, GenerationParams>()
    }
}

impl ToSchema for CompletionRequest {
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        reference::<CompletionFields>(schemas);
        reference::<GenerationParams>(schemas);
    }
}
