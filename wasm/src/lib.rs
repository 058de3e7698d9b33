//! `warren-wasm`: the broker core for JavaScript hosts (browsers, Node) via wasm-bindgen.
//!
//! One `Broker` object is one in-process broker with one core connection. Channel 1 carries
//! declarations, publishes and `get`; every consumer gets a channel of its own, so an error on
//! one subscription (say, acking an unknown tag) cannot cancel the others. Time comes from the
//! host (`setTime`), never from a clock.
//!
//! Callbacks run after the core call that produced their deliveries has returned (a queue of
//! pending deliveries, drained outside any borrow), so a callback may call back into the
//! broker (ack, publish) without re-entrancy errors, and deliveries reach callbacks in the
//! order the core produced them.
//!
//! MQTT-style publish and subscribe map topics onto `amq.topic`; retained messages are the
//! core's (`Op::Retain`, `Op::RetainedGet`), as for the native MQTT gateway.

mod convert;
pub mod idb_store;
mod mqtt;
mod persist;
pub mod record;

use convert::{err, get_bool, get_uint};
use js_sys::{Function, Object};
use std::cell::RefCell;
use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use warren_core::command::{Bind, Consume, ExchangeDeclare, Op, Publish, QueueDeclare};
use warren_core::effect::{Effect, Reply};
use warren_core::ids::{ChannelRef, ConnId};
use warren_core::message::FieldTable;
use warren_core::mqtt::RetainedMessage;
use warren_core::{Broker as Core, BrokerConfig};
use wasm_bindgen::prelude::*;

#[wasm_bindgen(typescript_custom_section)]
const TS_TYPES: &'static str = r#"
/** Header and argument values: strings, numbers, booleans, null, bytes, arrays, objects. */
export type FieldValue = string | number | boolean | null | Uint8Array | FieldValue[] | { [key: string]: FieldValue };
export interface ExchangeOptions { durable?: boolean; autoDelete?: boolean; internal?: boolean; arguments?: Record<string, FieldValue>; }
export interface QueueOptions { durable?: boolean; exclusive?: boolean; autoDelete?: boolean; arguments?: Record<string, FieldValue>; }
export interface PublishOptions {
  headers?: Record<string, FieldValue>; contentType?: string; contentEncoding?: string;
  persistent?: boolean; deliveryMode?: number; priority?: number; correlationId?: string;
  replyTo?: string; expiration?: string; messageId?: string; timestamp?: number; type?: string;
  userId?: string; appId?: string;
}
export interface ConsumeOptions { noAck?: boolean; prefetch?: number; exclusive?: boolean; }
export interface Properties extends Omit<PublishOptions, "persistent"> {}
export interface Message {
  exchange: string; routingKey: string; body: Uint8Array; properties: Properties;
  /** Absent for no-ack deliveries' bookkeeping only: pass the message to ack/nack/reject. */
  deliveryTag: number; channel: number; redelivered: boolean; consumerTag?: string;
  /** MQTT-style subscriptions only. */
  topic?: string; payload?: Uint8Array;
  /** MQTT-style: a retained message, sent because the subscription is new. */
  retain?: boolean;
}
"#;

#[wasm_bindgen(inline_js = r#"
export function makeIterator(cancel) {
  const ready = [], waiters = [];
  let done = false;
  const finish = () => {
    if (!done) { done = true; cancel(); }
    for (const w of waiters.splice(0)) w({ value: undefined, done: true });
    return Promise.resolve({ value: undefined, done: true });
  };
  const iter = {
    next() {
      if (ready.length) return Promise.resolve({ value: ready.shift(), done: false });
      if (done) return Promise.resolve({ value: undefined, done: true });
      return new Promise((resolve) => waiters.push(resolve));
    },
    return: finish,
    [Symbol.asyncIterator]() { return this; },
  };
  const push = (m) => {
    if (done) return;
    if (waiters.length) waiters.shift()({ value: m, done: false }); else ready.push(m);
  };
  return [push, iter];
}
"#)]
extern "C" {
    #[wasm_bindgen(js_name = makeIterator)]
    fn make_iterator(cancel: &JsValue) -> js_sys::Array;
}

/// The single core connection of a JS broker.
const CONN: ConnId = ConnId(1);
/// Declarations, publishes and `get` run on this channel.
const CONTROL: u16 = 1;
/// Retained messages one `mqttSubscribe` gets at most (as the MQTT gateway's default).
const MAX_RETAINED_PER_SUBSCRIBE: u32 = 10_000;

struct Subscription {
    channel: u16,
    callback: Function,
    /// MQTT-style: the server-named queue to delete on unsubscribe; deliveries carry `topic`.
    mqtt_queue: Option<String>,
}

struct Inner {
    core: Core,
    now: u64,
    subs: BTreeMap<String, Subscription>,
    free_channels: Vec<u16>,
    next_channel: u16,
    next_tag: u64,
    /// Deliveries waiting for their callbacks, in core order.
    pending: VecDeque<(Function, JsValue)>,
    dispatching: bool,
    /// A mandatory publish came back unrouted during the last `exec`.
    returned: bool,
    /// `Broker.open({ persist })`: the IndexedDB store's side (`persist.js` drives it).
    persist: Option<Persist>,
}

/// A persistent broker's bookkeeping: the control channel is in confirm mode, and its
/// confirms wait for the sync of the store's batch (IndexedDB's transaction).
struct Persist {
    shared: idb_store::SharedRef,
    /// `hook([epoch, batch])` writes a sealed batch (called outside any borrow).
    hook: Function,
    /// The confirm sequence number of the last publish on the control channel (the core's:
    /// from 1 again after a reset).
    seq: u64,
    /// Publishes on the control channel before its last reset: `base + seq` numbers every
    /// publish of the broker's life once, as JS knows them.
    base: u64,
    /// Confirms not yet taken by JS: id (ack), -id (nack); `0, base` means the channel was
    /// reset and the confirms of the publishes up to `base` will not come.
    confirms: Vec<f64>,
}

type Res<T> = Result<T, JsValue>;

impl Inner {
    fn ch(channel: u16) -> ChannelRef {
        ChannelRef::new(CONN, channel)
    }

    /// Applies `op` on `channel`, pumps effects until quiet, and returns that channel's
    /// replies, or the channel's error text (the channel is recovered before returning).
    fn exec(&mut self, channel: u16, op: Op) -> Result<Vec<Reply>, String> {
        self.returned = false;
        self.core.handle(self.now, Self::ch(channel), op);
        self.pump(channel)
    }

    /// Drains effects until the core is quiet: queues deliveries for their callbacks,
    /// returns `channel`'s replies or its error.
    fn pump(&mut self, channel: u16) -> Result<Vec<Reply>, String> {
        let mut replies = Vec::new();
        let mut error = None;
        let mut effects = Vec::new();
        loop {
            self.core.poll_effects(&mut effects);
            if effects.is_empty() {
                break;
            }
            let mut delivered = 0u32;
            for e in effects.drain(..) {
                match e {
                    Effect::Reply { ch, reply } if ch.channel == channel => replies.push(reply),
                    Effect::Deliver {
                        ch,
                        consumer_tag,
                        delivery,
                    } => {
                        delivered += 1;
                        if let Some(sub) = self.subs.get(&*consumer_tag) {
                            let topic = sub
                                .mqtt_queue
                                .as_ref()
                                .map(|_| mqtt::key_to_name(&delivery.message.routing_key));
                            let msg = convert::message_to_js(
                                &delivery.message,
                                Some((&delivery, ch.channel)),
                                Some(&consumer_tag),
                                topic,
                            );
                            self.pending.push_back((sub.callback.clone(), msg));
                        }
                    }
                    Effect::Return { .. } => self.returned = true,
                    Effect::Confirm { ch, seq, ack, .. } if ch.channel == CONTROL => {
                        if let Some(p) = &mut self.persist {
                            let id = (p.base + seq) as f64;
                            p.confirms.push(if ack { id } else { -id });
                        }
                    }
                    Effect::ConsumerCancelled { consumer_tag, .. } => {
                        self.forget(&consumer_tag);
                    }
                    Effect::ChannelError { ch, error: e } => {
                        if ch.channel == channel {
                            error = Some(e.text);
                        }
                        self.recover_channel(ch.channel);
                    }
                    Effect::ConnectionError { error: e, .. } => {
                        error = Some(e.text);
                        self.reconnect();
                    }
                    // Replies to other channels' recoveries; memory alarm and flow control
                    // (advisory: an in-process publisher cannot be paused).
                    _ => {}
                }
            }
            if delivered > 0 {
                // Handed to the dispatch queue: they leave the core's write window.
                self.core
                    .handle(self.now, Self::ch(0), Op::Written { count: delivered });
            }
        }
        self.start_sync();
        error.map_or(Ok(replies), Err)
    }

    /// Persistent brokers: every change rides on the next sync (group commit: one
    /// IndexedDB transaction in flight, the changes made meanwhile in the next), so acks and
    /// deletes are kept as soon as publishes are; a sealed batch goes to the JS hook.
    fn start_sync(&mut self) {
        let Some(p) = &self.persist else { return };
        let shared = idb_store::lock(&p.shared);
        if shared.paused {
            return;
        }
        if shared.has_pending() {
            self.core.request_sync();
        }
        drop(shared);
        if self.core.start_sync().is_none() {
            return;
        }
        if let Some((epoch, batch)) = idb_store::lock(&p.shared).take_sealed() {
            let args = js_sys::Array::of2(
                &JsValue::from_f64(epoch as f64),
                &js_sys::Uint8Array::from(&batch[..]),
            );
            self.pending.push_back((p.hook.clone(), args.into()));
        }
    }

    fn run(&mut self, channel: u16, op: Op) -> Res<Vec<Reply>> {
        self.exec(channel, op).map_err(err)
    }

    /// After a channel error: acknowledge the close; the control channel is reopened,
    /// a consumer channel goes back to the pool (the core cancelled its consumer).
    fn recover_channel(&mut self, channel: u16) {
        self.core
            .handle(self.now, Self::ch(channel), Op::ChannelCloseOk);
        let gone: Vec<String> = self
            .subs
            .iter()
            .filter(|(_, s)| s.channel == channel)
            .map(|(t, _)| t.clone())
            .collect();
        for tag in gone {
            self.subs.remove(&tag);
        }
        if channel == CONTROL {
            self.core
                .handle(self.now, Self::ch(CONTROL), Op::ChannelOpen);
            self.confirm_mode();
        } else {
            self.free_channels.push(channel);
        }
    }

    /// After a connection error (a bug in this API if it ever happens): start afresh.
    fn reconnect(&mut self) {
        self.subs.clear();
        self.free_channels.clear();
        self.next_channel = CONTROL + 1;
        self.open();
    }

    fn open(&mut self) {
        self.core.handle(
            self.now,
            Self::ch(0),
            Op::ConnectionOpen {
                vhost: "/".into(),
                user: "guest".into(),
                cancel_notify: true,
            },
        );
        self.core
            .handle(self.now, Self::ch(CONTROL), Op::ChannelOpen);
        self.confirm_mode();
    }

    /// Persistent brokers publish on the control channel in confirm mode; a (re)opened
    /// channel starts counting again, and the confirms of the old one will not come.
    fn confirm_mode(&mut self) {
        if let Some(p) = &mut self.persist {
            p.base += p.seq;
            p.seq = 0;
            p.confirms.extend([0.0, p.base as f64]);
            self.core.handle(
                self.now,
                Self::ch(CONTROL),
                Op::ConfirmSelect { nowait: true },
            );
        }
    }

    /// Drops a subscription and closes its channel (requeueing what it left unacked). The
    /// caller pumps the effects: inside `exec`'s loop, or through `run`.
    fn forget(&mut self, tag: &str) -> Option<u16> {
        let sub = self.subs.remove(tag)?;
        self.core
            .handle(self.now, Self::ch(sub.channel), Op::ChannelClose);
        self.free_channels.push(sub.channel);
        Some(sub.channel)
    }

    fn channel(&mut self) -> Res<u16> {
        if let Some(c) = self.free_channels.pop() {
            self.run(c, Op::ChannelOpen)?;
            return Ok(c);
        }
        let c = self.next_channel;
        self.next_channel = c
            .checked_add(1)
            .ok_or_else(|| err("too many consumers (65534)"))?;
        self.run(c, Op::ChannelOpen)?;
        Ok(c)
    }

    fn consume(
        &mut self,
        queue: &str,
        callback: Function,
        options: &JsValue,
        mqtt_queue: Option<String>,
    ) -> Res<String> {
        let channel = self.channel()?;
        if let Some(prefetch) = get_uint(options, "prefetch", u64::from(u16::MAX))? {
            self.run(
                channel,
                Op::Qos {
                    prefetch_size: 0,
                    prefetch_count: prefetch as u16,
                    global: false,
                },
            )?;
        }
        self.next_tag += 1;
        let tag = format!("js.ctag-{}", self.next_tag);
        // Registered before consuming: the first deliveries come with the consume-ok.
        self.subs.insert(
            tag.clone(),
            Subscription {
                channel,
                callback,
                mqtt_queue,
            },
        );
        let op = Op::Consume(Consume {
            queue: queue.into(),
            consumer_tag: tag.clone(),
            no_local: false,
            no_ack: get_bool(options, "noAck"),
            exclusive: get_bool(options, "exclusive"),
            nowait: false,
            arguments: FieldTable::new(),
        });
        // On error, recover_channel has already dropped the subscription and freed the channel.
        self.run(channel, op)?;
        Ok(tag)
    }

    fn cancel(&mut self, tag: &str) -> Res<()> {
        let channel = match self.subs.get(tag) {
            Some(s) => s.channel,
            None => return Err(err(format!("no consumer '{tag}'"))),
        };
        self.run(
            channel,
            Op::Cancel {
                consumer_tag: tag.into(),
                nowait: false,
            },
        )?;
        if self.forget(tag).is_some() {
            // Deliver what closing the channel caused (requeues to other consumers).
            self.pump(channel).map_err(err)?;
        }
        Ok(())
    }

    fn publish(
        &mut self,
        exchange: &str,
        key: &str,
        body: &JsValue,
        options: &JsValue,
    ) -> Res<bool> {
        let op = Op::Publish(Box::new(Publish {
            exchange: Arc::from(exchange),
            routing_key: Arc::from(key),
            // Always mandatory: the answer (routed or not) is publish's return value.
            mandatory: true,
            immediate: false,
            properties: convert::properties_from_js(options)?,
            body: convert::body_bytes(body)?,
            routed: None,
        }));
        if let Some(p) = &mut self.persist {
            p.seq += 1;
        }
        self.run(CONTROL, op)?;
        Ok(!self.returned)
    }

    /// Makes `payload` the retained message of `topic` (empty: clears it).
    fn retain(&mut self, topic: &str, payload: &JsValue) -> Res<()> {
        let op = Op::Retain {
            message: Box::new(RetainedMessage {
                topic: Arc::from(topic),
                qos: 0,
                payload: convert::body_bytes(payload)?,
                properties: Default::default(),
                stored_at: self.now,
                expiry_ms: None,
            }),
            durable: true,
        };
        let stored = self
            .run(CONTROL, op)?
            .into_iter()
            .any(|r| matches!(r, Reply::RetainOk { stored: true }));
        if stored {
            Ok(())
        } else {
            Err(err(
                "too many retained messages (max_retained_messages/bytes)",
            ))
        }
    }

    fn settle(&mut self, message: &JsValue, op: impl FnOnce(u64) -> Op) -> Res<()> {
        let channel = get_uint(message, "channel", u64::from(u16::MAX))?
            .ok_or_else(|| err("not a delivered message (no channel)"))?;
        let tag = get_uint(message, "deliveryTag", 1 << 53)?
            .ok_or_else(|| err("not a delivered message (no deliveryTag)"))?;
        self.run(channel as u16, op(tag)).map(|_| ())
    }
}

/// An in-process message broker: the Warren core compiled to WebAssembly.
#[wasm_bindgen]
pub struct Broker {
    inner: Rc<RefCell<Inner>>,
}

/// Runs queued deliveries through their callbacks, outside any borrow of the state. The
/// first exception a callback throws is rethrown after all deliveries ran.
fn dispatch(inner: &Rc<RefCell<Inner>>) -> Res<()> {
    {
        let mut i = inner.borrow_mut();
        if i.dispatching {
            // A callback called back in: the outer loop delivers in order.
            return Ok(());
        }
        i.dispatching = true;
    }
    let mut first_error = None;
    loop {
        let next = inner.borrow_mut().pending.pop_front();
        let Some((callback, msg)) = next else { break };
        if let Err(e) = callback.call1(&JsValue::NULL, &msg) {
            first_error.get_or_insert(e);
        }
    }
    inner.borrow_mut().dispatching = false;
    first_error.map_or(Ok(()), Err)
}

impl Broker {
    /// Runs `f` on the state, then the callbacks it queued.
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> Res<T>) -> Res<T> {
        let r = f(&mut self.inner.borrow_mut());
        dispatch(&self.inner)?;
        r
    }
}

/// An optional options object as a plain value (`undefined` when absent).
fn opt(o: Option<Object>) -> JsValue {
    o.map_or(JsValue::UNDEFINED, JsValue::from)
}

fn bind(destination: &str, source: &str, key: &str, args: &JsValue) -> Res<Bind> {
    Ok(Bind {
        destination: destination.into(),
        source: source.into(),
        routing_key: key.into(),
        nowait: false,
        arguments: convert::table_from_js(args, 0)?,
    })
}

#[wasm_bindgen]
impl Broker {
    /// A broker. `seed` seeds server-generated names (`amq.gen-…`), so runs are reproducible;
    /// `now` is the host's current time in milliseconds.
    #[wasm_bindgen(constructor)]
    pub fn new(seed: Option<f64>, now: Option<f64>) -> Broker {
        let config = BrokerConfig {
            seed: seed.map_or(BrokerConfig::default().seed, |s| s as u64),
            ..BrokerConfig::default()
        };
        let mut inner = Inner {
            core: Core::new(config),
            now: now.map_or(0, |n| n.max(0.0) as u64),
            subs: BTreeMap::new(),
            free_channels: Vec::new(),
            next_channel: CONTROL + 1,
            next_tag: 0,
            pending: VecDeque::new(),
            dispatching: false,
            returned: false,
            persist: None,
        };
        inner.open();
        let mut discard = Vec::new();
        inner.core.poll_effects(&mut discard);
        Broker {
            inner: Rc::new(RefCell::new(inner)),
        }
    }

    /// Advances the broker's clock (milliseconds; it never goes backwards).
    #[wasm_bindgen(js_name = setTime)]
    pub fn set_time(&self, now_ms: f64) -> Res<()> {
        self.with(|i| {
            i.now = i.now.max(now_ms.max(0.0) as u64);
            let now = i.now;
            i.core.tick(now);
            // Timers (TTL expiry, once the core has it) produce effects from `tick`.
            i.pump(CONTROL).map(|_| ()).map_err(err)
        })
    }

    /// The broker's clock in milliseconds.
    #[wasm_bindgen(getter)]
    pub fn now(&self) -> f64 {
        self.inner.borrow().now as f64
    }

    /// Declares an exchange: `direct`, `fanout`, `topic` or `headers`.
    #[wasm_bindgen(js_name = declareExchange)]
    pub fn declare_exchange(
        &self,
        name: &str,
        kind: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "ExchangeOptions")] options: Option<Object>,
    ) -> Res<()> {
        let options = opt(options);
        self.with(|i| {
            let op = Op::ExchangeDeclare(ExchangeDeclare {
                exchange: name.into(),
                kind: kind.into(),
                passive: false,
                durable: get_bool(&options, "durable"),
                auto_delete: get_bool(&options, "autoDelete"),
                internal: get_bool(&options, "internal"),
                nowait: false,
                arguments: convert::table_from_js(&convert::get(&options, "arguments"), 0)?,
            });
            i.run(CONTROL, op).map(|_| ())
        })
    }

    #[wasm_bindgen(js_name = deleteExchange)]
    pub fn delete_exchange(&self, name: &str) -> Res<()> {
        self.with(|i| {
            let op = Op::ExchangeDelete {
                exchange: name.into(),
                if_unused: false,
                nowait: false,
            };
            i.run(CONTROL, op).map(|_| ())
        })
    }

    /// Declares a queue and returns its name (server-generated when `name` is empty).
    #[wasm_bindgen(js_name = declareQueue)]
    pub fn declare_queue(
        &self,
        name: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "QueueOptions")] options: Option<Object>,
    ) -> Res<String> {
        let options = opt(options);
        self.with(|i| {
            let op = Op::QueueDeclare(QueueDeclare {
                queue: name.into(),
                passive: false,
                durable: get_bool(&options, "durable"),
                exclusive: get_bool(&options, "exclusive"),
                auto_delete: get_bool(&options, "autoDelete"),
                nowait: false,
                arguments: convert::table_from_js(&convert::get(&options, "arguments"), 0)?,
            });
            let replies = i.run(CONTROL, op)?;
            replies
                .into_iter()
                .find_map(|r| match r {
                    Reply::QueueDeclareOk { queue, .. } => Some(queue.to_string()),
                    _ => None,
                })
                .ok_or_else(|| err("no queue.declare-ok"))
        })
    }

    /// Deletes a queue; returns the number of messages it held.
    #[wasm_bindgen(js_name = deleteQueue)]
    pub fn delete_queue(&self, name: &str) -> Res<u32> {
        self.with(|i| {
            let op = Op::QueueDelete {
                queue: name.into(),
                if_unused: false,
                if_empty: false,
                nowait: false,
            };
            Ok(count(i.run(CONTROL, op)?))
        })
    }

    /// Drops a queue's ready messages; returns how many.
    #[wasm_bindgen(js_name = purgeQueue)]
    pub fn purge_queue(&self, name: &str) -> Res<u32> {
        self.with(|i| {
            let op = Op::QueuePurge {
                queue: name.into(),
                nowait: false,
            };
            Ok(count(i.run(CONTROL, op)?))
        })
    }

    #[wasm_bindgen(js_name = bindQueue)]
    pub fn bind_queue(
        &self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "Record<string, FieldValue>")] args: Option<
            Object,
        >,
    ) -> Res<()> {
        let args = opt(args);
        self.with(|i| {
            let op = Op::QueueBind(bind(queue, exchange, routing_key, &args)?);
            i.run(CONTROL, op).map(|_| ())
        })
    }

    #[wasm_bindgen(js_name = unbindQueue)]
    pub fn unbind_queue(
        &self,
        queue: &str,
        exchange: &str,
        routing_key: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "Record<string, FieldValue>")] args: Option<
            Object,
        >,
    ) -> Res<()> {
        let args = opt(args);
        self.with(|i| {
            let op = Op::QueueUnbind(bind(queue, exchange, routing_key, &args)?);
            i.run(CONTROL, op).map(|_| ())
        })
    }

    /// Exchange-to-exchange binding: messages routed by `source` flow on to `destination`.
    #[wasm_bindgen(js_name = bindExchange)]
    pub fn bind_exchange(
        &self,
        destination: &str,
        source: &str,
        routing_key: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "Record<string, FieldValue>")] args: Option<
            Object,
        >,
    ) -> Res<()> {
        let args = opt(args);
        self.with(|i| {
            let op = Op::ExchangeBind(bind(destination, source, routing_key, &args)?);
            i.run(CONTROL, op).map(|_| ())
        })
    }

    /// Publishes a message; returns whether it reached at least one queue.
    pub fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        #[wasm_bindgen(unchecked_param_type = "Uint8Array | string")] body: JsValue,
        #[wasm_bindgen(unchecked_optional_param_type = "PublishOptions")] options: Option<Object>,
    ) -> Res<bool> {
        let options = opt(options);
        self.with(|i| i.publish(exchange, routing_key, &body, &options))
    }

    /// Calls `callback(message)` for every message delivered from `queue`; returns the
    /// consumer tag (for `cancel`). Without `noAck`, settle each message with ack/nack/reject.
    pub fn consume(
        &self,
        queue: &str,
        #[wasm_bindgen(unchecked_param_type = "(message: Message) => void")] callback: Function,
        #[wasm_bindgen(unchecked_optional_param_type = "ConsumeOptions")] options: Option<Object>,
    ) -> Res<String> {
        let options = opt(options);
        self.with(|i| i.consume(queue, callback, &options, None))
    }

    /// The messages of `queue` as an async iterator (`for await (const m of ...)`); leaving
    /// the loop cancels the consumer.
    #[wasm_bindgen(unchecked_return_type = "AsyncIterableIterator<Message>")]
    pub fn messages(
        &self,
        queue: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "ConsumeOptions")] options: Option<Object>,
    ) -> Res<JsValue> {
        let options = opt(options);
        let tag: Rc<RefCell<Option<String>>> = Rc::default();
        let (weak, tag2) = (Rc::downgrade(&self.inner), tag.clone());
        let cancel = Closure::<dyn FnMut()>::new(move || {
            // The broker may be gone, or the consumer already cancelled by the core.
            if let (Some(inner), Some(tag)) = (weak.upgrade(), tag2.borrow_mut().take()) {
                let _ = inner.borrow_mut().cancel(&tag);
            }
        })
        .into_js_value();
        let pair = make_iterator(&cancel);
        let push: Function = pair.get(0).unchecked_into();
        let t = self.with(|i| i.consume(queue, push, &options, None))?;
        *tag.borrow_mut() = Some(t);
        Ok(pair.get(1))
    }

    pub fn cancel(&self, consumer_tag: &str) -> Res<()> {
        self.with(|i| i.cancel(consumer_tag))
    }

    /// Fetches one message (`basic.get`), or `undefined` when the queue is empty.
    #[wasm_bindgen(unchecked_return_type = "Message | undefined")]
    pub fn get(
        &self,
        queue: &str,
        #[wasm_bindgen(unchecked_optional_param_type = "{ noAck?: boolean }")] options: Option<
            Object,
        >,
    ) -> Res<JsValue> {
        let options = opt(options);
        self.with(|i| {
            let op = Op::Get {
                queue: queue.into(),
                no_ack: get_bool(&options, "noAck"),
            };
            for r in i.run(CONTROL, op)? {
                if let Reply::GetOk { delivery, .. } = r {
                    let m = &delivery.message;
                    return Ok(convert::message_to_js(
                        m,
                        Some((&delivery, CONTROL)),
                        None,
                        None,
                    ));
                }
            }
            Ok(JsValue::UNDEFINED)
        })
    }

    /// Acknowledges a delivered message (with `multiple`, every earlier one of its consumer
    /// channel too).
    pub fn ack(
        &self,
        #[wasm_bindgen(unchecked_param_type = "Message")] message: JsValue,
        multiple: Option<bool>,
    ) -> Res<()> {
        self.with(|i| {
            i.settle(&message, |delivery_tag| Op::Ack {
                delivery_tag,
                multiple: multiple.unwrap_or(false),
            })
        })
    }

    /// Negative acknowledgement; `requeue` (default true) puts it back in its queue.
    pub fn nack(
        &self,
        #[wasm_bindgen(unchecked_param_type = "Message")] message: JsValue,
        requeue: Option<bool>,
        multiple: Option<bool>,
    ) -> Res<()> {
        self.with(|i| {
            i.settle(&message, |delivery_tag| Op::Nack {
                delivery_tag,
                multiple: multiple.unwrap_or(false),
                requeue: requeue.unwrap_or(true),
            })
        })
    }

    /// Rejects one message; `requeue` (default true) puts it back in its queue.
    pub fn reject(
        &self,
        #[wasm_bindgen(unchecked_param_type = "Message")] message: JsValue,
        requeue: Option<bool>,
    ) -> Res<()> {
        self.with(|i| {
            i.settle(&message, |delivery_tag| Op::Reject {
                delivery_tag,
                requeue: requeue.unwrap_or(true),
            })
        })
    }

    /// Ready messages in a queue, or `undefined` when there is no such queue.
    #[wasm_bindgen(js_name = queueLength)]
    pub fn queue_length(&self, queue: &str) -> Option<u32> {
        let i = self.inner.borrow();
        i.core
            .queue_len(queue)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// MQTT-style publish on `amq.topic`: `a/b` is routing key `a.b`. Returns whether any
    /// subscription matched. With `retain`, the message also becomes the topic's retained
    /// message (an empty payload clears it), which later `mqttSubscribe`s get first.
    #[wasm_bindgen(js_name = mqttPublish)]
    pub fn mqtt_publish(
        &self,
        topic: &str,
        #[wasm_bindgen(unchecked_param_type = "Uint8Array | string")] payload: JsValue,
        #[wasm_bindgen(unchecked_optional_param_type = "{ retain?: boolean }")] options: Option<
            Object,
        >,
    ) -> Res<bool> {
        let options = opt(options);
        let key = mqtt::name_to_key(topic).map_err(|e| err(format!("topic '{topic}': {e}")))?;
        let retain = get_bool(&options, "retain");
        self.with(|i| {
            if retain {
                i.retain(topic, &payload)?;
            }
            i.publish("amq.topic", &key, &payload, &JsValue::UNDEFINED)
        })
    }

    /// MQTT-style subscription (`+` one level, `#` the rest): `callback(message)` gets
    /// messages with `topic` and `payload`, the matching retained messages first (with
    /// `retain: true`). Returns the id for `mqttUnsubscribe`.
    #[wasm_bindgen(js_name = mqttSubscribe)]
    pub fn mqtt_subscribe(
        &self,
        filter: &str,
        #[wasm_bindgen(unchecked_param_type = "(message: Message) => void")] callback: Function,
    ) -> Res<String> {
        let key =
            mqtt::filter_to_key(filter).map_err(|e| err(format!("filter '{filter}': {e}")))?;
        self.with(|i| {
            let op = Op::QueueDeclare(QueueDeclare {
                queue: String::new(),
                passive: false,
                durable: false,
                exclusive: true,
                auto_delete: true,
                nowait: false,
                arguments: FieldTable::new(),
            });
            let queue = i
                .run(CONTROL, op)?
                .into_iter()
                .find_map(|r| match r {
                    Reply::QueueDeclareOk { queue, .. } => Some(queue.to_string()),
                    _ => None,
                })
                .ok_or_else(|| err("no queue.declare-ok"))?;
            let op = Op::QueueBind(bind(&queue, "amq.topic", &key, &JsValue::UNDEFINED)?);
            i.run(CONTROL, op)?;
            let no_ack = Object::new();
            let _ = js_sys::Reflect::set(&no_ack, &"noAck".into(), &JsValue::TRUE);
            let id = i.consume(&queue, callback.clone(), &no_ack, Some(queue.clone()))?;
            // After the bind, as the MQTT gateway: a message published in between comes
            // twice rather than not at all.
            let op = Op::RetainedGet {
                filter: filter.to_string(),
                max: MAX_RETAINED_PER_SUBSCRIBE,
            };
            for reply in i.run(CONTROL, op)? {
                let Reply::Retained { messages } = reply else {
                    continue;
                };
                for m in messages {
                    let message = warren_core::message::Message {
                        exchange: Arc::from("amq.topic"),
                        routing_key: Arc::from(warren_core::mqtt::topic_to_amqp_key(&m.topic)),
                        properties: m.properties,
                        body: m.payload,
                    };
                    let js =
                        convert::message_to_js(&message, None, None, Some(m.topic.to_string()));
                    let _ = js_sys::Reflect::set(&js, &"retain".into(), &JsValue::TRUE);
                    i.pending.push_back((callback.clone(), js));
                }
            }
            Ok(id)
        })
    }

    #[wasm_bindgen(js_name = mqttUnsubscribe)]
    pub fn mqtt_unsubscribe(&self, id: &str) -> Res<()> {
        self.with(|i| {
            let queue = i
                .subs
                .get(id)
                .and_then(|s| s.mqtt_queue.clone())
                .ok_or_else(|| err(format!("no MQTT subscription '{id}'")))?;
            i.cancel(id)?;
            let op = Op::QueueDelete {
                queue,
                if_unused: false,
                if_empty: false,
                nowait: false,
            };
            i.run(CONTROL, op).map(|_| ())
        })
    }
}

fn count(replies: Vec<Reply>) -> u32 {
    replies
        .into_iter()
        .find_map(|r| match r {
            Reply::QueuePurgeOk { message_count } | Reply::QueueDeleteOk { message_count } => {
                Some(message_count)
            }
            _ => None,
        })
        .unwrap_or(0)
}
