// The tab link (link.js) against a real `warren serve` over MQTT on WebSocket, under Node:
// `node --test wasm/js/test/` after scripts/build-js.sh and a build of the warren binary
// (WARREN_BIN, default target/debug/warren). Node 20 has no global WebSocket: the `ws` package
// (examples/browser's lockfile) is passed as the `WebSocket` option. The server side is
// checked with amqplib (a queue bound to amq.topic) and MQTT.js.
import { test, after } from "node:test";
import assert from "node:assert/strict";
import { createRequire } from "node:module";
import { Broker } from "../node.js";
import { LinkError, LINK_ID_PROPERTY } from "../link.js";
import { createServer, connect as tcpConnect } from "node:net";
import { Warren } from "./warren-server.mjs";

const require = createRequire(new URL("../../../examples/browser/package.json", import.meta.url));
const WebSocket = require("ws");
const { WebSocketServer } = require("ws");
const amqp = require("amqplib");
const mqtt = require("mqtt");

const server = await new Warren().start();
after(() => server.close());

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function until(what, cond, ms = 30_000) {
  const end = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}
const text = (b) => new TextDecoder().decode(b);

/** A durable queue on the server bound to amq.topic with `key`; returns { conn, ch, q }. */
async function serverQueue(name, key) {
  const conn = await amqp.connect(server.amqpUrl);
  const ch = await conn.createChannel();
  await ch.assertQueue(name, { durable: true });
  await ch.bindQueue(name, "amq.topic", key);
  return { conn, ch };
}

/** Every message of a server queue, drained with get (no consumer redelivery in the way). */
async function drain(name) {
  const conn = await amqp.connect(server.amqpUrl);
  const ch = await conn.createChannel();
  const out = [];
  for (;;) {
    const m = await ch.get(name, { noAck: true });
    if (!m) break;
    out.push(m);
  }
  await conn.close();
  return out;
}

function link(broker, options) {
  const l = broker.connect({ url: server.wsUrl, WebSocket, reconnect: { min: 50, max: 1000 }, ...options });
  l.states = [];
  l.errors = [];
  l.on("state", (s) => l.states.push(s));
  l.on("error", (e) => l.errors.push(e));
  return l;
}

const upOf = (l) => until("link up", () => l.state === "up");

function expectInOrder(got, n, prefix) {
  const bodies = got.map((m) => m.content.toString());
  assert.equal(bodies.length, n, `${n} messages, got ${bodies.length}`);
  assert.equal(new Set(bodies).size, n, "no duplicates");
  for (let i = 0; i < n; i++) {
    if (bodies[i] !== `${prefix}${i}`) assert.fail(`message ${i} is ${bodies[i]}`);
  }
}

test("forwards 10,000 messages exactly once and in order; acked locally on PUBACK", async () => {
  const { conn } = await serverQueue("fwd-10k", "field.log");
  await conn.close();
  const b = new Broker(1, Date.now());
  b.declareQueue("outbox", { durable: true });
  const n = 10_000;
  for (let i = 0; i < n; i++) b.publish("", "outbox", `m${i}`, { persistent: true });
  const t0 = performance.now();
  const l = link(b, { clientId: "fwd-10k", forward: [{ queue: "outbox", topic: "field/log" }] });
  await until("outbox drained", () => b.queueLength("outbox") === 0 && l.inflight === 0);
  const ms = performance.now() - t0;
  console.log(`# forwarded ${n} messages in ${ms.toFixed(0)} ms: ${Math.round(n / (ms / 1000))} msg/s (Node, loopback)`);
  l.close();
  assert.equal(l.state, "down");
  const got = await drain("fwd-10k");
  expectInOrder(got, n, "m");
  // Each carries the link id the server dedups on (as a header on the AMQP side).
  assert.match(String(got[0].properties.headers[LINK_ID_PROPERTY]), /-1$/);
  assert.deepEqual(l.errors, []);
});

/** A TCP proxy to the server's WebSocket port whose connections the test can cut (both
 * directions at once, whatever is in flight: PUBLISHes and PUBACKs are lost mid-window). */
async function cuttableProxy(port) {
  const socks = new Set();
  const proxy = createServer((down) => {
    const up = tcpConnect(port, "127.0.0.1");
    for (const s of [down, up]) {
      socks.add(s);
      s.on("close", () => socks.delete(s));
      s.on("error", () => {});
    }
    down.pipe(up);
    up.pipe(down);
  });
  await new Promise((r) => proxy.listen(0, "127.0.0.1", r));
  return {
    url: `ws://127.0.0.1:${proxy.address().port}/mqtt`,
    cut() { for (const s of socks) s.destroy(); },
    close() { this.cut(); proxy.close(); },
  };
}

test("connections cut mid-stream: resends carry the same ids and the server drops them", async () => {
  const { conn } = await serverQueue("fwd-cut", "field.cut");
  await conn.close();
  const proxy = await cuttableProxy(server.ports.ws);
  const b = new Broker(8, Date.now());
  b.declareQueue("outbox", { durable: true });
  const n = 10_000;
  for (let i = 0; i < n; i++) b.publish("", "outbox", `c${i}`, { persistent: true });
  const l = link(b, { url: proxy.url, clientId: "fwd-cut", forward: [{ queue: "outbox", topic: "field/cut" }] });
  let cuts = 0;
  for (const at of [n / 4, n / 2, (3 * n) / 4]) {
    await until(`${at} forwarded`, () => l.stats.forwarded >= at);
    const inflight = l.inflight;
    proxy.cut();
    cuts++;
    assert.ok(inflight > 0, "messages were in flight at the cut");
    await until("down", () => l.state !== "up");
  }
  await until("outbox drained", () => b.queueLength("outbox") === 0 && l.state === "up" && l.inflight === 0, 60_000);
  l.close();
  proxy.close();
  assert.equal(cuts, 3);
  assert.ok(l.stats.reconnects >= 3, `reconnects: ${l.stats.reconnects}`);
  expectInOrder(await drain("fwd-cut"), n, "c");
});

test("server stopped and restarted mid-stream: nothing lost, in order", async () => {
  const { conn } = await serverQueue("fwd-restart", "field.restart");
  await conn.close();
  const b = new Broker(2, Date.now());
  b.declareQueue("outbox", { durable: true });
  const n = 10_000;
  for (let i = 0; i < n; i++) b.publish("", "outbox", `r${i}`, { persistent: true });
  const l = link(b, { clientId: "fwd-restart", inflight: 64, forward: [{ queue: "outbox", topic: "field/restart" }] });
  await until("a third forwarded", () => l.stats.forwarded >= n / 3);
  await server.restart();
  assert.ok(l.states.includes("down"), "the link saw the server go");
  await until("outbox drained after the restart", () => b.queueLength("outbox") === 0 && l.state === "up" && l.inflight === 0, 60_000);
  l.close();
  // The dedup window is the server's memory: messages it stored but whose PUBACK the stop
  // cut off come again after the restart (at most the in-flight window), docs/mqtt.md.
  const bodies = (await drain("fwd-restart")).map((m) => m.content.toString());
  const seen = new Set();
  const firsts = bodies.filter((b) => !seen.has(b) && seen.add(b));
  assert.deepEqual(firsts, Array.from({ length: n }, (_, i) => `r${i}`), "nothing lost, in order");
  const doubled = bodies.length - firsts.length;
  console.log(`# restart: ${doubled} messages delivered twice (the in-flight window at the stop was 64)`);
  assert.ok(doubled <= 64, `${doubled} duplicates, more than the in-flight window`);
});

test("wrong password: an auth error, state down, no tight reconnect loop", async () => {
  const b = new Broker(3, Date.now());
  const l = link(b, { clientId: "bad-pw", username: "guest", password: "wrong", reconnect: { min: 50, max: 5000 } });
  await until("auth error", () => l.errors.length > 0);
  assert.ok(l.errors[0] instanceof LinkError);
  assert.equal(l.errors[0].code, "auth");
  assert.equal(l.errors[0].reason, 0x86);
  await until("down", () => l.state === "down");
  await sleep(1500);
  // An auth failure waits the longest backoff (2.5-5 s here): one attempt so far.
  assert.equal(l.states.filter((s) => s === "connecting").length, 1, `states: ${l.states}`);
  l.close();
});

test("a topic the user may not publish to: forbidden, the message stays in the local queue", async () => {
  server.ctl("add-user", "field", "pw");
  server.ctl("set-permissions", "field", ".*", ".*", ".*");
  server.ctl("set-topic-permissions", "field", "amq.topic", "^field\\.", "^field\\.");
  const b = new Broker(4, Date.now());
  b.declareQueue("secret", { durable: true });
  b.publish("", "secret", "s1", { persistent: true });
  const l = link(b, {
    clientId: "forbidden", username: "field", password: "pw",
    forward: [{ queue: "secret", topic: "admin/secret" }],
    subscribe: [{ topic: "admin/#", queue: "inbox-forbidden" }],
  });
  await until("two errors", () => l.errors.length >= 2);
  const codes = l.errors.map((e) => e.code).sort();
  assert.deepEqual(codes, ["forbidden", "forbidden"], l.errors.map((e) => e.message).join("; "));
  assert.ok(l.errors.some((e) => e.topic === "admin/secret" && e.reason === 0x87));
  assert.equal(l.state, "up", "the connection stays");
  l.close();
  assert.equal(b.queueLength("secret"), 1, "nothing dropped");
});

test("server publishes reach the local inbox, also one published while the link was down", async () => {
  const b = new Broker(5, Date.now());
  const l = link(b, { clientId: "inbox", subscribe: [{ topic: "field/commands/#", queue: "inbox" }] });
  await upOf(l);
  await sleep(200); // the SUBACK
  const conn = await amqp.connect(server.amqpUrl);
  const ch = await conn.createConfirmChannel();
  ch.publish("amq.topic", "field.commands.x", Buffer.from("c1"), { persistent: true });
  await ch.waitForConfirms();
  await until("c1 in the inbox", () => b.queueLength("inbox") === 1);
  l.close();
  ch.publish("amq.topic", "field.commands.y", Buffer.from("c2"), { persistent: true });
  await ch.waitForConfirms();
  await conn.close();
  const l2 = link(b, { clientId: "inbox", subscribe: [{ topic: "field/commands/#", queue: "inbox" }] });
  await until("c2 in the inbox", () => b.queueLength("inbox") === 2);
  const m1 = b.get("inbox", { noAck: true }), m2 = b.get("inbox", { noAck: true });
  assert.equal(text(m1.body), "c1");
  assert.equal(text(m2.body), "c2");
  assert.equal(m2.properties.headers["x-link-topic"], "field/commands/y");
  assert.equal(m2.properties.deliveryMode, 2, "persistent");
  l2.close();
  assert.deepEqual([...l.errors, ...l2.errors], []);
});

test("server-side dedup: the same link id twice on a client id's session is routed once", async () => {
  const { conn } = await serverQueue("dedup", "field.dedup");
  await conn.close();
  const connect = (clientId) => mqtt.connectAsync(server.wsUrl, {
    protocolVersion: 5, clientId, clean: false, properties: { sessionExpiryInterval: 600 }, reconnectPeriod: 0,
    wsOptions: { protocol: "mqtt" },
  });
  const send = (c, body, id) => c.publishAsync("field/dedup", body, { qos: 1, properties: { userProperties: { [LINK_ID_PROPERTY]: id } } });
  let c = await connect("dedup-a");
  await send(c, "first", "L-1");
  // The link resending after a lost PUBACK: a new connection of the same client id.
  c.stream.destroy();
  await sleep(100);
  c = await connect("dedup-a");
  await send(c, "again", "L-1");
  await send(c, "second", "L-2");
  await c.endAsync();
  // Another client id's window is its own.
  const other = await connect("dedup-b");
  await send(other, "other", "L-1");
  await other.endAsync();
  const got = (await drain("dedup")).map((m) => m.content.toString());
  assert.deepEqual(got, ["first", "second", "other"]);
});

test("a malformed server packet: a protocol error event, no exception, the link goes down", async () => {
  // A fake server: CONNACK, then a PUBLISH whose topic length runs past the packet.
  const wss = new WebSocketServer({ host: "127.0.0.1", port: 0, handleProtocols: () => "mqtt" });
  await new Promise((r) => wss.once("listening", r));
  let conns = 0;
  wss.on("connection", (ws) => {
    conns++;
    ws.once("message", () => {
      ws.send(Buffer.from([0x20, 0x03, 0x00, 0x00, 0x00]));
      ws.send(Buffer.from([0x32, 0x04, 0x00, 0x09, 0x61, 0x62]));
    });
  });
  const b = new Broker(6, Date.now());
  const l = b.connect({ url: `ws://127.0.0.1:${wss.address().port}/mqtt`, WebSocket, reconnect: { min: 5000, max: 5000 } });
  const errors = [];
  l.on("error", (e) => errors.push(e));
  await until("protocol error", () => errors.some((e) => e.code === "protocol"));
  assert.equal(l.state, "down");
  l.close();
  await new Promise((r) => wss.close(r));
  assert.equal(conns, 1);
});

test("updateToken reconnects with the new password at a safe point", async () => {
  server.ctl("add-user", "tok", "t1");
  server.ctl("set-permissions", "tok", ".*", ".*", ".*");
  const b = new Broker(7, Date.now());
  const l = link(b, { clientId: "tok", username: "tok", token: "t1" });
  await upOf(l);
  server.ctl("change-password", "tok", "t2");
  l.updateToken("t2");
  await until("reconnected", () => l.states.filter((s) => s === "up").length === 2);
  assert.deepEqual(l.errors, []);
  l.close();
});
