//! What one family's way of writing calls is, as a trait each format file implements whole: the
//! markers it writes, the chat templates that teach it, how the system prompt tells a model to
//! write it, the grammar that holds a reply to it, and how a reply is read, finished or still
//! being generated. The generic machinery (`detect`, `grammar`, `prompt`, `plan`, `stream`,
//! `truncated`) asks the format (`registry::format_of`) and never matches on the family.

use super::lark::SpecialId;
use super::parsed::ParsedOutput;
use super::partial::Scan;
use super::request::FunctionSpec;

/// Reading and writing calls in one family's format.
pub trait ToolCallFormat: Sync {
    /// The marker texts it writes: an added token of the tokenizer is written by id in the
    /// grammar, and a special one must be kept by the detokenizer for the parser to see it.
    fn markers(&self) -> &'static [&'static str];

    /// Whether a chat template's text shows this format (it prints the format it teaches).
    fn taught_by(&self, template: &str) -> bool;

    /// How to write calls, completing "To call a function, reply with " in the system prompt of
    /// a template that does not read `tools`.
    fn call_instruction(&self) -> &'static str;

    /// The grammar's start rule and its rules, calls of `functions` only. `forced`: calls
    /// alone (`required`, a named function), else free text too (`auto`), where a call, once
    /// its marker is written, must be complete; `several`: more than one call allowed.
    /// `special_id` gives the id of a marker that is an added token of the tokenizer.
    fn grammar(
        &self,
        forced: bool,
        several: bool,
        functions: &[&FunctionSpec],
        special_id: SpecialId,
    ) -> (String, Vec<String>);

    /// Splits `text`, a model's complete output, into content and calls; `None` when it holds
    /// no call or a malformed one. With `declared`, a call must name one of those functions.
    fn read(&self, text: &str, declared: Option<&[String]>) -> Option<ParsedOutput>;

    /// What can already be told of `text`, a reply still being generated (`partial`).
    fn scan<'a>(&self, text: &'a str) -> Scan<'a>;

    /// Whether `text` has started writing calls: a marker of the format in it.
    fn opens_calls(&self, text: &str) -> bool {
        self.markers().iter().any(|marker| text.contains(marker))
    }

    /// `read`, never failing: output that holds no well-formed call is returned whole as
    /// content.
    fn parse(&self, text: &str, declared: Option<&[String]>) -> ParsedOutput {
        self.read(text, declared)
            .unwrap_or_else(|| ParsedOutput::plain(text))
    }
}
