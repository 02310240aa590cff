//! The end of the grace period: requests still running are ended with an error the client can
//! read (a final SSE error event and `[DONE]`, or a 503 body) instead of a cut connection, and
//! the router counts them so its exit code can say that it had to.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

#[derive(Clone, Debug)]
pub struct Cutoff {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    fired: watch::Sender<bool>,
    cut: AtomicU64,
}

impl Default for Cutoff {
    fn default() -> Self {
        Self {
            inner: Arc::new(Inner {
                fired: watch::channel(false).0,
                cut: AtomicU64::new(0),
            }),
        }
    }
}

impl Cutoff {
    /// Ends every request that waits on `fired`.
    pub fn fire(&self) {
        self.inner.fired.send_replace(true);
    }

    /// Resolves once `fire` was called (at once if it already was).
    pub async fn fired(&self) {
        let mut fired = self.inner.fired.subscribe();
        let _ = fired.wait_for(|fired| *fired).await;
    }

    /// One request was ended by the cutoff.
    pub fn record_cut(&self) {
        self.inner.cut.fetch_add(1, Ordering::Relaxed);
    }

    pub fn cut_requests(&self) -> u64 {
        self.inner.cut.load(Ordering::Relaxed)
    }
}
