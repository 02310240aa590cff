//! Charges a request's tokens to its API key when the request is over: prompt tokens as its
//! usage reports them, plus every token generated for its choices. "Over" is when the last of
//! its choice streams is dropped: answered, failed, or abandoned by a client that left, in
//! which case only the tokens generated so far are charged.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use futures::stream::BoxStream;
use futures::StreamExt;

use super::generation::ChoiceEvent;
use crate::tenants::Caller;

pub fn charge_when_done(
    caller: &Caller,
    prompt_tokens: u32,
    choices: Vec<BoxStream<'static, ChoiceEvent>>,
) -> Vec<BoxStream<'static, ChoiceEvent>> {
    if caller.name().is_none() {
        return choices;
    }
    let bill = Arc::new(Bill {
        caller: caller.clone(),
        prompt_tokens: u64::from(prompt_tokens),
        generated_tokens: AtomicU64::new(0),
    });
    choices
        .into_iter()
        .map(|choice| {
            let bill = Arc::clone(&bill);
            // Tokens reported so far for this choice; its finish event has the full count.
            let mut counted = 0u64;
            choice
                .map(move |event| {
                    let add = match &event {
                        ChoiceEvent::Text { tokens, .. } => tokens.len() as u64,
                        ChoiceEvent::Finish {
                            completion_tokens, ..
                        } => u64::from(*completion_tokens).saturating_sub(counted),
                        ChoiceEvent::Prompt { .. } | ChoiceEvent::Failed(_) => 0,
                    };
                    counted += add;
                    bill.generated_tokens.fetch_add(add, Ordering::Relaxed);
                    event
                })
                .boxed()
        })
        .collect()
}

/// One request's tokens, charged when the last choice lets go of it.
struct Bill {
    caller: Caller,
    prompt_tokens: u64,
    generated_tokens: AtomicU64,
}

impl Drop for Bill {
    fn drop(&mut self) {
        self.caller
            .charge(self.prompt_tokens, *self.generated_tokens.get_mut());
    }
}
