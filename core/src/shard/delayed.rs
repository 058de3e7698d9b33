//! Delayed and scheduled delivery (docs/delayed.md): `x-delayed-message` exchanges (the
//! community plugin's interface: `x-delayed-type`, `x-delay`), the `x-deliver-at` header
//! (a Warren extension, on any exchange) and the shard's schedule (`crate::schedule`), which
//! routes each message through its exchange when it is due.
//!
//! A scheduled publish is answered at once: its confirm waits only for the sync that makes
//! its schedule entry durable (persistent message, durable exchange). When due it is routed
//! as a publish without a publisher (nobody to confirm or return to), as the plugin does.

use super::mail::Mail;
use super::{Broker, OpResult};
use crate::command::{ExchangeDeclare, OpKind, Publish};
use crate::effect::Effect;
use crate::error::{ErrorCode, ProtocolError};
use crate::exchange::ExchangeKind;
use crate::ids::{ChannelRef, ExchangeId};
use crate::message::{FieldValue, Message, Properties};
use crate::schedule::{ExchangeName, Schedule, WINDOW_BYTES, WINDOW_ENTRIES};
use crate::store::ScheduledMessage;
use std::sync::Arc;

/// Whether this build schedules (cargo feature `delayed`, on by default, off in the wasm
/// builds). Off, every entry point below is skipped, so the optimizer drops the schedule.
pub(crate) const DELAYED: bool = cfg!(feature = "delayed");

/// The longest delay: the plugin's (Erlang's timer limit, 2^32 - 1 ms, ~49.7 days).
pub const MAX_DELAY_MS: u64 = u32::MAX as u64;

/// Scheduled messages a shard holds without a store (nothing to page them to): beyond it a
/// publish is refused as over an exchange's `x-max-scheduled`.
pub const MEMORY_SCHEDULE_LIMIT: u64 = 1_000_000;

/// Due messages routed per `tick`: a burst of due messages shares the shard with clients.
const DUE_PER_TICK: usize = 16_384;

/// The delay header of the plugin, and Warren's absolute one.
const X_DELAY: &str = "x-delay";
const X_DELIVER_AT: &str = "x-deliver-at";

/// When a publish is due, if it is to be scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Due {
    at: u64,
    /// The `x-delay` it came with (negated when routed, as the plugin does).
    delay: Option<i64>,
}

impl Broker {
    /// The schedule of a broker over `store` (what it holds already), or an empty one
    /// without a store (unbounded window: nothing to page to).
    pub(super) fn open_schedule(&mut self) {
        if !DELAYED {
            return;
        }
        self.open_schedule_with(WINDOW_ENTRIES, WINDOW_BYTES);
    }

    fn open_schedule_with(&mut self, entries: usize, bytes: u64) {
        self.schedule = match self.store.as_mut() {
            Some(store) => Schedule::recovered(entries, bytes, store.schedule_recover()),
            None => Schedule::default(),
        };
    }

    /// `x-delayed-type` of an `x-delayed-message` declare, checked as the plugin does:
    /// missing or not a string, or the delayed type itself: 406; an unknown type: 503 (as
    /// RabbitMQ's type check). Also checks Warren's own arguments.
    pub(super) fn delayed_kind(d: &ExchangeDeclare) -> Result<Option<ExchangeKind>, ProtocolError> {
        let op = OpKind::ExchangeDeclare;
        let refuse = |text: &str| Err(ProtocolError::new(ErrorCode::PreconditionFailed, op, text));
        let kind = match d
            .arguments
            .get("x-delayed-type")
            .and_then(FieldValue::as_str)
        {
            Some(crate::routing::DELAYED_TYPE) => {
                return refuse(
                    "Invalid argument, 'x-delayed-message' can't be used for 'x-delayed-type'",
                );
            }
            Some(t) => match ExchangeKind::parse(t) {
                Some(kind) => kind,
                None => {
                    return Err(ProtocolError::new(
                        ErrorCode::CommandInvalid,
                        op,
                        format!("invalid exchange type '{t}'"),
                    ));
                }
            },
            None => {
                return refuse(
                    "Invalid argument, 'x-delayed-type' must be an existing exchange type",
                );
            }
        };
        if let Some(v) = d.arguments.get("x-max-scheduled")
            && v.as_i64().is_none_or(|n| n < 0)
        {
            return refuse("Invalid argument, 'x-max-scheduled' must be a non-negative integer");
        }
        if let Some(v) = d.arguments.get("x-overflow")
            && v.as_str() != Some("reject-publish")
        {
            return refuse(
                "Invalid argument, 'x-overflow' of a delayed exchange must be 'reject-publish'",
            );
        }
        Ok(Some(kind))
    }

    /// When a publish to `exchange` with `props` is due, if later than now: `x-deliver-at`
    /// (any exchange), else `x-delay` on a delayed exchange. Refused (the text of a 406):
    /// a delay that is not an integer, or beyond `MAX_DELAY_MS`.
    pub(super) fn due_of(
        &self,
        exchange: ExchangeId,
        props: &Properties,
    ) -> Result<Option<Due>, String> {
        let Some(headers) = props.headers.as_ref() else {
            return Ok(None);
        };
        if let Some(v) = headers.get(X_DELIVER_AT) {
            let at = match v {
                // AMQP timestamps are seconds.
                FieldValue::Timestamp(s) => s.checked_mul(1000),
                v => integer(v).and_then(|n| u64::try_from(n).ok()),
            }
            .ok_or_else(|| format!("'{X_DELIVER_AT}' must be milliseconds since the Unix epoch"))?;
            if at > self.now.saturating_add(MAX_DELAY_MS) {
                return Err(format!(
                    "'{X_DELIVER_AT}' is more than {MAX_DELAY_MS} ms ahead"
                ));
            }
            return Ok((at > self.now).then_some(Due { at, delay: None }));
        }
        if self.topo.routes().delayed(exchange).is_none() {
            return Ok(None);
        }
        let Some(v) = headers.get(X_DELAY) else {
            return Ok(None);
        };
        let delay =
            integer(v).ok_or_else(|| format!("'{X_DELAY}' must be an integer (milliseconds)"))?;
        if delay > MAX_DELAY_MS as i64 {
            return Err(format!("'{X_DELAY}' must be at most {MAX_DELAY_MS} ms"));
        }
        // Zero or negative: at once, as the plugin does.
        Ok((delay > 0).then(|| Due {
            at: self.now.saturating_add(delay as u64),
            delay: Some(delay),
        }))
    }

    /// The channel side's checks of a publish that will be scheduled: its delay (406) and
    /// its exchange's `x-max-scheduled` unless it rejects publishes over it instead.
    pub(super) fn check_delay(&self, exchange: ExchangeId, p: &Publish) -> OpResult {
        if !DELAYED {
            return Ok(());
        }
        let op = OpKind::Publish;
        let due = self
            .due_of(exchange, &p.properties)
            .map_err(|text| ProtocolError::new(ErrorCode::PreconditionFailed, op, text))?;
        if due.is_some()
            && let Some(facts) = self.topo.routes().delayed(exchange)
            && !facts.reject_publish
            && self.over_limit(
                &self.exchange_name(exchange, &p.exchange),
                facts.max_scheduled,
            )
        {
            return Err(ProtocolError::new(
                ErrorCode::PreconditionFailed,
                op,
                format!(
                    "exchange '{}' has {} messages scheduled, its 'x-max-scheduled'",
                    p.exchange,
                    self.schedule
                        .count(&self.exchange_name(exchange, &p.exchange))
                ),
            ));
        }
        Ok(())
    }

    fn exchange_name(&self, exchange: ExchangeId, name: &str) -> ExchangeName {
        let vhost = self
            .topo
            .routes()
            .exchange_facts(exchange)
            .map_or(self.topo.default_vhost, |(v, _)| v);
        (Arc::from(self.vhost_name(vhost)), Arc::from(name))
    }

    /// Whether one more message scheduled on exchange `name` is over its limit `max` (or
    /// the shard's, without a store).
    fn over_limit(&self, name: &ExchangeName, max: Option<u64>) -> bool {
        max.is_some_and(|max| self.schedule.count(name) >= max)
            || (self.store.is_none() && self.schedule.len() >= MEMORY_SCHEDULE_LIMIT)
    }

    /// Schedules publish `p` of channel `ch` to `exchange`, due at `due`: stored, in the
    /// window if early enough, answered (the confirm waits for the sync when it is durable).
    /// A mandatory publish is returned at once, as the plugin does (routing happens later).
    pub(super) fn schedule_publish(
        &mut self,
        ch: ChannelRef,
        exchange: ExchangeId,
        p: Box<Publish>,
        due: Due,
    ) {
        let p = *p;
        let name = (
            self.exchange_name(exchange, &p.exchange).0,
            p.exchange.clone(),
        );
        let facts = self.topo.routes().delayed(exchange);
        // Another exchange (`x-deliver-at`): a transient one is gone after a restart, and its
        // messages with it when due (routed by name), so persistence alone decides.
        let durable_exchange = facts.is_none_or(|f| f.durable);
        let mut properties = p.properties;
        if let (Some(delay), Some(h)) = (due.delay, properties.headers.as_mut()) {
            // As the plugin does: routed with the delay negated, so a second delayed
            // exchange on the way does not delay it again, and consumers see it was delayed.
            h.insert(X_DELAY.to_string(), FieldValue::I64(-delay));
        }
        let durable = durable_exchange && properties.is_persistent();
        let message = Arc::new(Message {
            exchange: p.exchange,
            routing_key: p.routing_key,
            properties,
            body: p.body,
        });
        let seq = self.chans.channels.get_mut(&ch).and_then(|c| {
            c.stats.publish += 1;
            let seq = c.next_publish_seq();
            if let Some(seq) = seq {
                c.expect_answers(seq, 1);
            }
            seq
        });
        if p.mandatory {
            self.effects.push(Effect::Return {
                ch,
                reply_code: ErrorCode::NoRoute.code(),
                reply_text: "NO_ROUTE",
                message: message.clone(),
            });
        }
        let limited = facts.is_some_and(|f| f.reject_publish)
            && self.over_limit(&name, facts.and_then(|f| f.max_scheduled));
        let m = ScheduledMessage {
            key: self.schedule.key(due.at),
            vhost: name.0,
            exchange: name.1,
            message,
            durable,
        };
        let taken = !limited
            && match self.store.as_mut() {
                Some(store) => match store.schedule_add(&m) {
                    Ok(()) => true,
                    Err(_) => {
                        self.store_failed_at = Some(self.now);
                        false
                    }
                },
                // Without a store the shard's own limit bounds memory.
                None => self.schedule.len() < MEMORY_SCHEDULE_LIMIT,
            };
        if taken {
            if self.store.is_some() {
                // Every schedule write rides on a sync (a transient one too: its confirm
                // does not wait for it, but the store's buffer of changes stays bounded).
                self.sync_dirty = true;
            }
            self.schedule.insert(m);
        }
        if let Some(seq) = seq {
            self.answer(ch, seq, taken, durable && self.store.is_some());
            self.send_confirms(ch);
        }
    }

    /// Routes the messages due now (at most `DUE_PER_TICK`; `next_deadline` comes back at
    /// once for the rest), paging the window in from the store as it drains.
    pub(super) fn route_due(&mut self) {
        let mut due = Vec::new();
        loop {
            if let Some((after, max)) = self.schedule.refill_request()
                && let Some(store) = self.store.as_mut()
            {
                let mut read = Vec::new();
                match store.schedule_read(Some(after), max, &mut read) {
                    Ok(()) => self.schedule.refilled(read, max),
                    Err(_) => {
                        // Tried again after the store's retry pause (`next_deadline`).
                        self.store_failed_at = Some(self.now);
                        break;
                    }
                }
            }
            let before = due.len();
            let room = DUE_PER_TICK - due.len();
            self.schedule.take_due(self.now, room, &mut due);
            if due.len() == before || due.len() >= DUE_PER_TICK {
                break;
            }
        }
        for m in due {
            self.route_scheduled(&m);
            if let Some(store) = self.store.as_mut() {
                store.schedule_remove(m.key);
            }
        }
        if self.store.is_some() {
            self.note_removal();
        }
    }

    /// Routes one due message through its exchange (by name: gone, it is dropped) as a
    /// publish without a publisher.
    fn route_scheduled(&mut self, m: &ScheduledMessage) {
        let routes = self.topo.routes();
        let Some(exchange) = routes
            .vhost(&m.vhost)
            .and_then(|vh| routes.exchange(vh, &m.exchange))
        else {
            self.scheduled_dropped += 1;
            return;
        };
        let queues = routes.route(
            exchange,
            &m.message.routing_key,
            m.message.properties.headers.as_ref(),
        );
        if queues.is_empty() {
            self.scheduled_dropped += 1;
        }
        self.scheduled_routed += 1;
        for queue in queues {
            self.mail.push_back(Mail::Enqueue {
                queue,
                message: m.message.clone(),
                publisher: None,
            });
        }
    }

    /// When the schedule wants the next `tick`: its earliest due time, or after the store's
    /// retry pause when paging failed.
    pub(super) fn schedule_deadline(&self) -> Option<u64> {
        let at = self.schedule.next_due()?;
        match self.store_failed_at {
            Some(failed) if self.schedule.in_window() == 0 => {
                Some(failed.saturating_add(super::STORE_RETRY_MS))
            }
            _ => Some(at),
        }
    }

    /// Bounds the schedule's window (entries, body bytes) for a broker with a store: the
    /// rest stays in the store. Call it before the first publish (tests use small ones).
    pub fn set_schedule_window(&mut self, entries: usize, bytes: u64) {
        if self.store.is_some() && self.schedule.len() == 0 {
            self.open_schedule_with(entries, bytes);
        }
    }

    /// Scheduled messages on this shard: in all, and those in memory.
    pub fn scheduled_counts(&self) -> (u64, usize) {
        (self.schedule.len(), self.schedule.in_window())
    }

    /// Per (vhost, exchange): messages scheduled on this shard, and the earliest due time
    /// in memory (`None`: all paged out).
    pub fn list_scheduled(&self) -> Vec<(String, String, u64, Option<u64>)> {
        if !DELAYED {
            return Vec::new();
        }
        self.schedule
            .summary()
            .into_iter()
            .map(|((v, x), n, next)| (v.to_string(), x.to_string(), n, next))
            .collect()
    }

    /// Drops every message scheduled on exchange `exchange` of `vhost` on this shard;
    /// returns how many.
    pub fn purge_scheduled(&mut self, vhost: &str, exchange: &str) -> u64 {
        if !DELAYED {
            return 0;
        }
        let name = (Arc::from(vhost), Arc::from(exchange));
        let n = self.schedule.purge(&name);
        if let Some(store) = self.store.as_mut() {
            store.schedule_purge(vhost, exchange);
            self.note_removal();
        }
        n
    }
}

/// An `x-delay` as the plugin reads it: integer types as they are, floats truncated,
/// strings parsed as integers; anything else is no integer.
fn integer(v: &FieldValue) -> Option<i64> {
    match v {
        FieldValue::F32(f) => float(f64::from(*f)),
        FieldValue::F64(f) => float(*f),
        FieldValue::ShortString(_) | FieldValue::LongString(_) => {
            v.as_str().and_then(|s| s.trim().parse::<i64>().ok())
        }
        FieldValue::Timestamp(_) => None,
        v => v.as_i64(),
    }
}

fn float(f: f64) -> Option<i64> {
    (f.is_finite() && f.abs() < 9.0e18).then(|| f.trunc() as i64)
}
