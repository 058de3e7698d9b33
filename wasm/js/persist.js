// The durable broker in a browser tab: `Broker.open({ persist: "indexeddb", name })`.
// docs/javascript.md, "Durable in the browser", is the guide and the byte format.
//
// The core is synchronous and IndexedDB is not: the Rust store (wasm/src/idb_store.rs)
// serves reads from memory and hands every change to this file as a sealed batch when the
// core starts a sync; the batch is written in ONE readwrite transaction (group commit: one
// transaction in flight, everything published meanwhile goes in the next), and only on the
// transaction's `complete` does the core hear `synced`, which releases the publisher
// confirms that `publish` promises wait for. On open, every record is read back and the
// broker is rebuilt from it before the first call, as the native broker on restart.
import { Broker as Core } from "./dist/warren_wasm.js";
import { lead, TabBroker } from "./tabs.js";

const STORE = "records";
const PUT = 1;
const DEL = 2;
// Record kinds (the first key byte), in replay order: wasm/src/record.rs.
const EXCHANGE = 1;
const QUEUE = 2;
const BINDING = 3;
const RETAINED = 4;

/** A store failure the app can act on: `code` says which (see index.d.ts). */
export class StoreError extends Error {
  constructor(code, message, details = {}) {
    super(message);
    this.name = "StoreError";
    this.code = code;
    Object.assign(this, details);
  }
}

const request = (req) =>
  new Promise((resolve, reject) => {
    req.onsuccess = () => resolve(req.result);
    req.onerror = () => reject(req.error);
  });

async function openDb(factory, name) {
  const req = factory.open(`warren:${name}`, 1);
  req.onupgradeneeded = () => req.result.createObjectStore(STORE);
  return request(req);
}

const bytesOf = (v) =>
  v instanceof ArrayBuffer
    ? new Uint8Array(v)
    : ArrayBuffer.isView(v)
      ? new Uint8Array(v.buffer, v.byteOffset, v.byteLength)
      : new Uint8Array(0); // not a record: the store reports it as truncated

// Every record, packed as put ops (wasm/src/idb_store.rs): keys come in key order.
async function readAll(db) {
  const tx = db.transaction(STORE, "readonly");
  const st = tx.objectStore(STORE);
  const [keys, values] = await Promise.all([request(st.getAllKeys()), request(st.getAll())]);
  const ks = keys.map(bytesOf);
  const vs = values.map(bytesOf);
  let n = 0;
  for (let i = 0; i < ks.length; i++) n += 9 + ks[i].length + vs[i].length;
  const out = new Uint8Array(n);
  const dv = new DataView(out.buffer);
  let o = 0;
  for (let i = 0; i < ks.length; i++) {
    out[o++] = PUT;
    for (const f of [ks[i], vs[i]]) {
      dv.setUint32(o, f.length, true);
      out.set(f, o + 4);
      o += 4 + f.length;
    }
  }
  return out;
}

// One broker per store and origin: a second opener of the same name waits for the first to
// close (`lock: "wait"`), uses the first one's broker (`"share"`: `null` here, tabs.js) or
// gets a "locked" error at once (the default), never a second writer. Web Locks span the
// tabs and workers of an origin.
async function takeLock(name, mode) {
  const locks = globalThis.navigator?.locks;
  if (!locks || mode === false) return () => {};
  let release;
  const held = new Promise((resolve) => (release = resolve));
  const got = await new Promise((resolve, reject) => {
    locks
      .request(`warren:${name}`, { ifAvailable: mode !== "wait" }, (lock) => {
        resolve(lock !== null);
        return lock === null ? undefined : held;
      })
      .catch(reject);
  });
  if (!got) {
    if (mode === "share") return null;
    throw new StoreError("locked", `store '${name}' is open in another tab or worker`);
  }
  return release;
}

const isPersistent = (o) => o != null && (o.persistent === true || o.deliveryMode === 2);

export class Broker extends Core {
  #db = null;
  #range = null;
  #durability = "strict";
  #retryMs = 1000;
  #release = () => {};
  #closed = false;
  /** The last committed epoch. */
  #synced = -1;
  /** flush() waiters: { epoch, resolve, reject }. */
  #waiters = [];
  /** Publishes waiting for their confirm, by confirm sequence number. */
  #unconfirmed = new Map();
  /** The last write failure, until a write commits again. */
  #failure = null;
  #listeners = [];
  #retry = undefined;
  /** The channel other tabs reach this broker on (tabs.js). */
  #tabs = undefined;
  #settling = false;
  /** Records skipped at open (with `skipCorrupt`). */
  skipped = [];

  /**
   * A broker that keeps its durable state in IndexedDB (`persist: "indexeddb"`): durable
   * exchanges, queues and bindings, persistent messages on durable queues, retained MQTT
   * messages. Resolves once the stored state is back.
   */
  static async open(options = {}) {
    const {
      persist,
      name = "default",
      seed,
      now = Date.now(),
      skipCorrupt = false,
      durability = "strict",
      retryMs = 1000,
      lock = true,
    } = options;
    if (persist !== "indexeddb") {
      throw new StoreError("unsupported", `persist: ${JSON.stringify(persist)} (only "indexeddb")`);
    }
    const factory = options.indexedDB ?? globalThis.indexedDB;
    const range = options.IDBKeyRange ?? globalThis.IDBKeyRange;
    if (!factory || !range) {
      throw new StoreError("unsupported", "no IndexedDB here (Node: pass indexedDB and IDBKeyRange)");
    }
    const release = await takeLock(name, lock);
    if (release === null) {
      const tab = new TabBroker(name);
      try {
        await tab.ping();
      } catch (e) {
        tab.close();
        throw new StoreError("locked", `store '${name}' is open elsewhere and its leader does not answer`);
      }
      return tab;
    }
    let db;
    let b;
    try {
      db = await openDb(factory, name);
      const records = await readAll(db);
      b = new Broker(seed, now);
      b.#db = db;
      b.#range = range;
      b.#durability = durability;
      b.#retryMs = retryMs;
      b.#release = release;
      const [count, skipped, definitions] = b._persist(records, (a) => b.#write(a[0], a[1]), seed);
      // Replayed as the app's own declares: what the core cannot restore is skipped too.
      let failed = 0;
      for (const d of definitions) {
        try {
          b.#replay(d);
        } catch (e) {
          failed += 1;
          skipped.push(`${d.exchange || d.routingKey}: ${e.message}`);
        }
      }
      b._restored();
      const n = count + failed;
      if (n > 0 && !skipCorrupt) {
        throw new StoreError(
          "corrupt",
          `store '${name}': ${n} record(s) could not be read back (open with skipCorrupt to go on without them)`,
          { skipped, count: n },
        );
      }
      b.skipped = skipped;
      await b.flush();
      b.#tabs = lead(b, name);
      return b;
    } catch (e) {
      if (b) {
        b.#closed = true;
        b.free();
      }
      db?.close();
      release();
      throw e;
    }
  }

  #replay(d) {
    const f = d.properties.priority ?? 0;
    const args = d.properties.headers ?? {};
    switch (d.kind) {
      case EXCHANGE:
        return super.declareExchange(d.exchange, d.routingKey, {
          durable: (f & 1) !== 0,
          autoDelete: (f & 2) !== 0,
          internal: (f & 4) !== 0,
          arguments: args,
        });
      case QUEUE:
        return super.declareQueue(d.routingKey, {
          durable: (f & 1) !== 0,
          exclusive: (f & 2) !== 0,
          autoDelete: (f & 4) !== 0,
          arguments: args,
        });
      case BINDING:
        return f & 1
          ? super.bindExchange(d.properties.replyTo, d.exchange, d.routingKey, args)
          : super.bindQueue(d.properties.replyTo, d.exchange, d.routingKey, args);
      case RETAINED:
        return this._retain(d.routingKey, d.body);
      default:
        throw new Error(`unknown record kind ${d.kind}`);
    }
  }

  // A sealed batch (ops as in wasm/src/idb_store.rs) in one transaction.
  #write(epoch, batch) {
    let tx;
    try {
      tx = this.#db.transaction(STORE, "readwrite", { durability: this.#durability });
    } catch (e) {
      queueMicrotask(() => this.#failed(epoch, e));
      return;
    }
    const st = tx.objectStore(STORE);
    const dv = new DataView(batch.buffer, batch.byteOffset, batch.byteLength);
    let o = 0;
    // A copy of its own: IndexedDB clones a view's whole buffer.
    const field = () => {
      const n = dv.getUint32(o, true);
      const f = batch.slice(o + 4, o + 4 + n).buffer;
      o += 4 + n;
      return f;
    };
    try {
      while (o < batch.length) {
        const code = batch[o++];
        const key = field();
        if (code === PUT) st.put(field(), key);
        else if (code === DEL) st.delete(key);
        else st.delete(this.#range.bound(key, field()));
      }
    } catch (e) {
      tx.abort();
      queueMicrotask(() => this.#failed(epoch, e));
      return;
    }
    tx.oncomplete = () => this.#committed(epoch);
    tx.onabort = () => this.#failed(epoch, tx.error);
  }

  #committed(epoch) {
    if (this.#closed) return;
    this.#synced = Math.max(this.#synced, epoch);
    this.#failure = null;
    this._synced(epoch);
    this.#settle();
    this.#waiters = this.#waiters.filter((w) => (w.epoch <= this.#synced ? (w.resolve(), false) : true));
  }

  #failed(epoch, error) {
    if (this.#closed) return;
    const quota = error?.name === "QuotaExceededError";
    this.#failure = new StoreError(
      quota ? "quota" : "write",
      `IndexedDB write failed (${error?.name ?? "abort"}): ${error?.message ?? ""}; unconfirmed publishes are rejected, nothing confirmed is lost`,
      { cause: error },
    );
    this._syncFailed(epoch);
    this.#settle();
    this.#waiters = this.#waiters.filter((w) => (w.epoch <= epoch ? (w.reject(this.#failure), false) : true));
    for (const l of this.#listeners) l(this.#failure);
    // Its writes are tried again with the next batch.
    clearTimeout(this.#retry);
    this.#retry = setTimeout(() => this.#closed || this._resume(), this.#retryMs);
  }

  // Confirms the core released: id resolves, -id rejects; `0, base` means the control
  // channel was reset (a channel error) and the confirms of the publishes up to `base` will
  // not come: they resolve once what was written before now is committed.
  #settle() {
    const cs = this._takeConfirms();
    for (let i = 0; i < cs.length; i++) {
      const c = cs[i];
      if (c === 0) {
        const base = cs[++i];
        for (const [id, p] of this.#unconfirmed) {
          if (id > base) continue;
          this.#unconfirmed.delete(id);
          this.flush().then(() => p.resolve(p.routed), p.reject);
        }
        continue;
      }
      const p = this.#unconfirmed.get(Math.abs(c));
      if (!p) continue;
      this.#unconfirmed.delete(Math.abs(c));
      if (c > 0) p.resolve(p.routed);
      else p.reject(this.#failure ?? new StoreError("nack", "the broker could not store the message"));
    }
  }

  // The promise of the publish just made, under its id (`_publishSeq`). Confirms that
  // came at once are settled in a microtask, one for every publish made meanwhile (one
  // call into the module, not one each).
  #confirmed(routed) {
    const seq = this._publishSeq;
    const p = new Promise((resolve, reject) => {
      this.#unconfirmed.set(seq, { resolve, reject, routed });
    });
    if (!this.#settling) {
      this.#settling = true;
      queueMicrotask(() => {
        this.#settling = false;
        if (!this.#closed) this.#settle();
      });
    }
    return p;
  }

  #failedPublish(e) {
    this.#settle();
    return Promise.reject(e);
  }

  /**
   * In-memory brokers: returns whether the message was routed. Persistent brokers: a
   * promise of that, resolved once the message is committed to IndexedDB (at once for a
   * transient message or queue); a persistent message without a `messageId` gets one.
   */
  publish(exchange, routingKey, body, options) {
    if (!this.#db) return super.publish(exchange, routingKey, body, options);
    if (this.#closed) return Promise.reject(new StoreError("closed", "the broker is closed"));
    if (isPersistent(options) && options.messageId == null) {
      options = { ...options, messageId: crypto.randomUUID() };
    }
    let routed;
    try {
      routed = super.publish(exchange, routingKey, body, options);
    } catch (e) {
      return this.#failedPublish(e);
    }
    return this.#confirmed(routed);
  }

  /** As `publish`; with `retain`, resolves once the retained message is committed too. */
  mqttPublish(topic, payload, options) {
    if (!this.#db) return super.mqttPublish(topic, payload, options);
    if (this.#closed) return Promise.reject(new StoreError("closed", "the broker is closed"));
    let routed;
    try {
      routed = super.mqttPublish(topic, payload, options);
    } catch (e) {
      return this.#failedPublish(e);
    }
    const p = this.#confirmed(routed);
    return options?.retain ? p.then((r) => this.flush().then(() => r)) : p;
  }

  /** Resolves once every change made so far (acks, deletes, declares too) is committed. */
  flush() {
    if (!this.#db || this.#closed) return Promise.resolve();
    const epoch = this._unsyncedEpoch();
    if (epoch === undefined || epoch <= this.#synced) return Promise.resolve();
    return new Promise((resolve, reject) => this.#waiters.push({ epoch, resolve, reject }));
  }

  /** `"error"`: a write failed (`StoreError`, code `"quota"` or `"write"`). */
  on(event, listener) {
    if (event === "error") this.#listeners.push(listener);
  }

  /**
   * Commits what is pending, then closes the store (and lets another tab open it). With
   * `{ flush: false }`: at once, as a crash would (what is not committed is not kept, and
   * the publishes waiting for it reject with "closed").
   */
  async close({ flush = true } = {}) {
    if (this.#closed) return;
    if (this.#db) {
      if (flush) await this.flush();
      this.#closed = true;
      clearTimeout(this.#retry);
      const closed = new StoreError("closed", "the broker was closed before this was stored");
      for (const p of this.#unconfirmed.values()) p.reject(closed);
      for (const w of this.#waiters) w.reject(closed);
      this.#unconfirmed.clear();
      this.#waiters = [];
      this.#tabs?.close();
      this.#db.close();
      this.#release();
    }
    this.#closed = true;
    this.free();
  }
}
