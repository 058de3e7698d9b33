//! Heartbeats as deadlines (AMQP 0.9.1 section 4.2.7): send one after half an interval of
//! silence on our side, give up on a peer silent for two intervals. Times are the shell's
//! monotonic milliseconds; nothing here reads a clock.

/// What a heartbeat deadline asks for.
#[derive(Debug, PartialEq)]
pub(crate) enum Beat {
    /// Nothing due yet.
    Idle,
    /// Send a heartbeat frame.
    Send,
    /// Nothing received for two intervals: close the socket.
    PeerDead,
}

pub(crate) struct Heartbeat {
    interval_ms: u64,
    last_read: u64,
    last_write: u64,
}

impl Heartbeat {
    /// `None` when the negotiated interval is 0 (heartbeats off).
    pub(crate) fn new(secs: u16, now: u64) -> Option<Heartbeat> {
        (secs > 0).then(|| Heartbeat {
            interval_ms: u64::from(secs) * 1000,
            last_read: now,
            last_write: now,
        })
    }

    pub(crate) fn interval_secs(&self) -> u64 {
        self.interval_ms / 1000
    }

    pub(crate) fn read(&mut self, now: u64) {
        self.last_read = now;
    }

    pub(crate) fn written(&mut self, now: u64) {
        self.last_write = now;
    }

    /// When `on_timeout` has something to decide.
    pub(crate) fn deadline(&self) -> u64 {
        (self.last_write + self.interval_ms / 2).min(self.last_read + self.interval_ms * 2)
    }

    /// `paused`: we are not reading, so the client's heartbeats sit unread in the socket and
    /// its silence proves nothing until we read again.
    pub(crate) fn on_timeout(&mut self, now: u64, paused: bool) -> Beat {
        if paused {
            self.last_read = now;
        }
        if now >= self.last_read + self.interval_ms * 2 {
            Beat::PeerDead
        } else if now >= self.last_write + self.interval_ms / 2 {
            Beat::Send
        } else {
            Beat::Idle
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beats_after_half_an_interval_and_gives_up_after_two() {
        assert!(Heartbeat::new(0, 0).is_none());
        let mut h = Heartbeat::new(10, 1_000).expect("on");
        assert_eq!(h.deadline(), 6_000);
        assert_eq!(h.on_timeout(5_999, false), Beat::Idle);
        assert_eq!(h.on_timeout(6_000, false), Beat::Send);
        h.written(6_000);
        h.read(15_000);
        assert_eq!(h.deadline(), 11_000);
        assert_eq!(h.on_timeout(35_000, false), Beat::PeerDead);
        // Paused reading: silence is not held against the peer.
        let mut h = Heartbeat::new(10, 0).expect("on");
        assert_eq!(h.on_timeout(50_000, true), Beat::Send);
    }
}
