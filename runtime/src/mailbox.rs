//! A connection's effect mailbox: the broker task pushes effect batches, the connection task
//! takes them in order.
//!
//! Replaces tokio's unbounded mpsc, whose first block (32 slots) and cache-padded channel
//! state cost ~1.3 KB per connection even while idle; this one is ~100 bytes and its queue
//! allocates only while batches wait. Bounded in practice as the channel it replaces (see the
//! crate docs): replies by requests, deliveries by the write window and prefetch.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Poll, Waker};
use warren_core::effect::Effect;

#[derive(Default)]
struct State {
    queue: VecDeque<Vec<Effect>>,
    waker: Option<Waker>,
    /// The broker dropped the connection: `recv` returns `None` once the queue is empty.
    sender_gone: bool,
    /// The connection task is gone: batches are dropped instead of queued.
    receiver_gone: bool,
}

type Shared = Arc<Mutex<State>>;

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // No code panics while holding the lock; a poisoned state is still consistent.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn mailbox() -> (MailboxSender, EffectReceiver) {
    let shared = Shared::default();
    (
        MailboxSender {
            shared: shared.clone(),
        },
        EffectReceiver { shared },
    )
}

/// The broker task's end.
pub(crate) struct MailboxSender {
    shared: Shared,
}

impl MailboxSender {
    /// Queues a batch and wakes the connection; dropped if the connection is gone.
    pub(crate) fn send(&self, batch: Vec<Effect>) {
        let waker = {
            let mut state = lock(&self.shared);
            if state.receiver_gone {
                return;
            }
            state.queue.push_back(batch);
            state.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

impl Drop for MailboxSender {
    fn drop(&mut self) {
        let waker = {
            let mut state = lock(&self.shared);
            state.sender_gone = true;
            state.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

fn pop(state: &mut State) -> Option<Vec<Effect>> {
    let batch = state.queue.pop_front();
    if state.queue.is_empty() && state.queue.capacity() > 0 {
        // An idle connection holds no queue storage.
        state.queue = VecDeque::new();
    }
    batch
}

/// Receives the effects addressed to one connection, in order.
pub struct EffectReceiver {
    shared: Shared,
}

impl EffectReceiver {
    /// The next batch; `None` once the broker has dropped this connection. Cancel-safe: a
    /// batch is taken only when it is returned.
    pub async fn recv(&mut self) -> Option<Vec<Effect>> {
        poll_fn(|cx| {
            let mut state = lock(&self.shared);
            if let Some(batch) = pop(&mut state) {
                return Poll::Ready(Some(batch));
            }
            if state.sender_gone {
                return Poll::Ready(None);
            }
            if !state
                .waker
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                state.waker = Some(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    /// The next batch if one is ready.
    pub fn try_recv(&mut self) -> Option<Vec<Effect>> {
        pop(&mut lock(&self.shared))
    }
}

impl Drop for EffectReceiver {
    fn drop(&mut self) {
        let mut state = lock(&self.shared);
        state.receiver_gone = true;
        state.queue.clear();
        state.waker = None;
    }
}
