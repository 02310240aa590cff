//! A request's grammar pinned on the shards: compiled once, under an id the scheduler hands
//! out, before the request is admitted, and kept there until the last choice that carries it
//! is gone. Its every Prefill (a resumed one too) then names it by id, and the batcher
//! releases it between steps.

use std::fmt;

use tokio::sync::mpsc;

use super::batcher::Command;
use super::Grammar;

/// Shared by the choices of one request (`Arc`); dropping the last one releases the pin.
pub struct PinnedGrammar {
    id: u64,
    grammar: Grammar,
    releases: mpsc::UnboundedSender<Command>,
}

impl PinnedGrammar {
    pub(super) fn new(id: u64, grammar: Grammar, releases: mpsc::UnboundedSender<Command>) -> Self {
        Self {
            id,
            grammar,
            releases,
        }
    }

    /// What Prefill names the grammar by (never 0).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// What the shards compiled.
    pub fn grammar(&self) -> &Grammar {
        &self.grammar
    }
}

impl Drop for PinnedGrammar {
    fn drop(&mut self) {
        // Once the loop is gone the shards go too: nothing is left to release.
        let _ = self.releases.send(Command::ReleaseGrammar(self.id));
    }
}

impl fmt::Debug for PinnedGrammar {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedGrammar")
            .field("id", &self.id)
            .field("grammar", &self.grammar)
            .finish()
    }
}
