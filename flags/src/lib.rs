//! The serving flags: the part of the command line that `quiver-launcher` takes and hands on to
//! `quiver-router`. Both binaries flatten [`ServingFlags`] into their own `clap` parser, so a flag's
//! name, environment variable, default and `--help` text are written once, and the launcher
//! forwards them with [`ServingFlags::to_router_args`] instead of re-listing each one.

mod adapter_source;
mod lora_rank_classes;
mod reasoning_parser;
mod router_argv;
mod serving;
#[cfg(test)]
mod test_cli;
mod tool_call_parser;

pub use adapter_source::{AdapterSource, UnknownAdapterSource};
pub use lora_rank_classes::{slot_ranks, RankClass, RankClasses};
pub use reasoning_parser::{ReasoningParser, ReasoningParserFlag};
pub use serving::{ServingFlags, API_KEY_ENV};
pub use tool_call_parser::ToolCallParser;
