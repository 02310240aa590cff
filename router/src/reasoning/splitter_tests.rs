//! The split against the reference of each case: the reply's text cut at its markers by hand
//! (vLLM's rules: text between the markers is reasoning, text after `</think>` content, both
//! kept as written; no `</think>` means all reasoning once the reply is thinking). Every
//! streamed case is also cut into two and three pieces at every byte boundary, so a marker
//! split across pieces in any way must give the same result, with no marker text on any side.

use super::{Piece, PromptState, ReasoningParser, ReasoningSplitter, Split};

const QWEN3: ReasoningParser = ReasoningParser::Qwen3;
const R1: ReasoningParser = ReasoningParser::DeepseekR1;

/// The split of `text` given whole.
fn whole(parser: ReasoningParser, prompt: PromptState, text: &str) -> Split {
    streamed(parser, prompt, &[text]).0
}

/// The split of `pieces` streamed one after the other, and every piece given out.
fn streamed(parser: ReasoningParser, prompt: PromptState, pieces: &[&str]) -> (Split, Vec<Piece>) {
    let mut splitter = ReasoningSplitter::new(parser, prompt);
    let mut out = Vec::new();
    for piece in pieces {
        out.extend(splitter.push(piece));
    }
    out.extend(splitter.finish());
    let mut split = Split::default();
    for piece in &out {
        let (side, text) = match piece {
            Piece::Reasoning(text) => (&mut split.reasoning, text),
            Piece::Content(text) => (&mut split.content, text),
        };
        assert!(!text.is_empty(), "an empty piece was given out: {out:?}");
        side.get_or_insert_with(String::new).push_str(text);
    }
    (split, out)
}

fn split(reasoning: Option<&str>, content: Option<&str>) -> Split {
    Split {
        reasoning: reasoning.map(str::to_owned),
        content: content.map(str::to_owned),
    }
}

/// `text` cut into three pieces at every pair of char boundaries (empty pieces included, so
/// also into two and one) gives `expected`.
fn every_cut(parser: ReasoningParser, prompt: PromptState, text: &str, expected: &Split) {
    let bounds: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    for &i in &bounds {
        for &j in bounds.iter().filter(|&&j| j >= i) {
            let pieces = [&text[..i], &text[i..j], &text[j..]];
            // Each side's pieces add up to the expected text: a marker fragment given out on
            // either side would show there.
            let (got, _) = streamed(parser, prompt, &pieces);
            assert_eq!(&got, expected, "{pieces:?}");
        }
    }
}

#[test]
fn qwen3_reply_that_opens_and_closes_its_thinking() {
    let text = "<think>\nLet me see.\n</think>\n\nParis.";
    let expected = split(Some("\nLet me see.\n"), Some("\n\nParis."));
    assert_eq!(whole(QWEN3, PromptState::Unopened, text), expected);
    every_cut(QWEN3, PromptState::Unopened, text, &expected);
}

#[test]
fn a_reply_without_thinking_is_all_content() {
    let text = "Paris, <think> and </think> as words.";
    let expected = split(None, Some(text));
    every_cut(QWEN3, PromptState::Unopened, text, &expected);
    // Thinking switched off in the prompt (Qwen3's `enable_thinking: false`): content, even
    // when the reply starts like a thinking block.
    let text = "<think>x</think>y";
    for parser in [QWEN3, R1] {
        every_cut(parser, PromptState::Closed, text, &split(None, Some(text)));
    }
}

#[test]
fn a_prompt_that_opened_the_block_makes_the_reply_reasoning_until_it_closes() {
    let text = "Let me see.\n</think>\n\nParis.";
    let expected = split(Some("Let me see.\n"), Some("\n\nParis."));
    for parser in [QWEN3, R1] {
        every_cut(parser, PromptState::Opened, text, &expected);
        // A `<think>` repeated at the reply's start is dropped with the whitespace before it.
        let repeated = format!("\n<think>{text}");
        every_cut(parser, PromptState::Opened, &repeated, &expected);
    }
}

#[test]
fn r1_thinks_from_the_first_token_when_the_prompt_does_not_say() {
    let text = "Hmm.</think>Paris.";
    every_cut(
        R1,
        PromptState::Unopened,
        text,
        &split(Some("Hmm."), Some("Paris.")),
    );
    let opened = "<think>Hmm.</think>Paris.";
    every_cut(
        R1,
        PromptState::Unopened,
        opened,
        &split(Some("Hmm."), Some("Paris.")),
    );
    // Qwen3 needs the reply to open the block: the same text is content.
    every_cut(QWEN3, PromptState::Unopened, text, &split(None, Some(text)));
}

#[test]
fn thinking_that_never_closes_is_all_reasoning_with_no_content() {
    let expected = split(Some("Let me think about </thi"), None);
    every_cut(
        QWEN3,
        PromptState::Unopened,
        "<think>Let me think about </thi",
        &expected,
    );
    every_cut(
        R1,
        PromptState::Opened,
        "Let me think about </thi",
        &expected,
    );
    // A reply that stops right after `</think>` has no content either.
    every_cut(
        R1,
        PromptState::Opened,
        "Done.</think>",
        &split(Some("Done."), None),
    );
}

#[test]
fn leading_whitespace_is_held_until_the_reply_shows_its_side() {
    // Whitespace then text: content, whitespace kept (Qwen3); reasoning (R1 opened).
    let text = "\n\n  Paris.";
    every_cut(QWEN3, PromptState::Unopened, text, &split(None, Some(text)));
    every_cut(R1, PromptState::Opened, text, &split(Some(text), None));
    // Whitespace alone, or a beginning of `<think>` that stops there.
    every_cut(
        QWEN3,
        PromptState::Unopened,
        " \n",
        &split(None, Some(" \n")),
    );
    every_cut(
        QWEN3,
        PromptState::Unopened,
        "<thin",
        &split(None, Some("<thin")),
    );
    assert_eq!(whole(QWEN3, PromptState::Unopened, ""), split(None, None));
}

#[test]
fn a_held_marker_prefix_is_given_out_once_it_is_not_a_marker() {
    let mut splitter = ReasoningSplitter::new(QWEN3, PromptState::Unopened);
    assert_eq!(
        splitter.push("<think>a </"),
        vec![Piece::Reasoning("a ".into())]
    );
    assert_eq!(splitter.push("b"), vec![Piece::Reasoning("</b".into())]);
    assert_eq!(splitter.push("</think>é"), vec![Piece::Content("é".into())]);
    assert_eq!(splitter.finish(), vec![]);
}

#[test]
fn multi_byte_text_around_the_markers() {
    let text = "<think>東京🙂</think>Köln✨";
    every_cut(
        QWEN3,
        PromptState::Unopened,
        text,
        &split(Some("東京🙂"), Some("Köln✨")),
    );
}
