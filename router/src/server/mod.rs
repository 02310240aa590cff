//! The HTTP server under the axum app: an accept loop that holds at most `max_connections`
//! connections (the rest wait in the kernel's listen backlog, so a flood delays newcomers
//! without touching the connections already served), HTTP/1.1 and h2c through hyper, the
//! header-read and keep-alive timeouts of `activity`, the body deadline of `body_deadline`, and
//! a graceful stop.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Request;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

mod activity;
mod body_deadline;
mod watched_body;

pub use activity::IdleLimits;
use activity::{Activity, BusyWatch, TrackedIo};
pub use body_deadline::{BodyDeadline, BodyLimits, MIN_RATE_GRACE};
pub use watched_body::{BodyWatch, Polled, WatchedBody};

/// After a failed accept (out of file descriptors, most likely), wait before the next one
/// rather than spin.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    pub idle: IdleLimits,
    pub body: BodyLimits,
    pub max_connections: u32,
}

/// The running server. Dropping it does not stop it: call `stop_accepting`, then wait on
/// `closed`.
pub struct Server {
    slots: Arc<Semaphore>,
    max_connections: u32,
    stop: watch::Sender<bool>,
}

impl Server {
    /// Starts serving `app` on `listener` in the background.
    pub fn spawn(listener: TcpListener, app: Router, limits: ConnectionLimits) -> Self {
        let max_connections = limits.max_connections.max(1);
        let slots = Arc::new(Semaphore::new(max_connections as usize));
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(accept_loop(listener, app, limits, slots.clone(), stopped));
        Self {
            slots,
            max_connections,
            stop,
        }
    }

    /// Closes the listener; every connection finishes the request it is serving, then closes
    /// (idle ones at once).
    pub fn stop_accepting(&self) {
        self.stop.send_replace(true);
    }

    /// Resolves once every connection has closed (each holds a slot until then).
    pub async fn closed(&self) {
        let _ = self.slots.acquire_many(self.max_connections).await;
    }
}

async fn accept_loop(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    slots: Arc<Semaphore>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        // A slot first: while all are taken, new connections stay in the backlog.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => return,
            },
            () = stop_requested(&mut stopped) => return,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) => {
                    tracing::warn!(%error, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                    continue;
                }
            },
            () = stop_requested(&mut stopped) => return,
        };
        tokio::spawn(connection(
            stream,
            app.clone(),
            limits,
            stopped.clone(),
            slot,
        ));
    }
}

/// Serves one connection until the client closes it, it sits idle past its limit, or the
/// server stops.
async fn connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    mut stopped: watch::Receiver<bool>,
    _slot: OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let activity = Activity::new(limits.idle);
    let io = TokioIo::new(TrackedIo::new(stream, activity.clone()));
    let service = hyper::service::service_fn({
        let activity = activity.clone();
        move |request: Request<Incoming>| {
            let busy = activity.begin();
            let app = app.clone();
            async move {
                let response = app.oneshot(limits.body.apply(request)).await?;
                Ok::<_, Infallible>(
                    response.map(|body| WatchedBody::wrap(body, BusyWatch::new(busy))),
                )
            }
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // `activity` times the headers; hyper's own timer would also cut idle keep-alive
    // connections at the header limit.
    builder.http1().header_read_timeout(None);
    let conn = builder.serve_connection(io, service);
    tokio::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection ended with an error");
                }
                return;
            }
            () = activity.expired() => {
                tracing::debug!("closing a connection that sent no complete request in time");
                return;
            }
            () = stop_requested(&mut stopped), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Resolves once the server is stopping (the guard of `wait_for` stays inside: it is not Send).
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}
