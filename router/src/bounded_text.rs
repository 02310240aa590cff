//! Error texts of bounded size. A message may quote what a client or an adapter's files sent
//! (a regex, a role, a module list), and such a quote can be megabytes long: echoed whole it
//! multiplies a hostile body into the response and the log, and a gRPC status that large no
//! longer fits the HTTP/2 trailer the router accepts from a shard. Every message that leaves
//! through HTTP, a shard status or the log passes here.
//!
//! The cut keeps the start and the end of the text: the start names the field and the problem,
//! the end often says where it failed ("… at position 17").

use std::borrow::Cow;

/// Longest error message in bytes, marker included.
pub const MAX_MESSAGE_BYTES: usize = 512;

/// Bytes of the text kept after the cut.
const TAIL_BYTES: usize = 128;

/// `text` unchanged when it fits in `MAX_MESSAGE_BYTES`; otherwise its start and end around a
/// marker that says how many bytes were left out.
pub fn bounded(text: &str) -> Cow<'_, str> {
    bounded_to(text, MAX_MESSAGE_BYTES)
}

/// `bounded` with a limit of the caller's (at least enough for the marker and a few bytes).
pub fn bounded_to(text: &str, max_bytes: usize) -> Cow<'_, str> {
    if text.len() <= max_bytes {
        return Cow::Borrowed(text);
    }
    // The marker's own length depends on the count it prints: reserve for the widest count.
    let reserve = marker(text.len()).len();
    let room = max_bytes.saturating_sub(reserve).max(2);
    let tail_len = TAIL_BYTES.min(room / 3);
    let head = floor_char_boundary(text, room - tail_len);
    let tail = ceil_char_boundary(text, text.len() - tail_len);
    let cut = tail - head;
    Cow::Owned(format!("{}{}{}", &text[..head], marker(cut), &text[tail..]))
}

fn marker(cut: usize) -> String {
    format!(" […{cut} bytes cut…] ")
}

/// The largest index ≤ `at` that starts a character.
fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The smallest index ≥ `at` that starts a character (or the end).
fn ceil_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at += 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_text_is_kept_as_it_is() {
        assert!(matches!(bounded("bad regex"), Cow::Borrowed("bad regex")));
        let exact = "x".repeat(MAX_MESSAGE_BYTES);
        assert_eq!(bounded(&exact), exact);
    }

    #[test]
    fn a_long_text_keeps_its_start_and_end_and_counts_the_cut() {
        let text = format!(
            "`regex` is invalid: {}: unclosed group at 9",
            "(".repeat(200_000)
        );
        let cut = bounded(&text);
        assert!(cut.len() <= MAX_MESSAGE_BYTES, "{} bytes", cut.len());
        assert!(cut.starts_with("`regex` is invalid: (("));
        assert!(cut.ends_with(": unclosed group at 9"));
        let marker_at = cut.find(" […").unwrap();
        let count: usize = cut[marker_at + " […".len()..]
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        // What is shown and what is counted make up the whole text.
        let shown = cut.len() - marker(count).len();
        assert_eq!(shown + count, text.len());
    }

    #[test]
    fn multibyte_characters_are_never_split() {
        for width in [1, 2, 3, 4] {
            let ch = ['a', 'é', '€', '𝄞'][width - 1];
            let text: String = std::iter::repeat_n(ch, 10_000).collect();
            for max in [40, 41, 42, 43, 100, MAX_MESSAGE_BYTES] {
                let cut = bounded_to(&text, max);
                assert!(cut.len() <= max, "{} > {max}", cut.len());
                assert!(cut.chars().filter(|c| *c == ch).count() > 0);
            }
        }
    }
}
