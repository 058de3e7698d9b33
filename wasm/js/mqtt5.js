// A minimal MQTT 5 packet codec for the tab link (link.js): the packets a QoS 1 client sends
// and the ones a server sends it. Pure JavaScript (it adds nothing to the .wasm). Decoding is
// bounded and checked: a malformed packet throws `MqttProtocolError`, which the link turns
// into a "protocol" error event; nothing here trusts a length it has not checked.

export class MqttProtocolError extends Error {}

const enc = new TextEncoder();
const dec = new TextDecoder("utf-8", { fatal: true });

// Packet types (high nibble of the first byte).
export const CONNACK = 2, PUBLISH = 3, PUBACK = 4, SUBACK = 9, PINGRESP = 13, DISCONNECT = 14;

/** Growable output buffer; one per packet (small) or per flush. */
class Writer {
  constructor(size = 64) {
    this.b = new Uint8Array(size);
    this.n = 0;
  }
  room(k) {
    if (this.n + k <= this.b.length) return;
    let size = this.b.length * 2;
    while (size < this.n + k) size *= 2;
    const b = new Uint8Array(size);
    b.set(this.b.subarray(0, this.n));
    this.b = b;
  }
  u8(v) { this.room(1); this.b[this.n++] = v; }
  u16(v) { this.room(2); this.b[this.n++] = v >> 8; this.b[this.n++] = v & 0xff; }
  u32(v) { this.u16((v >>> 16) & 0xffff); this.u16(v & 0xffff); }
  varint(v) {
    do {
      let byte = v % 128;
      v = Math.floor(v / 128);
      if (v > 0) byte |= 0x80;
      this.u8(byte);
    } while (v > 0);
  }
  bytes(a) { this.room(a.length); this.b.set(a, this.n); this.n += a.length; }
  /** A two-byte length then the bytes (MQTT strings and binary data). */
  blob(a) {
    if (a.length > 0xffff) throw new RangeError("MQTT string longer than 65,535 bytes");
    this.u16(a.length);
    this.bytes(a);
  }
  str(s) { this.blob(enc.encode(s)); }
  done() { return this.b.subarray(0, this.n); }
}

/** A packet: the fixed header's first byte, then the remaining length and the body. */
function frame(first, body) {
  const w = new Writer(body.length + 5);
  w.u8(first);
  w.varint(body.length);
  w.bytes(body);
  return w.done();
}

function props(build) {
  const p = new Writer(32);
  build(p);
  return p.done();
}

/**
 * CONNECT, MQTT 5. `cleanStart` false and a session expiry keep the server's session (and
 * the inbox subscriptions) while the tab is away.
 */
export function connect({ clientId, username, password, keepAlive, cleanStart, sessionExpiry,
  receiveMaximum, maximumPacketSize }) {
  const b = new Writer(64);
  b.str("MQTT");
  b.u8(5);
  let flags = cleanStart ? 0x02 : 0;
  if (username != null) flags |= 0x80;
  if (password != null) flags |= 0x40;
  b.u8(flags);
  b.u16(keepAlive);
  const p = props((p) => {
    p.u8(0x11); p.u32(sessionExpiry);
    p.u8(0x21); p.u16(receiveMaximum);
    p.u8(0x27); p.u32(maximumPacketSize);
  });
  b.varint(p.length);
  b.bytes(p);
  b.str(clientId);
  if (username != null) b.str(username);
  if (password != null) b.blob(typeof password === "string" ? enc.encode(password) : password);
  return frame(0x10, b.done());
}

/** PUBLISH at QoS 1 with user properties (`[[name, value], ...]`), into `w` (a flush buffer). */
export function publish(w, topic, pid, payload, userProps) {
  const t = enc.encode(topic);
  const up = userProps.map(([k, v]) => [enc.encode(k), enc.encode(v)]);
  let propLen = 0;
  for (const [k, v] of up) propLen += 1 + 2 + k.length + 2 + v.length;
  const varLen = (n) => (n < 128 ? 1 : n < 16384 ? 2 : n < 2097152 ? 3 : 4);
  const remaining = 2 + t.length + 2 + varLen(propLen) + propLen + payload.length;
  w.u8(0x32);
  w.varint(remaining);
  w.blob(t);
  w.u16(pid);
  w.varint(propLen);
  for (const [k, v] of up) { w.u8(0x26); w.blob(k); w.blob(v); }
  w.bytes(payload);
  return 5 + remaining;
}

export function puback(w, pid) {
  // Success with no properties: the two-byte form (MQTT 5 3.4.2.1).
  w.u8(0x40); w.u8(2); w.u16(pid);
}

/** SUBSCRIBE, QoS 1, retained messages only for a new subscription (Retain Handling 1). */
export function subscribe(pid, filters) {
  const b = new Writer(64);
  b.u16(pid);
  b.u8(0); // no properties
  for (const f of filters) { b.str(f); b.u8(0x01 | (1 << 4)); }
  return frame(0x82, b.done());
}

export const pingreq = () => new Uint8Array([0xc0, 0]);
export const disconnect = () => new Uint8Array([0xe0, 0]);

export { Writer };

/** Reads one packet's body (`b`, a view of exactly the remaining length). */
class Reader {
  constructor(b) { this.b = b; this.i = 0; }
  need(k) { if (this.i + k > this.b.length) throw new MqttProtocolError("packet shorter than its fields"); }
  u8() { this.need(1); return this.b[this.i++]; }
  u16() { this.need(2); const v = (this.b[this.i] << 8) | this.b[this.i + 1]; this.i += 2; return v; }
  u32() { return this.u16() * 65536 + this.u16(); }
  varint() {
    let v = 0, mul = 1;
    for (let k = 0; k < 4; k++) {
      const byte = this.u8();
      v += (byte & 0x7f) * mul;
      if (!(byte & 0x80)) return v;
      mul *= 128;
    }
    throw new MqttProtocolError("variable byte integer longer than 4 bytes");
  }
  blob() { const n = this.u16(); this.need(n); const v = this.b.subarray(this.i, this.i + n); this.i += n; return v; }
  str() {
    try { return dec.decode(this.blob()); } catch (e) {
      if (e instanceof MqttProtocolError) throw e;
      throw new MqttProtocolError("string is not UTF-8");
    }
  }
  rest() { const v = this.b.subarray(this.i); this.i = this.b.length; return v; }
  left() { return this.b.length - this.i; }
  /** MQTT 5 properties: the ones the link reads, the rest checked and skipped. */
  props() {
    const len = this.varint();
    this.need(len);
    const end = this.i + len;
    const out = { user: [] };
    const sub = new Reader(this.b.subarray(this.i, end));
    this.i = end;
    while (sub.left() > 0) {
      const id = sub.u8();
      switch (id) {
        case 0x01: case 0x17: case 0x19: case 0x24: case 0x25: case 0x28: case 0x29: case 0x2a:
          out[id] = sub.u8(); break;
        case 0x13: case 0x21: case 0x22: case 0x23:
          out[id] = sub.u16(); break;
        case 0x02: case 0x11: case 0x18: case 0x27:
          out[id] = sub.u32(); break;
        case 0x0b:
          out[id] = sub.varint(); break;
        case 0x03: case 0x08: case 0x12: case 0x15: case 0x1a: case 0x1c: case 0x1f:
          out[id] = sub.str(); break;
        case 0x09: case 0x16:
          out[id] = sub.blob(); break;
        case 0x26:
          out.user.push([sub.str(), sub.str()]); break;
        default:
          throw new MqttProtocolError(`unknown property 0x${id.toString(16)}`);
      }
    }
    return out;
  }
}

/**
 * Decodes one server packet: `first` is the fixed header's first byte, `body` the rest.
 * Returns a plain object `{ type, ... }`; throws `MqttProtocolError` on anything malformed
 * or that a server must not send a client.
 */
export function decode(first, body) {
  const type = first >> 4, flags = first & 0x0f;
  const r = new Reader(body);
  switch (type) {
    case CONNACK: {
      const ack = r.u8();
      if (ack & 0xfe) throw new MqttProtocolError("CONNACK flags reserved bits set");
      const reason = r.u8();
      const p = r.left() > 0 ? r.props() : { user: [] };
      return { type, sessionPresent: (ack & 1) === 1, reason, props: p };
    }
    case PUBLISH: {
      const qos = (flags >> 1) & 3;
      if (qos > 1) throw new MqttProtocolError(`PUBLISH with QoS ${qos} (subscribed at QoS 1)`);
      const topic = r.str();
      const pid = qos > 0 ? r.u16() : 0;
      if (qos > 0 && pid === 0) throw new MqttProtocolError("PUBLISH with packet id 0");
      const p = r.props();
      if (p[0x23] !== undefined && topic === "") throw new MqttProtocolError("topic alias (none allowed)");
      return { type, qos, dup: (flags & 8) !== 0, retain: (flags & 1) !== 0, topic, pid, props: p, payload: r.rest() };
    }
    case PUBACK: {
      const pid = r.u16();
      const reason = r.left() > 0 ? r.u8() : 0;
      if (r.left() > 0) r.props();
      return { type, pid, reason };
    }
    case SUBACK: {
      const pid = r.u16();
      r.props();
      const reasons = Array.from(r.rest());
      if (reasons.length === 0) throw new MqttProtocolError("SUBACK without reason codes");
      return { type, pid, reasons };
    }
    case PINGRESP:
      if (body.length !== 0) throw new MqttProtocolError("PINGRESP with a body");
      return { type };
    case DISCONNECT: {
      const reason = r.left() > 0 ? r.u8() : 0;
      const p = r.left() > 0 ? r.props() : { user: [] };
      return { type, reason, reasonString: p[0x1f] };
    }
    default:
      throw new MqttProtocolError(`packet type ${type} is not one a server sends this client`);
  }
}

/**
 * Reassembles packets from WebSocket frames: a packet may span frames and a frame may hold
 * several. Bounded: a packet announcing more than `max` bytes is a protocol error before any
 * of it is buffered.
 */
export class Assembler {
  constructor(max) {
    this.max = max;
    this.buf = new Uint8Array(4096);
    this.len = 0;
  }
  /** Appends a frame's bytes; calls `onPacket(first, body)` for every complete packet. */
  push(chunk, onPacket) {
    if (this.len + chunk.length > this.buf.length) {
      let size = this.buf.length;
      while (size < this.len + chunk.length) size *= 2;
      const b = new Uint8Array(size);
      b.set(this.buf.subarray(0, this.len));
      this.buf = b;
    }
    this.buf.set(chunk, this.len);
    this.len += chunk.length;
    let at = 0;
    for (;;) {
      if (this.len - at < 2) break;
      let rem = 0, mul = 1, k = 1;
      for (;;) {
        if (at + k >= this.len) { rem = -1; break; }
        const byte = this.buf[at + k];
        rem += (byte & 0x7f) * mul;
        k++;
        if (!(byte & 0x80)) break;
        if (k > 4) throw new MqttProtocolError("remaining length longer than 4 bytes");
        mul *= 128;
      }
      if (rem < 0) break;
      if (rem > this.max) throw new MqttProtocolError(`packet of ${rem} bytes exceeds the maximum ${this.max}`);
      if (this.len - at - k < rem) break;
      // A copy: the buffer is reused, and a delivered payload must not change under the app.
      const body = this.buf.slice(at + k, at + k + rem);
      const first = this.buf[at];
      at += k + rem;
      onPacket(first, body);
    }
    if (at > 0) {
      this.buf.copyWithin(0, at, this.len);
      this.len -= at;
    }
    // A burst's buffer is not kept by an idle link.
    if (this.len === 0 && this.buf.length > 65536) this.buf = new Uint8Array(4096);
  }
}
