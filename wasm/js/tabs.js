// One broker per origin: the tab that holds a store's Web Lock (the leader) serves the
// other tabs of the origin over a BroadcastChannel (`warren:<name>`), so they use its broker
// instead of opening the store a second time (`Broker.open({ ..., lock: "share" })`). The
// follower's calls are the same methods, answered asynchronously (every one returns a
// promise). docs/javascript.md, "One broker per origin".

/** What a follower may call (the rest of the API is the leader's own). */
const METHODS = new Set([
  "declareExchange", "deleteExchange", "declareQueue", "deleteQueue", "purgeQueue",
  "bindQueue", "unbindQueue", "bindExchange", "publish", "get", "ack", "nack", "reject",
  "cancel", "queueLength", "mqttPublish", "mqttUnsubscribe", "flush",
]);
/** How long a follower waits for the leader to answer. */
const TIMEOUT_MS = 10_000;

const wire = (e) => ({ message: e?.message ?? String(e), code: e?.code });

/** The leader's side: answers the followers' calls on `broker`. Returns the channel. */
export function lead(broker, name) {
  if (!globalThis.BroadcastChannel) return undefined;
  const bc = new BroadcastChannel(`warren:${name}`);
  bc.onmessage = async ({ data }) => {
    const { id, from, method, args } = data ?? {};
    if (id === undefined || from === undefined || !method) return;
    let result;
    let error;
    try {
      if (method === "ping") result = true;
      else if (method === "consume" || method === "mqttSubscribe") {
        // Deliveries go to the follower that asked, under the id it chose.
        const [what, sub, options] = args;
        const deliver = (message) => bc.postMessage({ to: from, sub, message });
        result = broker[method](what, deliver, options);
      } else if (METHODS.has(method)) result = await broker[method](...args);
      else throw new Error(`not a broker method a tab may call: ${method}`);
    } catch (e) {
      error = wire(e);
    }
    bc.postMessage({ re: id, to: from, result, error });
  };
  return bc;
}

/** A tab's view of the leader's broker: the same methods, each returning a promise. */
export class TabBroker {
  #bc;
  #me = crypto.randomUUID();
  #next = 0;
  #calls = new Map();
  #subs = new Map();
  /** Its consumers on the leader: tag -> how to stop it. */
  #tags = new Map();

  constructor(name) {
    this.#bc = new BroadcastChannel(`warren:${name}`);
    this.#bc.onmessage = ({ data }) => {
      if (data?.to !== this.#me) return;
      if (data.sub !== undefined) {
        this.#subs.get(data.sub)?.(data.message);
        return;
      }
      const call = this.#calls.get(data.re);
      if (!call) return;
      this.#calls.delete(data.re);
      clearTimeout(call.timer);
      if (data.error) call.reject(Object.assign(new Error(data.error.message), { code: data.error.code }));
      else call.resolve(data.result);
    };
    for (const m of METHODS) this[m] = (...args) => this.#call(m, args);
  }

  #call(method, args) {
    const id = ++this.#next;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.#calls.delete(id);
        reject(Object.assign(new Error(`the leader tab did not answer ${method}`), { code: "locked" }));
      }, TIMEOUT_MS);
      this.#calls.set(id, { resolve, reject, timer });
      this.#bc.postMessage({ id, from: this.#me, method, args });
    });
  }

  /** Resolves once the leader answers (open uses it: no leader, no follower). */
  ping() {
    return this.#call("ping", []);
  }

  async consume(queue, callback, options) {
    const sub = ++this.#next;
    this.#subs.set(sub, callback);
    const tag = await this.#call("consume", [queue, sub, options]);
    this.#tags.set(tag, "cancel");
    return tag;
  }

  async mqttSubscribe(filter, callback) {
    const sub = ++this.#next;
    this.#subs.set(sub, callback);
    const id = await this.#call("mqttSubscribe", [filter, sub]);
    this.#tags.set(id, "mqttUnsubscribe");
    return id;
  }

  /** Cancels its consumers on the leader and stops talking to it (its broker goes on). */
  async close() {
    await Promise.allSettled([...this.#tags].map(([tag, stop]) => this.#call(stop, [tag])));
    this.#tags.clear();
    this.#bc.close();
    for (const c of this.#calls.values()) clearTimeout(c.timer);
    this.#calls.clear();
  }
}
