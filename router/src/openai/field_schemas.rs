//! OpenAPI schemas of the request fields whose Rust type does not show their JSON shape: the
//! hand-written deserializers (`seed`, `stop`) and the fields kept as raw JSON for validation to
//! parse (`messages`, `prompt`). Each states what that parser accepts, no more and no less, so
//! the document of `GET /openapi.json` never promises a shape the server refuses. The field
//! structs name these in their `#[schema]` attributes; `schema.rs` builds the request bodies
//! from the structs, so neither module depends on the other's dependents.

use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::RefOr;
use utoipa::{PartialSchema, ToSchema};

use super::common::{Seed, StopSequences};

/// Roles OpenAI's schema defines for request messages.
pub const ROLES: [&str; 5] = ["system", "user", "assistant", "tool", "developer"];

fn of_type(schema_type: Type) -> ObjectBuilder {
    ObjectBuilder::new().schema_type(schema_type)
}

fn non_empty_list(item: impl Into<RefOr<Schema>>) -> ArrayBuilder {
    let item: RefOr<Schema> = item.into();
    ArrayBuilder::new().items(item).min_items(Some(1))
}

fn token_id() -> ObjectBuilder {
    of_type(Type::Integer).minimum(Some(0))
}

impl PartialSchema for Seed {
    fn schema() -> RefOr<Schema> {
        of_type(Type::Integer)
            .description(Some(
                "Any integer; a negative one is taken modulo 2^64. The same seed and request \
                 give the same tokens, whatever shares the batch.",
            ))
            .into()
    }
}

impl ToSchema for Seed {}

impl PartialSchema for StopSequences {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(of_type(Type::String))
            .item(ArrayBuilder::new().items(of_type(Type::String)))
            .description(Some(
                "A string or a list of strings (at most `--max-stop-sequences`) that end a \
                 choice; never part of the output.",
            ))
            .into()
    }
}

impl ToSchema for StopSequences {}

/// `prompt` of `/v1/completions` (see `validation::prompt`).
pub struct Prompt;

impl PartialSchema for Prompt {
    fn schema() -> RefOr<Schema> {
        OneOfBuilder::new()
            .item(of_type(Type::String))
            .item(non_empty_list(of_type(Type::String)))
            .item(non_empty_list(token_id()))
            .item(non_empty_list(ArrayBuilder::new().items(token_id())))
            .description(Some(
                "A string, a list of strings, a list of token ids, or a list of token-id \
                 lists: one set of `n` choices per prompt.",
            ))
            .into()
    }
}

impl ToSchema for Prompt {}

/// One entry of `messages` (see `validation::messages` and `validation::tool_turns`). Keys
/// not listed pass through to the chat template.
pub struct ChatMessage;

impl PartialSchema for ChatMessage {
    fn schema() -> RefOr<Schema> {
        let text_part = of_type(Type::Object)
            .property("type", of_type(Type::String).enum_values(Some(["text"])))
            .property("text", of_type(Type::String))
            .required("type")
            .required("text");
        let content = OneOfBuilder::new()
            .item(of_type(Type::String))
            .item(ArrayBuilder::new().items(text_part))
            .item(of_type(Type::Null))
            .description(Some(
                "Text, or text parts joined with a newline; null on an assistant turn that \
                 only calls tools.",
            ));
        let function = of_type(Type::Object)
            .property("name", of_type(Type::String))
            .property(
                "arguments",
                OneOfBuilder::new()
                    .item(of_type(Type::String))
                    .item(of_type(Type::Object)),
            )
            .required("name")
            .required("arguments");
        let tool_call = of_type(Type::Object)
            .property("id", of_type(Type::String))
            .property("type", of_type(Type::String))
            .property("function", function)
            .required("function");
        of_type(Type::Object)
            .property("role", of_type(Type::String).enum_values(Some(ROLES)))
            .property("content", content)
            .property("name", of_type(Type::String))
            .property(
                "tool_calls",
                OneOfBuilder::new()
                    .item(ArrayBuilder::new().items(tool_call))
                    .item(of_type(Type::Null)),
            )
            .property(
                "tool_call_id",
                OneOfBuilder::new()
                    .item(of_type(Type::String))
                    .item(of_type(Type::Null)),
            )
            .required("role")
            .into()
    }
}

impl ToSchema for ChatMessage {}
