//! A stream's committed tail as the waits of [`StreamBackend`](crate::StreamBackend) see it:
//! one `watch` per stream that the writer moves forward and deletion ends. Both waits of the
//! trait (`wait_durable` for confirms, `wait_data` for subscribers at the end of a stream)
//! are "until an offset at or past `offset` is committed, or the stream is gone", so every
//! backend shares this one implementation.

use crate::backend::StreamError;
use tokio::sync::watch;

/// What waiters see of a stream's end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tail {
    /// Offsets below this are committed (durable and readable).
    pub committed: u64,
    /// First offset of the last committed chunk (Deliver v2's committed chunk id).
    pub last_chunk: Option<u64>,
    /// The stream was deleted: every wait ends with `DoesNotExist`.
    pub deleted: bool,
}

/// The writer's side: one per stream.
#[derive(Debug)]
pub struct TailWatch(watch::Sender<Tail>);

impl TailWatch {
    pub fn new(tail: Tail) -> TailWatch {
        TailWatch(watch::channel(tail).0)
    }

    /// The tail now.
    pub fn get(&self) -> Tail {
        *self.0.borrow()
    }

    /// Moves the tail forward to `committed` (never back: a late sync reporting less is
    /// ignored), with the last committed chunk when the writer knows it.
    pub fn advance(&self, committed: u64, last_chunk: Option<u64>) {
        self.0.send_if_modified(|t| {
            let moved = committed > t.committed;
            if moved {
                t.committed = committed;
                t.last_chunk = last_chunk.filter(|&c| c < committed).or(t.last_chunk);
            }
            moved
        });
    }

    /// The stream is gone: wakes every waiter with `DoesNotExist`.
    pub fn delete(&self) {
        self.0.send_modify(|t| t.deleted = true);
    }

    /// A wait on this tail (see [`wait_past`]).
    pub fn waiter(&self) -> watch::Receiver<Tail> {
        self.0.subscribe()
    }
}

/// Resolves once an offset >= `offset` is committed, or with `DoesNotExist` when the stream
/// is deleted (or was not found: `Err` in). Owns its receiver, so the future is `'static`
/// and may be awaited by the connection shell after the backend call returned.
pub async fn wait_past(
    tail: Result<watch::Receiver<Tail>, StreamError>,
    offset: u64,
) -> Result<(), StreamError> {
    let mut rx = tail?;
    match rx.wait_for(|t| t.deleted || t.committed > offset).await {
        Ok(t) if !t.deleted => Ok(()),
        // Deleted, or the writer's side dropped with the stream.
        _ => Err(StreamError::DoesNotExist),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_end_past_the_offset_or_at_deletion_and_never_move_back() {
        let w = TailWatch::new(Tail::default());
        let past_4 = tokio::spawn(wait_past(Ok(w.waiter()), 4));
        w.advance(3, Some(2));
        tokio::task::yield_now().await;
        assert!(!past_4.is_finished(), "offset 4 is not committed yet");
        w.advance(5, Some(4));
        assert_eq!(past_4.await.unwrap(), Ok(()));
        w.advance(2, Some(1));
        assert_eq!(w.get().committed, 5, "the tail never moves back");
        assert_eq!(w.get().last_chunk, Some(4));
        let later = tokio::spawn(wait_past(Ok(w.waiter()), 100));
        w.delete();
        assert_eq!(later.await.unwrap(), Err(StreamError::DoesNotExist));
        assert_eq!(
            wait_past(Err(StreamError::DoesNotExist), 0).await,
            Err(StreamError::DoesNotExist)
        );
    }
}
