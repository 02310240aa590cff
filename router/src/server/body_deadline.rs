//! How long a request body may take to arrive. The header timeout (`activity`) ends once the
//! headers are in; a client that then sends half a body and stops would hold its connection for
//! as long as it likes. So every body gets a deadline, counted from its headers: the whole body
//! within `read_timeout`, and with a minimum rate, also `MIN_RATE_GRACE` plus one second per
//! `min_rate` bytes received so far (Apache's mod_reqtimeout `body=5-30,MinRate=1024`): a body
//! that stalls is cut after the grace, a steady one gets the whole timeout.
//!
//! A body past its deadline ends with an error, and the unread rest is dropped, so hyper closes
//! the connection after the answer; [`BodyDeadline`] in the request's extensions tells the HTTP
//! layer to answer 408 (`http::body_timeout`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::BoxError;
use http_body::{Frame, SizeHint};
use tokio::time::{Instant, Sleep};

/// Time a body gets before `min_rate` applies: a client's first packets, a proxy's buffering.
pub const MIN_RATE_GRACE: Duration = Duration::from_secs(5);

/// `--body-read-timeout-secs`, `--body-read-min-rate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    pub read_timeout: Duration,
    /// Bytes per second after the grace; 0: the whole-body timeout alone.
    pub min_rate: u64,
}

impl BodyLimits {
    /// How long after its headers a body that has brought `received` bytes must be complete.
    pub fn allowance(&self, received: u64) -> Duration {
        if self.min_rate == 0 {
            return self.read_timeout;
        }
        let paced = Duration::from_millis(received.saturating_mul(1000) / self.min_rate);
        MIN_RATE_GRACE.saturating_add(paced).min(self.read_timeout)
    }

    /// `request` with its body under these limits, and a [`BodyDeadline`] in its extensions.
    /// A request without a body is left as it is.
    pub fn apply<B>(self, request: Request<B>) -> Request
    where
        B: HttpBody<Data = Bytes> + Send + Unpin + 'static,
        B::Error: Into<BoxError>,
    {
        if request.body().is_end_stream() {
            return request.map(Body::new);
        }
        let deadline = BodyDeadline {
            passed: Arc::default(),
            limits: self,
        };
        let (mut parts, body) = request.into_parts();
        parts.extensions.insert(deadline.clone());
        let started = Instant::now();
        let body = TimedBody {
            inner: Some(body),
            received: 0,
            started,
            timer: Some(Box::pin(tokio::time::sleep_until(
                started + self.allowance(0),
            ))),
            deadline,
        };
        Request::from_parts(parts, Body::new(body))
    }
}

/// Whether a request's body ran out of time, and under which limits.
#[derive(Debug, Clone)]
pub struct BodyDeadline {
    passed: Arc<AtomicBool>,
    pub limits: BodyLimits,
}

impl BodyDeadline {
    pub fn passed(&self) -> bool {
        self.passed.load(Ordering::Acquire)
    }
}

/// The error a body past its deadline ends with.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
pub struct BodyTimedOut;

struct TimedBody<B> {
    /// `None` once the deadline passed: the rest is never read.
    inner: Option<B>,
    received: u64,
    started: Instant,
    /// `None` once the body is complete.
    timer: Option<Pin<Box<Sleep>>>,
    deadline: BodyDeadline,
}

impl<B> HttpBody for TimedBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(Some(Err(BodyTimedOut.into())));
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(timer)) = (frame.data_ref(), this.timer.as_mut()) {
                    this.received += data.len() as u64;
                    if this.deadline.limits.min_rate > 0 {
                        let allowance = this.deadline.limits.allowance(this.received);
                        timer.as_mut().reset(this.started + allowance);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(error))) => Poll::Ready(Some(Err(error.into()))),
            Poll::Ready(None) => {
                this.timer = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                let expired = this
                    .timer
                    .as_mut()
                    .is_some_and(|timer| timer.as_mut().poll(cx).is_ready());
                if !expired {
                    return Poll::Pending;
                }
                this.inner = None;
                this.timer = None;
                this.deadline.passed.store(true, Ordering::Release);
                Poll::Ready(Some(Err(BodyTimedOut.into())))
            }
        }
    }

    /// A body cut at its deadline counts as ended: nothing more will be read from it (so
    /// `body_guard` does not try to discard its rest).
    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), HttpBody::size_hint)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_gets_the_grace_plus_a_second_per_min_rate_bytes_up_to_the_timeout() {
        let limits = BodyLimits {
            read_timeout: Duration::from_secs(30),
            min_rate: 1024,
        };
        assert_eq!(limits.allowance(0), MIN_RATE_GRACE);
        assert_eq!(
            limits.allowance(512),
            MIN_RATE_GRACE + Duration::from_millis(500)
        );
        assert_eq!(limits.allowance(10 * 1024), Duration::from_secs(15));
        assert_eq!(limits.allowance(4 << 20), Duration::from_secs(30));
        assert_eq!(limits.allowance(u64::MAX), Duration::from_secs(30));
        let whole_only = BodyLimits {
            min_rate: 0,
            ..limits
        };
        assert_eq!(whole_only.allowance(0), Duration::from_secs(30));
        let short = BodyLimits {
            read_timeout: Duration::from_secs(1),
            min_rate: 1024,
        };
        assert_eq!(short.allowance(0), Duration::from_secs(1));
    }
}
