//! `--tool-call-parser`: the model family whose tool-call format replies are read (and
//! constrained) in. The names are vLLM's, so a command line written for vLLM works here.

use clap::ValueEnum;

// Plain comments on the variants, as for `AdapterSource`: `--help` shows the short list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum ToolCallParser {
    // `<tool_call>{"name", "arguments"}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3).
    #[value(name = "hermes")]
    Hermes,
    // `{"name", "parameters"}` objects separated by `;`, after an optional `<|python_tag|>`
    // (Llama 3.1 to 3.3).
    #[value(name = "llama3_json")]
    Llama3Json,
    // `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral, Mixtral), or, with
    // tokenizers from v11 on, `[TOOL_CALLS]name[ARGS]{…}` per call.
    #[value(name = "mistral")]
    Mistral,
    // `<|tool_call|>` then a JSON array of `{"name", "arguments"}` (IBM Granite 3).
    #[value(name = "granite")]
    Granite,
    // A Python list of calls, `[f(a=1, b="x"), g()]` (Llama 3.2 and 4 with pythonic templates).
    #[value(name = "pythonic")]
    Pythonic,
}

impl ToolCallParser {
    /// The flag's spelling, vLLM's.
    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Llama3Json => "llama3_json",
            Self::Mistral => "mistral",
            Self::Granite => "granite",
            Self::Pythonic => "pythonic",
        }
    }
}
