// Compile-only check of the generated TypeScript types (scripts/test.sh runs `tsc --noEmit`
// on this): the API as a TS user writes it must type-check, and misuse must not.
import { Broker, init, type Message, type PublishOptions } from "../index.js";

await init();
const b = new Broker(1, Date.now());
const q: string = b.declareQueue("");
b.declareExchange("x", "topic", { durable: false });
b.bindQueue(q, "x", "a.#");
b.bindQueue(q, "amq.headers", "", { "x-match": "any", tier: 1, nested: { list: [1, "a", null] } });
const options: PublishOptions = { headers: { n: 1 }, contentType: "text/plain", persistent: true };
const routed: boolean = b.publish("x", "a.b", new Uint8Array([1]), options);
const tag: string = b.consume(q, (m: Message) => b.ack(m), { prefetch: 10 });
b.cancel(tag);
for await (const m of b.messages(q, { noAck: true })) {
  const body: Uint8Array = m.body;
  const key: string = m.routingKey;
  console.log(body, key, routed);
  break;
}
const got: Message | undefined = b.get(q);
if (got) b.nack(got, false);
b.mqttSubscribe("a/+", (m) => console.log(m.topic));
b.mqttPublish("a/b", "x");
b.setTime(b.now + 1);
// @ts-expect-error: the body must be bytes or text
b.publish("", "q", 42);
// @ts-expect-error: unknown consume option
b.consume(q, () => {}, { prefetchCount: 1 });

// The durable broker (persist.d.ts): publish resolves once stored; errors are typed.
import { StoreError, type OpenOptions, type PersistentBroker, type StoreErrorCode } from "../index.js";
const opts: OpenOptions = { persist: "indexeddb", name: "field-log", durability: "strict", lock: "wait" };
const pb: PersistentBroker = await Broker.open(opts);
pb.declareQueue("outbox", { durable: true });
const stored: boolean = await pb.publish("", "outbox", "reading 1", { persistent: true });
const retained: Promise<boolean> = pb.mqttPublish("a/b", "x", { retain: true });
pb.on("error", (e: StoreError) => {
  const code: StoreErrorCode = e.code;
  console.log(code, e.skipped, e.count, stored, retained);
});
await pb.flush();
await pb.close();
try {
  await Broker.open({ persist: "indexeddb", skipCorrupt: true });
} catch (e) {
  if (e instanceof StoreError && e.code === "corrupt") console.log(e.skipped?.length);
}
// @ts-expect-error: a persistent publish is a promise, not a boolean
const notBool: boolean = pb.publish("", "outbox", "x");
// @ts-expect-error: only IndexedDB
await Broker.open({ persist: "opfs" });
// Another tab's broker: the same calls, answered asynchronously.
const shared = await Broker.open({ persist: "indexeddb", name: "field-log", lock: "share" });
const n: number | undefined = await shared.queueLength("outbox");
const ok: boolean = await shared.publish("", "outbox", "from another tab", { persistent: true });
console.log(n, ok);
