//! Stop strings over a stream of text chunks.
//!
//! A stop string can arrive split over several chunks (`"<|en"` then `"d|>"`), so any tail of
//! the text that could still grow into a stop string is held back until the next chunk settles
//! it. Nothing that belongs to a stop string is ever emitted; once one matches, the text before
//! it is the last output.

/// What one `push` produced.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopStep {
    /// Text safe to send to the client now.
    pub text: String,
    /// A stop string matched: `text` ends right before it and generation should end.
    pub stopped: bool,
}

#[derive(Debug, Clone)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet emitted: always a possible beginning of some stop string.
    pending: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match before any text).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|stop| !stop.is_empty()).collect(),
            pending: String::new(),
            stopped: false,
        }
    }

    #[cfg(test)]
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next chunk of generated text. After a stop matched, further text is ignored.
    pub fn push(&mut self, chunk: &str) -> StopStep {
        if self.stopped {
            return StopStep {
                text: String::new(),
                stopped: true,
            };
        }
        self.pending.push_str(chunk);
        // Earliest start wins; everything before `pending` was already ruled out as a start.
        let first_match = self
            .stops
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()))
            .min();
        if let Some(start) = first_match {
            self.stopped = true;
            let mut text = std::mem::take(&mut self.pending);
            text.truncate(start);
            return StopStep {
                text,
                stopped: true,
            };
        }
        let held = self.longest_partial_stop();
        let text = self.pending[..self.pending.len() - held].to_owned();
        self.pending.drain(..self.pending.len() - held);
        StopStep {
            text,
            stopped: false,
        }
    }

    /// The text held back when generation ended for another reason (EOS, length): it turned out
    /// not to be a stop string, so it belongs to the output.
    pub fn finish(self) -> String {
        if self.stopped {
            String::new()
        } else {
            self.pending
        }
    }

    /// Length in bytes of the longest tail of `pending` that is a proper prefix of a stop string.
    fn longest_partial_stop(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                let longest = (stop.len() - 1).min(self.pending.len());
                (1..=longest)
                    .rev()
                    .filter(|len| stop.is_char_boundary(*len))
                    .find(|len| self.pending.ends_with(&stop[..*len]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the whole output must be: the text up to the earliest stop, and whether one matched.
    fn reference(text: &str, stops: &[&str]) -> (String, bool) {
        let first = stops
            .iter()
            .filter(|stop| !stop.is_empty())
            .filter_map(|stop| text.find(stop))
            .min();
        match first {
            Some(start) => (text[..start].to_owned(), true),
            None => (text.to_owned(), false),
        }
    }

    /// Feeds `chunks`, checking on the way that emitted text only ever extends a prefix of the
    /// expected output (so no part of a stop string is ever sent).
    fn run(chunks: &[&str], stops: &[&str], expected: &(String, bool)) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut emitted = String::new();
        let mut stopped = false;
        for chunk in chunks {
            let step = matcher.push(chunk);
            emitted.push_str(&step.text);
            assert!(
                expected.0.starts_with(&emitted),
                "emitted {emitted:?} beyond {expected:?} for chunks {chunks:?}"
            );
            stopped |= step.stopped;
            if step.stopped {
                break;
            }
        }
        emitted.push_str(&matcher.finish());
        assert_eq!(
            (emitted, stopped),
            *expected,
            "chunks {chunks:?} stops {stops:?}"
        );
    }

    /// Every way of cutting `text` into chunks at character boundaries (2^(chars-1) ways).
    fn all_chunkings(text: &str) -> Vec<Vec<&str>> {
        let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
        (0..1u32 << cuts.len())
            .map(|mask| {
                let mut pieces = Vec::new();
                let mut start = 0;
                for (bit, cut) in cuts.iter().enumerate() {
                    if mask & (1 << bit) != 0 {
                        pieces.push(&text[start..*cut]);
                        start = *cut;
                    }
                }
                pieces.push(&text[start..]);
                pieces
            })
            .collect()
    }

    #[test]
    fn every_chunking_gives_the_reference_output() {
        let cases: &[(&str, &[&str])] = &[
            ("hello STOP world", &["STOP"]),
            ("abcabd", &["abd"]),
            ("aaab", &["aab"]),
            ("xx<|end|>yy", &["<|end|>", "<|"]),
            ("one two three", &["three", "two"]),
            ("no stop here", &["zzz", "here!"]),
            ("ends with par", &["partial"]),
            ("héllo 世界😀!", &["界😀", "😀!"]),
            ("stop", &["stop"]),
            ("ab", &["", "b"]),
        ];
        let mut runs = 0;
        for (text, stops) in cases {
            let expected = reference(text, stops);
            for chunks in all_chunkings(text) {
                run(&chunks, stops, &expected);
                runs += 1;
            }
        }
        assert!(runs > 5000, "{runs}");
    }

    #[test]
    fn earliest_match_wins_and_later_text_is_ignored() {
        let mut matcher = StopMatcher::new(vec!["world".into(), "lo w".into()]);
        assert_eq!(
            matcher.push("hel"),
            StopStep {
                // "l" may begin "lo w": held back.
                text: "he".into(),
                stopped: false
            }
        );
        assert_eq!(matcher.push("lo world").text, "l");
        assert!(matcher.is_stopped());
        assert_eq!(
            matcher.push("more"),
            StopStep {
                text: String::new(),
                stopped: true
            }
        );
        assert_eq!(matcher.finish(), "");
    }

    #[test]
    fn partial_stop_is_held_then_released() {
        let mut matcher = StopMatcher::new(vec!["</s>".into()]);
        assert_eq!(matcher.push("a</").text, "a");
        assert_eq!(matcher.push("b").text, "</b");
        assert_eq!(matcher.push("<").text, "");
        assert_eq!(matcher.finish(), "<");
    }
}
