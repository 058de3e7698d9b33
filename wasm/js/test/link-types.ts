// Compile-only check of the tab link's types (link.d.ts), run by scripts/test.sh's ts_types.
import { Broker } from "../index.js";
import { connect, LinkError, type Link, type LinkState, type LinkErrorCode } from "../link.js";

const b = new Broker(1, Date.now());
const link: Link = b.connect({
  url: "ws://127.0.0.1:8083/mqtt", username: "guest", password: "guest",
  forward: [{ queue: "outbox", topic: "field/log", maxPending: 10_000 }],
  subscribe: [{ topic: "field/commands/#", queue: "inbox" }],
  inflight: 128, keepAlive: 20, reconnect: { min: 100, max: 10_000 },
});
link.on("state", (s: LinkState) => console.log(s));
link.on("error", (e: LinkError) => {
  const code: LinkErrorCode = e.code;
  console.log(code, e.reason, e.message);
});
link.updateToken("t");
const n: number = link.inflight + link.stats.forwarded;
console.log(n);
link.close();
const other: Link = connect(b, { url: "wss://host:8084/mqtt", token: "jwt" });
other.close();
// @ts-expect-error: a state the link never reports
const bad: LinkState = "open";
// @ts-expect-error: url is required
b.connect({ forward: [] });
// @ts-expect-error: a forward rule needs a topic
b.connect({ url: "ws://x", forward: [{ queue: "q" }] });
console.log(bad);
