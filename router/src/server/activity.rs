//! When a connection may be closed for doing nothing: what it is waiting for decides the limit.
//! A new connection, or one whose client has sent the first bytes of a request, gets the
//! header-read timeout (slowloris); a keep-alive connection waiting for its next request gets
//! the keep-alive timeout; a connection with a request in progress (headers read, response not
//! yet fully sent, a stream included) is never timed out here.
//!
//! hyper's own `header_read_timeout` starts as soon as a connection waits for a request, so it
//! cannot tell an idle keep-alive connection from a slow header: this does.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::Instant;

use super::watched_body::{BodyWatch, Polled};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleLimits {
    pub header_read: Duration,
    pub keep_alive: Duration,
}

/// One connection's state, shared by its socket wrapper, its requests and its watchdog.
#[derive(Debug)]
pub struct Activity {
    limits: IdleLimits,
    state: Mutex<State>,
    changed: Notify,
}

#[derive(Debug)]
struct State {
    /// Requests whose response is not finished.
    in_progress: usize,
    /// When the connection last started waiting for a request.
    waiting_since: Instant,
    /// No request was read yet: the client connected to send one, so it gets the header limit.
    fresh: bool,
    /// When the first byte of the next request arrived.
    first_byte_at: Option<Instant>,
}

impl Activity {
    pub fn new(limits: IdleLimits) -> Arc<Self> {
        Arc::new(Self {
            limits,
            state: Mutex::new(State {
                in_progress: 0,
                waiting_since: Instant::now(),
                fresh: true,
                first_byte_at: None,
            }),
            changed: Notify::new(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The state stays consistent even if a holder panicked: every update is one assignment.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// When the connection is to be closed if nothing changes; `None` while a request runs.
    pub fn deadline(&self) -> Option<Instant> {
        let state = self.state();
        if state.in_progress > 0 {
            return None;
        }
        Some(match state.first_byte_at {
            Some(first) => first + self.limits.header_read,
            None if state.fresh => state.waiting_since + self.limits.header_read,
            None => state.waiting_since + self.limits.keep_alive,
        })
    }

    fn bytes_read(&self) {
        let mut state = self.state();
        if state.in_progress == 0 && state.first_byte_at.is_none() {
            state.first_byte_at = Some(Instant::now());
            drop(state);
            self.changed.notify_one();
        }
    }

    /// A request's headers were read; it is in progress until the guard drops.
    pub fn begin(self: &Arc<Self>) -> Busy {
        let mut state = self.state();
        state.in_progress += 1;
        state.fresh = false;
        state.first_byte_at = None;
        drop(state);
        self.changed.notify_one();
        Busy(self.clone())
    }

    /// Resolves when the connection has been waiting longer than its limit allows.
    pub async fn expired(&self) {
        loop {
            let changed = self.changed.notified();
            match self.deadline() {
                None => changed.await,
                Some(deadline) if deadline <= Instant::now() => return,
                Some(deadline) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(deadline) => {}
                        () = changed => {}
                    }
                }
            }
        }
    }
}

/// A request in progress on its connection.
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.in_progress -= 1;
        if state.in_progress == 0 {
            state.waiting_since = Instant::now();
            state.first_byte_at = None;
        }
        drop(state);
        self.0.changed.notify_one();
    }
}

/// Keeps a response's request in progress until its last frame is sent (or the response is
/// dropped).
pub struct BusyWatch(Option<Busy>);

impl BusyWatch {
    pub fn new(busy: Busy) -> Self {
        Self(Some(busy))
    }
}

impl BodyWatch for BusyWatch {
    fn polled(&mut self, polled: &Polled) {
        if matches!(polled, Poll::Ready(None) | Poll::Ready(Some(Err(_)))) {
            self.0 = None;
        }
    }
}

/// The socket, reporting the bytes it reads to the connection's `Activity`.
pub struct TrackedIo<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T> TrackedIo<T> {
    pub fn new(inner: T, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for TrackedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.bytes_read();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TrackedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: IdleLimits = IdleLimits {
        header_read: Duration::from_secs(2),
        keep_alive: Duration::from_secs(30),
    };

    /// The limit the connection is under now: its deadline less the moment its phase began.
    fn limit_since(activity: &Activity, start: Instant) -> Option<Duration> {
        activity.deadline().map(|deadline| deadline - start)
    }

    #[test]
    fn each_phase_gets_its_own_limit() {
        let opened = Instant::now();
        let activity = Activity::new(LIMITS);
        let fresh = limit_since(&activity, opened).expect("a new connection is timed");
        assert!(
            fresh >= LIMITS.header_read && fresh < LIMITS.keep_alive,
            "{fresh:?}"
        );

        let busy = activity.begin();
        assert_eq!(
            activity.deadline(),
            None,
            "a running request is never timed out"
        );
        let idle_since = Instant::now();
        drop(busy);
        let idle = limit_since(&activity, idle_since).expect("an idle connection is timed");
        assert!(idle >= LIMITS.keep_alive, "{idle:?}");

        let first_byte = Instant::now();
        activity.bytes_read();
        let header = limit_since(&activity, first_byte).expect("a started header is timed");
        assert!(
            header >= LIMITS.header_read && header < LIMITS.keep_alive,
            "{header:?}"
        );
        let deadline = activity.deadline();
        activity.bytes_read();
        assert_eq!(
            activity.deadline(),
            deadline,
            "later bytes do not extend the header limit"
        );
    }

    #[tokio::test]
    async fn expires_only_when_idle_past_the_limit() {
        let activity = Activity::new(IdleLimits {
            header_read: Duration::from_millis(20),
            keep_alive: Duration::from_millis(20),
        });
        let busy = activity.begin();
        let mut watch = tokio::spawn({
            let activity = activity.clone();
            async move { activity.expired().await }
        });
        // Several limits' worth with a request running: the watchdog must still be waiting.
        let ran = tokio::time::timeout(Duration::from_millis(200), &mut watch).await;
        assert!(ran.is_err(), "expired while a request ran");
        drop(busy);
        tokio::time::timeout(Duration::from_secs(10), watch)
            .await
            .expect("the watchdog ends once the keep-alive limit passed")
            .expect("the watchdog task did not panic");
    }
}
