//! `reasoning_tokens` by hand: replies cut into tokens, counted against where their thinking
//! block ends.

use super::{PromptState, ReasoningCounter, ReasoningParser, ReasoningSplitter};

fn count(parser: ReasoningParser, prompt: PromptState, tokens: &[&str]) -> u32 {
    let mut counter = ReasoningCounter::new(ReasoningSplitter::new(parser, prompt));
    for token in tokens {
        counter.token(token);
    }
    counter.count()
}

#[test]
fn tokens_up_to_the_closing_marker_are_thinking() {
    let reply = [
        "<think>", "Let", " me", " see", "</think>", "\n\n", "Yes", ".",
    ];
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Unopened, &reply),
        5
    );
    // A marker cut over tokens counts whole, with the token that completes it.
    let split = ["<think>", "Hm", "</th", "ink>", "Yes"];
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Unopened, &split),
        4
    );
}

#[test]
fn whitespace_before_the_block_counts_only_when_the_reply_thinks() {
    let thinks = ["\n", "<think>", "a", "</think>", "b"];
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Unopened, &thinks),
        4
    );
    let answers = ["\n", "Yes", " sir"];
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Unopened, &answers),
        0
    );
}

#[test]
fn a_block_the_prompt_opened_thinks_from_the_first_token() {
    let reply = ["Let", " me", "</think>", "Yes"];
    assert_eq!(
        count(ReasoningParser::DeepseekR1, PromptState::Opened, &reply),
        3
    );
    // Cut before the block closes: every token is thinking.
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Opened, &reply[..2]),
        2
    );
    // A held-back token (no text yet) inside the block is thinking too.
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Opened, &["a", "", "b"]),
        3
    );
}

#[test]
fn a_prompt_that_closed_the_block_leaves_nothing_to_count() {
    let reply = ["<think>", "a", "</think>", "b"];
    assert_eq!(
        count(ReasoningParser::Qwen3, PromptState::Closed, &reply),
        0
    );
}
