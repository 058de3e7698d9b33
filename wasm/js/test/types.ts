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
