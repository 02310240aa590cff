//! Waits until every shard answers the gRPC `Health` call on its unix socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tokio::time::Instant;
use tonic::transport::{Endpoint, Uri};

use crate::pb::shard_client::ShardClient;
use crate::pb::{ChannelLimit, HealthRequest};

const POLL_INTERVAL: Duration = Duration::from_millis(250);
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a slow start (a big download) is reported, so the log shows the launcher is alive.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
#[error("shard {rank} did not answer Health within {waited:?} (last error: {last_error})")]
pub struct NotReady {
    pub rank: usize,
    pub waited: Duration,
    pub last_error: String,
}

/// Polls each shard in rank order until it answers, or fails once `timeout` has passed in all.
/// The caller races this against the shards' exits, so a dead shard fails fast instead.
pub async fn wait_until_ready(sockets: &[PathBuf], timeout: Duration) -> Result<(), NotReady> {
    let started = Instant::now();
    let mut next_report = started + PROGRESS_EVERY;
    for (rank, socket) in sockets.iter().enumerate() {
        loop {
            let last_error = match check(socket).await {
                Ok(()) => {
                    tracing::info!(rank, "shard {rank} is ready");
                    break;
                }
                Err(e) => e,
            };
            let now = Instant::now();
            if now - started >= timeout {
                return Err(NotReady {
                    rank,
                    waited: now - started,
                    last_error,
                });
            }
            if now >= next_report {
                tracing::info!(
                    rank,
                    "still waiting for shard {rank} to load the model ({}s so far)",
                    (now - started).as_secs()
                );
                next_report = now + PROGRESS_EVERY;
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
    Ok(())
}

/// One Health call over a fresh connection.
pub async fn check(socket: &Path) -> Result<(), String> {
    let socket = socket.to_owned();
    // The URI is required by the API but unused: the connector dials the socket.
    let channel = Endpoint::from_static("http://shard.local")
        .connect_timeout(ATTEMPT_TIMEOUT)
        .timeout(ATTEMPT_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(socket).await?)) }
        }))
        .await
        .map_err(|e| format!("connect: {}", with_sources(&e)))?;
    // Health messages are empty, but the launcher's channel follows the one limit both sides of
    // the shard's channel use, so no client of the shard differs from the others.
    let max_message_bytes = ChannelLimit::MaxMessageBytes as usize;
    ShardClient::new(channel)
        .max_decoding_message_size(max_message_bytes)
        .max_encoding_message_size(max_message_bytes)
        .health(HealthRequest {})
        .await
        .map(|_| ())
        .map_err(|status| format!("{:?}: {}", status.code(), status.message()))
}

/// "transport error: No such file or directory": tonic's top-level message alone says little.
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_socket_times_out_naming_the_rank() {
        let dir = std::env::temp_dir().join(format!("quiver-health-test-{}", std::process::id()));
        let err = wait_until_ready(&[dir.join("nope.sock")], Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(err.rank, 0);
        assert!(err.to_string().contains("shard 0"));
        assert!(err.last_error.contains("connect"));
    }
}
