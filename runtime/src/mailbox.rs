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
    /// Op batches of this connection the broker has applied (see [`Credit`]).
    applied: u64,
    /// The connection waits for the broker to apply its batches.
    credit_waker: Option<Waker>,
}

type Shared = Arc<Mutex<State>>;

/// Leaves the task's waker in `slot` (cloned only when it differs from the one there).
fn park(slot: &mut Option<Waker>, cx: &std::task::Context<'_>) {
    if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
        *slot = Some(cx.waker().clone());
    }
}

fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    // No code panics while holding the lock; a poisoned state is still consistent.
    shared.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn mailbox() -> (MailboxSender, EffectReceiver, Credit) {
    let shared = Shared::default();
    (
        MailboxSender {
            shared: shared.clone(),
        },
        EffectReceiver {
            shared: shared.clone(),
        },
        Credit { shared },
    )
}

/// A connection's bound on op batches sent but not yet applied by the broker.
///
/// Without it a publisher could be up to the whole request channel (1024 batches of up to
/// 64 KiB of frames) ahead of the broker, and a flow-control pause, which reaches it only
/// after the broker's turn, came ~75k messages late (measured with `warren-bench one-fast`:
/// queue depth swinging 0-75k against a mark of 4096, and every message above the transient
/// window paged to disk and read back: a third of the broker's CPU).
pub(crate) struct Credit {
    shared: Shared,
}

impl Credit {
    /// Waits until fewer than `max` of the `sent` batches are unapplied (or the broker has
    /// let the connection go: then the send itself reports it).
    pub(crate) async fn wait(&self, sent: u64, max: u64) {
        poll_fn(|cx| {
            let mut state = lock(&self.shared);
            if sent.saturating_sub(state.applied) < max || state.sender_gone {
                return Poll::Ready(());
            }
            park(&mut state.credit_waker, cx);
            Poll::Pending
        })
        .await
    }
}

/// The broker task's end.
pub(crate) struct MailboxSender {
    shared: Shared,
}

impl MailboxSender {
    /// Records that the broker has applied `applied` op batches of this connection, and
    /// wakes the connection if it waits for that.
    pub(crate) fn applied(&self, applied: u64) {
        let waker = {
            let mut state = lock(&self.shared);
            state.applied = applied;
            state.credit_waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

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
            (state.waker.take(), state.credit_waker.take())
        };
        for w in [waker.0, waker.1].into_iter().flatten() {
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
            park(&mut state.waker, cx);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Waker};

    #[test]
    fn a_connection_waits_while_max_batches_are_unapplied_and_resumes_when_one_is() {
        let (sender, _rx, credit) = mailbox();
        let mut cx = Context::from_waker(Waker::noop());
        // Three sent, none applied, at most four: go.
        assert!(pin!(credit.wait(3, 4)).poll(&mut cx).is_ready());
        // Four unapplied: wait.
        let mut waiting = pin!(credit.wait(4, 4));
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        assert!(lock(&sender.shared).credit_waker.is_some());
        sender.applied(1);
        assert!(waiting.as_mut().poll(&mut cx).is_ready());
        // The broker letting the connection go releases a waiter too.
        let mut stuck = pin!(credit.wait(100, 4));
        assert!(stuck.as_mut().poll(&mut cx).is_pending());
        drop(sender);
        assert!(stuck.as_mut().poll(&mut cx).is_ready());
    }
}
