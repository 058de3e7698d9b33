// The durable broker under Node: `Broker.open({ persist: "indexeddb" })` over fake-indexeddb
// (an IndexedDB in memory; Node has none), closed and reopened from the same database after
// every kind of change. `node --test wasm/js/test/` after scripts/build-js.sh; fake-indexeddb
// comes from examples/browser's lockfile (scripts/test.sh setup_npm).
import { test } from "node:test";
import assert from "node:assert/strict";
import { Broker, StoreError } from "../node.js";
import {
  indexedDB,
  IDBKeyRange,
  IDBObjectStore,
  IDBDatabase,
} from "../../../examples/browser/node_modules/fake-indexeddb/build/esm/index.js";

const text = (m) => new TextDecoder().decode(m.body);
let unique = 0;
const fresh = (what) => `${what}-${process.pid}-${++unique}`;
const open = (name, extra = {}) =>
  Broker.open({ persist: "indexeddb", name, indexedDB, IDBKeyRange, now: 1000, ...extra });

// Everything ready in a queue, in order, acked (so nothing is left unacked).
function drain(b, queue) {
  const got = [];
  for (let m; (m = b.get(queue)); ) {
    got.push(m);
    b.ack(m);
  }
  return got;
}

// The raw store, for tampering: (key bytes, value bytes) of every record.
async function raw(name) {
  const db = await new Promise((resolve, reject) => {
    const r = indexedDB.open(`warren:${name}`);
    r.onsuccess = () => resolve(r.result);
    r.onerror = () => reject(r.error);
  });
  const tx = db.transaction("records", "readwrite");
  const st = tx.objectStore("records");
  const all = (req) => new Promise((resolve) => (req.onsuccess = () => resolve(req.result)));
  const [keys, values] = [await all(st.getAllKeys()), await all(st.getAll())];
  return { db, st, tx, records: keys.map((k, i) => [new Uint8Array(k), new Uint8Array(values[i])]) };
}

test("queues, persistent messages, exchanges, bindings and retained messages survive a reopen", async () => {
  const name = fresh("survive");
  const b = await open(name);
  b.declareExchange("logs", "topic", { durable: true });
  b.declareQueue("outbox", { durable: true, arguments: { "x-max-length": 1000 } });
  b.declareQueue("scratch");
  b.bindQueue("outbox", "logs", "field.#");
  assert.equal(await b.publish("", "outbox", "reading 1", { persistent: true }), true);
  assert.equal(
    await b.publish("logs", "field.a", "reading 2", {
      persistent: true,
      messageId: "m-2",
      contentType: "text/plain",
      headers: { n: 3, unit: "C", ok: true },
    }),
    true,
  );
  // Not persistent, or a transient queue: resolved at once, gone after the reopen.
  let early = false;
  const p = b.publish("", "outbox", "volatile").then(() => (early = true));
  for (let i = 0; i < 5; i++) await null;
  assert.equal(early, true, "a transient message's publish resolves without a write");
  await p;
  await b.publish("", "scratch", "tmp", { persistent: true });
  assert.equal(await b.mqttPublish("home/kitchen/temp", "21.5", { retain: true }), false);
  assert.equal(await b.publish("", "nowhere", "x", { persistent: true }), false, "unroutable");
  await b.close();

  const c = await open(name);
  assert.equal(c.queueLength("outbox"), 2);
  assert.equal(c.queueLength("scratch"), undefined, "a transient queue is not kept");
  const [m1, m2] = drain(c, "outbox");
  assert.equal(text(m1), "reading 1");
  assert.equal(m1.redelivered, true, "a recovered message may have been seen");
  assert.match(m1.properties.messageId, /^[0-9a-f-]{36}$/, "a stable messageId is stamped");
  assert.equal(text(m2), "reading 2");
  assert.equal(m2.routingKey, "field.a");
  assert.equal(m2.exchange, "logs");
  assert.deepEqual(m2.properties, {
    messageId: "m-2",
    contentType: "text/plain",
    deliveryMode: 2,
    headers: { n: 3, unit: "C", ok: true },
  });
  // The binding and the exchange came back.
  assert.equal(await c.publish("logs", "field.b", "reading 3", { persistent: true }), true);
  assert.equal(c.queueLength("outbox"), 1);
  // The queue's arguments too: redeclaring with others is refused.
  assert.throws(() => c.declareQueue("outbox", { durable: true }), /inequivalent arg/);
  const seen = [];
  c.mqttSubscribe("home/#", (m) => seen.push([m.topic, text(m), m.retain]));
  assert.deepEqual(seen, [["home/kitchen/temp", "21.5", true]]);
  await c.close();
});

test("acks, purges, unbinds, deletes and retained clears are kept: reopen after each", async () => {
  const name = fresh("changes");
  let b = await open(name);
  b.declareExchange("x", "direct", { durable: true });
  b.declareQueue("q", { durable: true });
  b.declareQueue("p", { durable: true });
  b.bindQueue("q", "x", "k");
  for (let i = 0; i < 5; i++) await b.publish("x", "k", `m${i}`, { persistent: true });
  for (let i = 0; i < 3; i++) await b.publish("", "p", `p${i}`, { persistent: true });
  await b.mqttPublish("a/b", "retained", { retain: true });
  // Two acked, one unacked (held by a consumer), two ready.
  const got = [];
  b.consume("q", (m) => got.push(m), { prefetch: 3 });
  b.ack(got[0]);
  b.ack(got[1]);
  await b.close();

  b = await open(name);
  const rest = drain(b, "q");
  assert.deepEqual(rest.map(text), ["m2", "m3", "m4"], "acked messages are gone, the unacked one is back");
  assert.deepEqual(
    rest.map((m) => m.redelivered),
    [true, true, true],
  );
  assert.equal(b.purgeQueue("p"), 3);
  await b.close();

  b = await open(name);
  assert.equal(b.queueLength("q"), 0, "acks after the reopen were kept");
  assert.equal(b.queueLength("p"), 0, "the purge was kept");
  b.unbindQueue("q", "x", "k");
  await b.close();

  b = await open(name);
  assert.equal(await b.publish("x", "k", "after unbind", { persistent: true }), false);
  b.deleteQueue("p");
  await b.mqttPublish("a/b", "", { retain: true });
  await b.close();

  b = await open(name);
  assert.equal(b.queueLength("p"), undefined, "the delete was kept");
  const seen = [];
  b.mqttSubscribe("a/#", (m) => seen.push(m.topic));
  assert.deepEqual(seen, [], "the retained message was cleared");
  b.bindQueue("q", "x", "k2");
  await b.publish("x", "k2", "kept", { persistent: true });
  b.deleteExchange("x");
  await b.close();

  b = await open(name);
  await assert.rejects(b.publish("x", "k2", "no exchange"), /NOT_FOUND/, "the exchange delete was kept");
  assert.deepEqual(drain(b, "q").map(text), ["kept"]);
  await b.close();
});

test("many publishes share a transaction (group commit) and come back in order", async () => {
  const name = fresh("order");
  const b = await open(name);
  b.declareQueue("log", { durable: true });
  const body = "x".repeat(100);
  const all = [];
  for (let i = 0; i < 2000; i++) all.push(b.publish("", "log", `${i} ${body}`, { persistent: true }));
  assert.deepEqual(new Set(await Promise.all(all)), new Set([true]));
  await b.close();
  const c = await open(name);
  const got = drain(c, "log").map((m) => Number(text(m).split(" ")[0]));
  assert.deepEqual(got, [...Array(2000).keys()]);
  await c.close();
});

test("a corrupt or torn record is a typed error at open, or skipped when asked", async () => {
  const name = fresh("corrupt");
  const b = await open(name);
  b.declareQueue("q", { durable: true });
  for (const s of ["one", "two", "three"]) await b.publish("", "q", s, { persistent: true });
  await b.close();

  // Flip one byte of the second message's value.
  const r = await raw(name);
  const messages = r.records.filter(([k]) => k[0] === 5);
  assert.equal(messages.length, 3);
  const [key, value] = messages[1];
  value[value.length - 2] ^= 0x40;
  r.st.put(value.buffer, key.buffer);
  await new Promise((resolve) => (r.tx.oncomplete = resolve));
  r.db.close();

  await assert.rejects(open(name), (e) => {
    assert.ok(e instanceof StoreError);
    assert.equal(e.code, "corrupt");
    assert.equal(e.count, 1);
    assert.match(e.skipped[0], /checksum mismatch/);
    return true;
  });
  const c = await open(name, { skipCorrupt: true });
  assert.equal(c.skipped.length, 1);
  assert.deepEqual(drain(c, "q").map(text), ["one", "three"]);
  await c.close();

  // A torn value (cut short) and a value of an unknown format version.
  const t = await raw(name);
  const q = t.records.find(([k]) => k[0] === 2);
  t.st.put(q[1].slice(0, 3).buffer, q[0].buffer);
  t.st.put(new Uint8Array([9, 0, 0, 0, 0]).buffer, new Uint8Array([5, 0, 1, 47, 0, 1, 113, 0, 0, 0, 0, 0, 0, 0, 9]).buffer);
  await new Promise((resolve) => (t.tx.oncomplete = resolve));
  t.db.close();
  await assert.rejects(open(name), (e) => {
    assert.equal(e.code, "corrupt");
    assert.equal(e.count, 3, "the flipped message, still there, and these two");
    assert.match(e.skipped.join("\n"), /truncated/);
    assert.match(e.skipped.join("\n"), /unknown format version/);
    return true;
  });
});

test("quota exceeded: unconfirmed publishes reject with 'quota', nothing confirmed is lost", async () => {
  const name = fresh("quota");
  const b = await open(name, { retryMs: 20 });
  b.declareQueue("q", { durable: true });
  await b.publish("", "q", "confirmed", { persistent: true });
  const errors = [];
  b.on("error", (e) => errors.push(e.code));
  // IndexedDB refuses every write while `full` (as a browser over its quota does).
  const put = IDBObjectStore.prototype.put;
  let full = true;
  IDBObjectStore.prototype.put = function (...args) {
    if (full) throw new DOMException("over quota", "QuotaExceededError");
    return put.apply(this, args);
  };
  try {
    await assert.rejects(b.publish("", "q", "refused", { persistent: true }), (e) => {
      assert.equal(e.code, "quota");
      return true;
    });
    assert.deepEqual(errors, ["quota"]);
    full = false;
    // The write is retried: later publishes are confirmed again.
    assert.equal(await b.publish("", "q", "after", { persistent: true }), true);
  } finally {
    IDBObjectStore.prototype.put = put;
  }
  await b.close();
  const c = await open(name);
  const got = drain(c, "q").map(text);
  assert.equal(got[0], "confirmed");
  assert.ok(got.includes("after"));
  await c.close();
});

test("a crash loses nothing confirmed: random work, killed at a random point", async () => {
  // The crash model of the core's store contract (core/src/store/memory.rs), against this
  // store: a broker is killed mid-work (its transactions in flight abort and it writes
  // nothing more, as a killed tab), and the reopened one must hold every confirmed, unacked
  // persistent message, in order, nothing invented, nothing whose ack a committed flush
  // covered.
  const begin = IDBDatabase.prototype.transaction;
  let seed = 12345;
  const rand = (n) => ((seed = (seed * 1103515245 + 12345) % 2 ** 31) % n);
  try {
    for (let round = 0; round < 12; round++) {
      const name = fresh("crash");
      const b = await open(name, { retryMs: 5 });
      b.declareQueue("q", { durable: true });
      const confirmed = new Set();
      const acked = new Set(); // acked and flushed: must not come back
      const settled = new Set(); // acked: may come back (the ack was not committed yet)
      let next = 0;
      let dead = false;
      const open_ = [];
      IDBDatabase.prototype.transaction = function (...a) {
        const tx = begin.apply(this, a);
        if (!dead) open_.push(tx);
        return tx;
      };
      const inflight = [];
      const steps = 20 + rand(80);
      const killAt = rand(steps);
      for (let s = 0; s < steps && !dead; s++) {
        if (s === killAt) {
          // Killed: what is in flight aborts, nothing more is written.
          dead = true;
          for (const tx of open_) {
            try {
              tx.abort();
            } catch {
              // already committed
            }
          }
          await b.close({ flush: false });
          break;
        }
        const op = rand(10);
        if (op < 6) {
          const id = next++;
          inflight.push(
            b.publish("", "q", String(id), { persistent: true }).then(
              () => !dead && confirmed.add(id),
              () => {},
            ),
          );
        } else if (op < 8) {
          const m = b.get("q");
          if (m) {
            b.ack(m);
            const id = Number(text(m));
            settled.add(id);
            if (rand(2)) await b.flush().then(() => !dead && acked.add(id), () => {});
          }
        } else {
          await new Promise((r) => setTimeout(r, rand(3)));
        }
      }
      if (!dead) await b.close({ flush: false });
      await Promise.allSettled(inflight);
      IDBDatabase.prototype.transaction = begin;
      const c = await open(name);
      const got = drain(c, "q").map((m) => Number(text(m)));
      await c.close();
      for (const id of confirmed) {
        if (!settled.has(id)) assert.ok(got.includes(id), `round ${round}: confirmed ${id} lost`);
      }
      for (const id of got) {
        assert.ok(id < next, `round ${round}: ${id} invented`);
        assert.ok(!acked.has(id), `round ${round}: ${id} was acked and flushed`);
      }
      assert.deepEqual(got, [...got].sort((x, y) => x - y), `round ${round}: out of order`);
    }
  } finally {
    IDBDatabase.prototype.transaction = begin;
  }
});

test("a channel error between a publish and its commit does not lose the publish's promise", async () => {
  // A refused declare resets the control channel, whose confirms of earlier publishes then
  // never come: those publishes resolve once what was written before is committed.
  const name = fresh("reset");
  const b = await open(name);
  b.declareQueue("q", { durable: true, arguments: { "x-max-length": 10 } });
  const before = b.publish("", "q", "before", { persistent: true });
  assert.throws(() => b.declareQueue("q", { durable: true }), /inequivalent arg/);
  const after = b.publish("", "q", "after", { persistent: true });
  assert.deepEqual(await Promise.all([before, after]), [true, true]);
  await b.close();
  const c = await open(name);
  assert.deepEqual(drain(c, "q").map(text), ["before", "after"]);
  await c.close();
});

test("new Broker() stays in memory: publish is synchronous", () => {
  const b = new Broker(1);
  b.declareQueue("q", { durable: true });
  assert.equal(b.publish("", "q", "x", { persistent: true }), true);
  assert.equal(b.queueLength("q"), 1);
});

test("the JS build leaves stream and quorum queues out: their declares are refused", () => {
  const b = new Broker(1);
  for (const type of ["stream", "quorum"]) {
    assert.throws(
      () => b.declareQueue(type, { durable: true, arguments: { "x-queue-type": type } }),
      new RegExp(`PRECONDITION_FAILED.*type '${type}' is left out of this build`),
    );
  }
  assert.equal(b.declareQueue("classic", { durable: true, arguments: { "x-queue-type": "classic" } }), "classic");
});

test("bad options are typed errors", async () => {
  await assert.rejects(Broker.open({ persist: "opfs" }), (e) => e.code === "unsupported");
  await assert.rejects(Broker.open({ persist: "indexeddb", name: "x" }), (e) => e.code === "unsupported");
});
