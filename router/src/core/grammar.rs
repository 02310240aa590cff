//! A request's grammar is compiled on the shards before the request is queued: a schema,
//! regex or grammar the engine cannot use is the client's 400, named by the field it came
//! from, and never a failure in the middle of a running batch. The shards pin what they
//! compiled under the pin's id until the request is done, so its every Prefill finds it.

use std::time::Duration;

use crate::error::ApiError;
use crate::scheduler::PinnedGrammar;
use crate::shard::{ShardBackend, ShardError};
use crate::validation::{OutputGrammar, ValidationError};

/// How long the router waits for a compile. The shards refuse a grammar over their own budget
/// well before this; it only bounds a shard that stopped answering.
const COMPILE_TIMEOUT: Duration = Duration::from_secs(60);

/// Compiles the pinned grammar (the constraint of every choice of one request) for the
/// tokenizer of `adapter_id` on every shard. However this ends, dropping the pin releases it.
pub async fn compile_grammar(
    shard: &dyn ShardBackend,
    adapter_id: &str,
    source: &OutputGrammar,
    pin: &PinnedGrammar,
) -> Result<(), ApiError> {
    let compile = shard.compile_grammar(adapter_id.to_owned(), pin.grammar().clone(), pin.id());
    let refused =
        |message: String| ApiError::Validation(ValidationError::invalid(source.param, message));
    let response = match tokio::time::timeout(COMPILE_TIMEOUT, compile).await {
        Ok(Ok(response)) => response,
        Ok(Err(ShardError::InvalidArgument(message))) => {
            return Err(refused(describe(source, &message)))
        }
        Ok(Err(error)) => return Err(ApiError::ShardUnavailable(error.message().to_owned())),
        Err(_) => {
            return Err(refused(describe(
                source,
                &format!(
                    "compiling it took longer than {} s",
                    COMPILE_TIMEOUT.as_secs()
                ),
            )))
        }
    };
    match response.error {
        None => {
            tracing::debug!(
                param = source.param,
                compile_us = response.compile_ns / 1000,
                "grammar compiled"
            );
            Ok(())
        }
        Some(error) => Err(refused(describe(source, &error))),
    }
}

/// The client's message: the field, then the engine's reason (which says what did not
/// compile and why).
fn describe(source: &OutputGrammar, reason: &str) -> String {
    format!("`{}` cannot be enforced: {reason}", source.param)
}
