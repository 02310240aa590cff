//! Which format a `--tool-call-parser` family names: the one place the family is matched on.

use quiver_flags::ToolCallParser;

use super::format::ToolCallFormat;
use super::granite::Granite;
use super::hermes::Hermes;
use super::llama3_json::Llama3Json;
use super::mistral::Mistral;
use super::pythonic::Pythonic;

/// The format `parser` names.
pub fn format_of(parser: ToolCallParser) -> &'static dyn ToolCallFormat {
    match parser {
        ToolCallParser::Hermes => &Hermes,
        ToolCallParser::Llama3Json => &Llama3Json,
        ToolCallParser::Mistral => &Mistral,
        ToolCallParser::Granite => &Granite,
        ToolCallParser::Pythonic => &Pythonic,
    }
}
