// The tab link: the broker in the page bridged to a server Warren over MQTT 5 on WebSocket
// (docs/javascript.md, "Bridged to a server"). Pure JavaScript: a hand-written QoS 1 client
// (mqtt5.js) driven by the local broker's own consume/ack/publish, so the .wasm does not grow.
//
//   import { Broker } from "warren-broker";
//   import "warren-broker/link";               // adds broker.connect(options)
//   const link = broker.connect({ url, username, password, forward: [...], subscribe: [...] });
//
// Forward rules consume a local queue with a prefetch equal to the in-flight window and ack
// each message only on the server's PUBACK; the inbox PUBACKs a server message only after
// the local publish resolved. At least once, in order per rule; duplicates carry the same
// `warren-link-id` user property, which the server drops within its window.

import { Broker } from "./dist/warren_wasm.js";
import * as mqtt from "./mqtt5.js";

/** The MQTT 5 user property carrying a forwarded message's id (the server dedups on it). */
export const LINK_ID_PROPERTY = "warren-link-id";
/** The local header a message from the server carries its MQTT topic in. */
export const TOPIC_HEADER = "x-link-topic";

/** An error the link reports (`link.on("error", ...)`); `code` says what the app can do. */
export class LinkError extends Error {
  constructor(code, message, details = {}) {
    super(message);
    this.name = "LinkError";
    this.code = code;
    Object.assign(this, details);
  }
}

const DEFAULTS = {
  keepAlive: 30,
  inflight: 256,
  sessionExpiry: 7 * 24 * 3600,
  maxPacketSize: 1 << 20,
  connectTimeout: 10_000,
  reconnect: { min: 250, max: 30_000 },
};

// A random id for this link object: derived message ids are `<linkId>-<counter>`, unique per
// page load; they survive a reconnect (the same message is resent under the same id) but not
// a reload or a crash (docs: "not crash-stable").
function randomId() {
  const b = new Uint8Array(8);
  globalThis.crypto.getRandomValues(b);
  return Array.from(b, (x) => x.toString(16).padStart(2, "0")).join("");
}

class Rule {
  constructor(spec) {
    this.queue = spec.queue;
    this.topic = spec.topic;
    this.maxPending = spec.maxPending;
    this.maxPendingBytes = spec.maxPendingBytes;
    this.tag = null;
    /** Deliveries sent and not yet PUBACKed, in send order: `{ m, pid, done }`. */
    this.sent = [];
    /** Deliveries taken from the local queue but held back (window full or draining). */
    this.held = [];
    /** Ids given to messages without a `messageId`, oldest first, while unacked: the
     * broker requeues those messages in order on a cancel, and they are resent under the
     * same ids when they come back (redelivered). */
    this.derived = [];
    this.reuse = [];
    /** Refused by the server (PUBACK >= 0x80): paused until the next connection. */
    this.paused = false;
  }
}

export class Link {
  /** @param {Broker} broker */
  constructor(broker, options) {
    if (!options || typeof options.url !== "string") throw new TypeError("connect: url is required");
    const WS = options.WebSocket ?? globalThis.WebSocket;
    if (typeof WS !== "function") {
      throw new TypeError("connect: no WebSocket (pass options.WebSocket, e.g. the `ws` package under Node)");
    }
    this.broker = broker;
    this.WS = WS;
    this.url = options.url;
    this.username = options.username;
    this.password = options.token ?? options.password;
    this.keepAlive = options.keepAlive ?? DEFAULTS.keepAlive;
    this.window = Math.max(1, Math.min(options.inflight ?? DEFAULTS.inflight, 65535));
    this.sessionExpiry = options.sessionExpiry ?? DEFAULTS.sessionExpiry;
    this.maxPacketSize = options.maxPacketSize ?? DEFAULTS.maxPacketSize;
    this.connectTimeout = options.connectTimeout ?? DEFAULTS.connectTimeout;
    this.backoff = { ...DEFAULTS.reconnect, ...(options.reconnect ?? {}) };
    this.linkId = options.linkId ?? randomId();
    this.clientId = options.clientId ?? `warren-link-${broker.name ?? "tab"}`;
    this.forward = (options.forward ?? []).map((f) => new Rule(f));
    this.subscribe = (options.subscribe ?? []).map((s) => ({ topic: s.topic, queue: s.queue }));
    this.listeners = { state: new Set(), error: new Set() };
    this.state = "down";
    this.closed = false;
    this.attempt = 0;
    this.counter = 0;
    this.stats = { forwarded: 0, received: 0, reconnects: 0 };
    this.sock = null;
    this.out = null;
    this.flushQueued = false;
    this.pidNext = 1;
    this.byPid = new Map();
    this.draining = false;
    this.timers = new Set();
    this.declareLocal();
    // After the caller's on("state") calls: they see the first "connecting".
    queueMicrotask(() => this.open());
  }

  /** Forwarded messages sent and not yet acknowledged by the server. */
  get inflight() {
    let n = 0;
    for (const r of this.forward) n += r.sent.length;
    return n;
  }

  on(event, fn) {
    this.listeners[event]?.add(fn);
    return this;
  }

  off(event, fn) {
    this.listeners[event]?.delete(fn);
    return this;
  }

  /** Replaces the token (the MQTT password). Warren has no MQTT 5 enhanced auth, so the
   * link reconnects with it at the next safe point: once the messages in flight are
   * acknowledged (new ones wait locally meanwhile). */
  updateToken(token) {
    this.password = token;
    if (this.state === "up") {
      this.draining = true;
      this.maybeDrained();
    } else if (this.state === "down" && !this.closed) {
      this.clearTimers();
      this.open();
    }
  }

  /** Closes the link for good: DISCONNECT (the server keeps the session for its expiry),
   * unacknowledged local messages back in their queues. */
  close() {
    if (this.closed) return;
    this.closed = true;
    this.clearTimers();
    if (this.sock && this.state === "up") {
      this.enqueue(mqtt.disconnect());
      this.flush();
    }
    this.teardown();
  }

  // --- events --------------------------------------------------------------------------

  emit(event, value) {
    for (const fn of this.listeners[event]) {
      try {
        fn(value);
      } catch (e) {
        // An app's listener must not break the link; report it where the app looks.
        queueMicrotask(() => { throw e; });
      }
    }
  }

  setState(s) {
    if (this.state === s) return;
    this.state = s;
    this.emit("state", s);
  }

  error(code, message, details) {
    this.emit("error", new LinkError(code, message, details));
  }

  // --- local side ----------------------------------------------------------------------

  declareLocal() {
    for (const r of this.forward) {
      const args = {};
      if (r.maxPending != null) args["x-max-length"] = r.maxPending;
      if (r.maxPendingBytes != null) args["x-max-length-bytes"] = r.maxPendingBytes;
      if (Object.keys(args).length) args["x-overflow"] = "reject-publish";
      this.declare(r.queue, args);
    }
    for (const s of this.subscribe) this.declare(s.queue, {});
  }

  declare(queue, args) {
    if (this.broker.queueLength(queue) !== undefined && Object.keys(args).length === 0) return;
    // Throws (406) if the app declared it with other arguments: the app must see that.
    this.broker.declareQueue(queue, { durable: true, arguments: args });
  }

  // --- connection ----------------------------------------------------------------------

  timer(ms, fn) {
    const t = setTimeout(() => { this.timers.delete(t); fn(); }, ms);
    this.timers.add(t);
    return t;
  }

  clearTimers() {
    for (const t of this.timers) clearTimeout(t);
    this.timers.clear();
    if (this.pinger) { clearInterval(this.pinger); this.pinger = null; }
  }

  open() {
    if (this.closed) return;
    this.setState("connecting");
    let sock;
    try {
      sock = new this.WS(this.url, ["mqtt"]);
    } catch (e) {
      this.error("network", `WebSocket: ${e?.message ?? e}`);
      this.lost();
      return;
    }
    sock.binaryType = "arraybuffer";
    this.sock = sock;
    this.asm = new mqtt.Assembler(this.maxPacketSize);
    this.out = new mqtt.Writer(4096);
    this.connacked = false;
    this.lastRx = Date.now();
    this.timer(this.connectTimeout, () => {
      if (this.sock === sock && !this.connacked) {
        this.error("network", `no CONNACK within ${this.connectTimeout} ms`);
        this.lost();
      }
    });
    sock.onopen = () => {
      if (this.sock !== sock) return;
      this.enqueue(mqtt.connect({
        clientId: this.clientId,
        username: this.username,
        password: this.password,
        keepAlive: this.keepAlive,
        cleanStart: false,
        sessionExpiry: this.sessionExpiry,
        receiveMaximum: this.window,
        maximumPacketSize: this.maxPacketSize,
      }));
      this.flush();
    };
    sock.onmessage = (ev) => {
      if (this.sock !== sock) return;
      const data = ev.data;
      if (typeof data === "string") return this.fail("protocol", "text WebSocket frame (MQTT is binary)");
      this.lastRx = Date.now();
      try {
        this.asm.push(new Uint8Array(data), (first, body) => {
          if (this.sock === sock) this.packet(mqtt.decode(first, body));
        });
      } catch (e) {
        if (e instanceof mqtt.MqttProtocolError) this.fail("protocol", e.message);
        else this.fail("local", `handling a server packet: ${e?.message ?? e}`);
      }
    };
    sock.onerror = (ev) => {
      if (this.sock !== sock) return;
      this.error("network", `WebSocket error${ev?.message ? `: ${ev.message}` : ""}`);
    };
    sock.onclose = () => {
      if (this.sock !== sock) return;
      this.lost();
    };
  }

  /** A fatal error on this connection: report, drop it, reconnect with backoff. */
  fail(code, message, details) {
    this.error(code, message, details);
    this.lost(code === "auth");
  }

  /** The connection is gone: local deliveries back to their queues (in order), reconnect
   * after a bounded, jittered backoff (an auth failure waits the longest). */
  lost(auth = false) {
    this.teardown();
    if (this.closed) return;
    const { min, max } = this.backoff;
    const base = auth ? max : Math.min(max, min * 2 ** this.attempt);
    this.attempt = Math.min(this.attempt + 1, 30);
    // Equal jitter: between half and all of the step, so tabs do not reconnect in lockstep.
    const delay = base / 2 + Math.random() * (base / 2);
    this.timer(delay, () => {
      this.stats.reconnects++;
      this.open();
    });
  }

  teardown() {
    const sock = this.sock;
    this.sock = null;
    if (this.pinger) { clearInterval(this.pinger); this.pinger = null; }
    if (sock) {
      sock.onopen = sock.onmessage = sock.onclose = null;
      // Not null: Node's `ws` throws an error event nobody listens to (closing a socket
      // that is still connecting emits one).
      sock.onerror = () => {};
      try { sock.close(); } catch { /* already closing */ }
    }
    for (const r of this.forward) this.stopRule(r);
    this.byPid.clear();
    this.draining = false;
    this.setState("down");
  }

  /** Cancels a rule's consumer: what it holds unacked goes back to the local queue, in
   * order (the core requeues by enqueue sequence), and is resent after a reconnect. */
  stopRule(r) {
    if (r.tag) {
      const tag = r.tag;
      r.tag = null;
      try { this.broker.cancel(tag); } catch (e) { this.error("local", `cancel ${r.queue}: ${e?.message ?? e}`); }
    }
    // Ids of unacked messages without their own, in order: given again when they return.
    r.reuse = r.derived.filter(Boolean);
    r.derived = [];
    r.sent = [];
    r.held = [];
  }

  enqueue(bytes) {
    this.out.bytes(bytes);
    this.scheduleFlush();
  }

  scheduleFlush() {
    if (this.flushQueued) return;
    this.flushQueued = true;
    queueMicrotask(() => this.flush());
  }

  /** Writes what is buffered as one binary frame (several packets per frame). */
  flush() {
    this.flushQueued = false;
    if (!this.sock || this.out.n === 0) return;
    const bytes = this.out.done().slice();
    this.out.n = 0;
    try {
      this.sock.send(bytes);
    } catch (e) {
      this.fail("network", `send: ${e?.message ?? e}`);
    }
  }

  // --- server packets ------------------------------------------------------------------

  packet(p) {
    switch (p.type) {
      case mqtt.CONNACK: return this.onConnack(p);
      case mqtt.PUBLISH: return this.onPublish(p);
      case mqtt.PUBACK: return this.onPuback(p);
      case mqtt.SUBACK: return this.onSuback(p);
      case mqtt.PINGRESP: return;
      case mqtt.DISCONNECT:
        return this.fail(p.reason === 0x87 || p.reason === 0x86 ? "auth" : "network",
          `server DISCONNECT 0x${p.reason.toString(16)}${p.reasonString ? `: ${p.reasonString}` : ""}`,
          { reason: p.reason });
    }
  }

  onConnack(p) {
    if (this.connacked) return this.fail("protocol", "second CONNACK");
    if (p.reason !== 0) {
      // 0x86 bad user name or password, 0x87 not authorized: credentials the app must fix.
      const auth = p.reason === 0x86 || p.reason === 0x87 || p.reason === 0x8c;
      return this.fail(auth ? "auth" : "refused",
        `CONNACK 0x${p.reason.toString(16)}${p.props[0x1f] ? `: ${p.props[0x1f]}` : ""}`,
        { reason: p.reason });
    }
    this.connacked = true;
    this.attempt = 0;
    this.serverReceiveMax = p.props[0x21] ?? 65535;
    this.serverMaxPacket = p.props[0x27] ?? 268435455;
    const keepAlive = p.props[0x13] ?? this.keepAlive;
    if (keepAlive > 0) {
      // A PINGREQ at half the keep-alive; a server silent for 1.5x of it is gone.
      this.pinger = setInterval(() => {
        if (Date.now() - this.lastRx > keepAlive * 1500) return this.fail("network", "keep-alive: the server went silent");
        this.enqueue(mqtt.pingreq());
      }, keepAlive * 500);
    }
    if (this.subscribe.length) {
      this.subPid = this.nextPid();
      this.byPid.set(this.subPid, { suback: true });
      this.enqueue(mqtt.subscribe(this.subPid, this.subscribe.map((s) => s.topic)));
    }
    this.setState("up");
    for (const r of this.forward) this.startRule(r);
  }

  onSuback(p) {
    if (p.pid !== this.subPid) return this.fail("protocol", `SUBACK for unknown packet id ${p.pid}`);
    this.byPid.delete(p.pid);
    p.reasons.forEach((code, i) => {
      if (code >= 0x80) {
        const s = this.subscribe[i];
        this.error("forbidden", `SUBSCRIBE ${s?.topic} refused: 0x${code.toString(16)}`, { reason: code, topic: s?.topic });
      }
    });
  }

  /** A server message: into the local queue as a persistent message; PUBACKed once the local
   * publish resolved (it returns a promise with a durable store). */
  onPublish(p) {
    const rule = this.subscribe.find((s) => topicMatches(s.topic, p.topic));
    if (!rule) return this.fail("protocol", `PUBLISH on ${p.topic}, which no subscription matches`);
    const sock = this.sock;
    const ack = () => {
      if (this.sock !== sock || p.qos === 0) return;
      mqtt.puback(this.out, p.pid);
      this.scheduleFlush();
    };
    const refuse = (why) => {
      // Not acknowledged: the server keeps it and resends it after the reconnect.
      if (this.sock === sock) this.fail("local", `inbox ${rule.queue}: ${why}`, { queue: rule.queue });
    };
    let result;
    try {
      result = this.broker.publish("", rule.queue, p.payload, {
        persistent: true,
        headers: { [TOPIC_HEADER]: p.topic },
      });
    } catch (e) {
      return refuse(e?.message ?? String(e));
    }
    this.stats.received++;
    if (result && typeof result.then === "function") {
      result.then((routed) => (routed === false ? refuse("queue missing") : ack()), (e) => refuse(e?.message ?? String(e)));
    } else if (result === false) {
      refuse("queue missing");
    } else {
      ack();
    }
  }

  onPuback(p) {
    const e = this.byPid.get(p.pid);
    if (!e || e.suback) return this.fail("protocol", `PUBACK for unknown packet id ${p.pid}`);
    this.byPid.delete(p.pid);
    const r = e.rule;
    // Of a consumer already cancelled (the message was requeued), or of a paused rule
    // (reported once, at the first refusal).
    if (e.gen !== r.gen || r.paused) return;
    if (p.reason >= 0x80) {
      // Refused (0x87 not authorized, 0x97 quota...): the rule stops until the next
      // connection; its messages wait in the local queue, nothing is dropped.
      this.error(p.reason === 0x87 ? "forbidden" : "refused",
        `PUBLISH to ${r.topic} refused: 0x${p.reason.toString(16)}`,
        { reason: p.reason, queue: r.queue, topic: r.topic });
      r.paused = true;
      this.stopRule(r);
      this.maybeDrained();
      return;
    }
    e.entry.done = true;
    this.stats.forwarded++;
    // Settled after the frame's packets: one multiple ack per frame, not one per message.
    if (!r.settleQueued) {
      r.settleQueued = true;
      const gen = r.gen;
      queueMicrotask(() => {
        r.settleQueued = false;
        if (r.gen === gen && this.state === "up") this.settle(r);
      });
    }
  }

  /** Acks the longest PUBACKed prefix of a rule's deliveries with one multiple ack (PUBACKs
   * come in order, so it is nearly always all of them), then sends more. */
  settle(r) {
    let last = null, k = 0;
    while (k < r.sent.length && r.sent[k].done) last = r.sent[k++];
    if (last) {
      r.sent.splice(0, k);
      r.derived.splice(0, k);
      try {
        this.broker.ack(last.m, true);
      } catch (err) {
        return this.fail("local", `ack on ${r.queue}: ${err?.message ?? err}`);
      }
    }
    this.pump(r);
    this.maybeDrained();
  }

  // --- forwarding ----------------------------------------------------------------------

  nextPid() {
    for (let k = 0; k < 65535; k++) {
      const pid = this.pidNext;
      this.pidNext = pid === 65535 ? 1 : pid + 1;
      if (!this.byPid.has(pid)) return pid;
    }
    throw new Error("no free packet id");
  }

  startRule(r) {
    if (r.tag) return;
    r.paused = false;
    const gen = r.gen = (r.gen ?? 0) + 1;
    const window = Math.min(this.window, this.serverReceiveMax);
    try {
      // The first deliveries run the callback before consume returns.
      const tag = this.broker.consume(r.queue, (m) => this.onLocal(r, m), { prefetch: window });
      if (r.gen === gen && !r.paused) r.tag = tag;
      else this.broker.cancel(tag);
    } catch (e) {
      this.error("local", `consume ${r.queue}: ${e?.message ?? e}`, { queue: r.queue });
    }
  }

  onLocal(r, m) {
    if (this.state !== "up") return; // a late delivery of a cancelled consumer: requeued
    r.held.push(m);
    this.pump(r);
  }

  /** Sends held deliveries while the in-flight window has room and no token refresh waits. */
  pump(r) {
    if (this.state !== "up" || this.draining) return;
    while (r.held.length && this.byPid.size < this.serverReceiveMax) {
      const m = r.held.shift();
      let id = m.properties?.messageId;
      let derived = null;
      if (!id) {
        id = m.redelivered && r.reuse.length ? r.reuse.shift() : `${this.linkId}-${++this.counter}`;
        derived = id;
      }
      const need = m.body.length + r.topic.length + id.length + 64;
      if (need > this.serverMaxPacket) {
        this.error("refused", `message of ${m.body.length} bytes on ${r.queue} exceeds the server's maximum packet size`, { queue: r.queue });
        r.paused = true;
        this.stopRule(r);
        return;
      }
      const pid = this.nextPid();
      this.byPid.set(pid, { rule: r, gen: r.gen });
      const entry = { m, pid, done: false };
      this.byPid.get(pid).entry = entry;
      r.sent.push(entry);
      r.derived.push(derived);
      mqtt.publish(this.out, r.topic, pid, m.body, [[LINK_ID_PROPERTY, id]]);
      // Written in bounded frames: a frame per ~64 KiB or per microtask.
      if (this.out.n >= 65536) this.flush();
      else this.scheduleFlush();
    }
  }

  /** A token refresh waits for the window to empty, then reconnects with the new token. */
  maybeDrained() {
    if (!this.draining) return;
    for (const r of this.forward) if (r.sent.length) return;
    this.enqueue(mqtt.disconnect());
    this.flush();
    this.teardown();
    if (!this.closed) this.open();
  }
}

/** MQTT filter match (`+` one level, `#` the rest), for routing server messages to rules. */
export function topicMatches(filter, topic) {
  const f = filter.split("/"), t = topic.split("/");
  for (let i = 0; i < f.length; i++) {
    if (f[i] === "#") return i > 0 || !topic.startsWith("$") ? true : false;
    if (i >= t.length) return false;
    if (f[i] === "+") { if (i === 0 && t[0].startsWith("$")) return false; continue; }
    if (f[i] !== t[i]) return false;
  }
  return f.length === t.length;
}

/** Bridges `broker` to a server Warren (see the module comment). */
export function connect(broker, options) {
  return new Link(broker, options);
}

Broker.prototype.connect = function (options) {
  return connect(this, options);
};
