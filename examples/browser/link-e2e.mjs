// The tab link in headless Chromium (Debian's /usr/bin/chromium via playwright-core) against a
// real `warren serve` (WARREN_BIN): the page's broker publishes 10,000 messages into its
// outbox while the server is down; the server starts; an AMQP consumer on the server
// (amqplib) must get all 10,000 exactly once and in order. Then a network drop (Chromium's
// offline emulation) while the server publishes to field/commands/x: after the network is
// back, the message is in the tab's inbox. Reports the forwarding rate.
// `node link-e2e.mjs [screenshot.png]`; exits non-zero on failure.
//
// The reload step of issue 39 (publish, reload, then forward) needs the durable store:
// `RELOAD=1` opens the page's broker with `Broker.open({ persist: "indexeddb" })`, awaits each
// publish, and reloads the page before the server starts (the reopened broker must forward
// all 10,000). Without the store it fails (the reload loses the outbox), so it is off.
import { chromium } from "playwright-core";
import amqp from "amqplib";
import { serve } from "./serve.mjs";
import { Warren, freePort } from "../../wasm/js/test/warren-server.mjs";

const shot = process.argv[2] ?? "browser-link-e2e.png";
const N = 10_000;
const within = (what, promise, ms = 30_000) => {
  let timer;
  const expiry = new Promise((_, reject) => { timer = setTimeout(() => reject(new Error(`no ${what} within ${ms} ms`)), ms); });
  return Promise.race([promise, expiry]).finally(() => clearTimeout(timer));
};

// The server's port is chosen before it runs: the page's link points at it while it is down.
const warren = new Warren({ amqp: await freePort(), ws: await freePort() });
await warren.start();
{
  // The server's queue for field/log, durable: it outlives the stop below.
  const conn = await amqp.connect(warren.amqpUrl);
  const ch = await conn.createChannel();
  await ch.assertQueue("field-log", { durable: true });
  await ch.bindQueue("field-log", "amq.topic", "field.log");
  await conn.close();
}
await warren.stop();

const http = await serve(0);
const origin = `http://127.0.0.1:${http.address().port}`;
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  args: ["--no-sandbox"],
});
let failed = false;
const fail = (...why) => { console.error("FAIL:", ...why); failed = true; };

// Runs in the page: the package from /pkg/, a broker, the link (kept on window).
async function openBroker({ url, n, persist }) {
  const { init, Broker } = await import("/pkg/index.js");
  await import("/pkg/link.js");
  await init();
  const b = persist ? await Broker.open({ persist: "indexeddb", name: "field-log" }) : new Broker(1, Date.now());
  b.declareQueue("outbox", { durable: true });
  const t0 = performance.now();
  for (let i = 0; i < n; i++) await b.publish("", "outbox", `reading ${i}`, { persistent: true });
  const publishMs = performance.now() - t0;
  const link = b.connect({
    url, keepAlive: 2, reconnect: { min: 100, max: 1000 },
    forward: [{ queue: "outbox", topic: "field/log" }],
    subscribe: [{ topic: "field/commands/#", queue: "inbox" }],
  });
  window.log = [];
  link.on("state", (s) => { window.log.push([performance.now(), s]); if (s === "up" && !window.upAt) window.upAt = performance.now(); });
  link.on("error", (e) => window.log.push([performance.now(), `error ${e.code}: ${e.message}`]));
  Object.assign(window, { b, link, publishMs });
  return publishMs;
}

try {
  const context = await browser.newContext();
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  // Any page of the origin (a text file): the evaluated function imports the package.
  await page.goto(`${origin}/pkg/index.d.ts`);
  const persist = Boolean(process.env.RELOAD);
  const publishMs = await page.evaluate(openBroker, { url: warren.wsUrl, n: N, persist });
  console.log(`page: ${N} messages into the outbox in ${publishMs.toFixed(0)} ms while the server is down`);
  if (persist) {
    await page.reload();
    await page.evaluate(openBroker, { url: warren.wsUrl, n: 0, persist });
    console.log("page reloaded: the outbox comes back from IndexedDB");
  }
  await page.waitForTimeout(500);
  const outboxBefore = await page.evaluate(() => window.b.queueLength("outbox"));
  if (outboxBefore !== N) fail(`outbox holds ${outboxBefore} while the server is down`);

  await warren.start();
  await page.waitForFunction(() => window.b.queueLength("outbox") === 0 && window.link.inflight === 0 && window.upAt,
    null, { timeout: 60_000 });
  const forwardMs = await page.evaluate(() => performance.now() - window.upAt);
  console.log(`forwarded ${N} in ${forwardMs.toFixed(0)} ms after the link came up: ${Math.round(N / (forwardMs / 1000))} msg/s (Chromium, loopback)`);

  const conn = await within("AMQP connect", amqp.connect(warren.amqpUrl));
  const ch = await conn.createConfirmChannel();
  const got = [];
  for (;;) {
    const m = await ch.get("field-log", { noAck: true });
    if (!m) break;
    got.push(m.content.toString());
  }
  const bad = got.findIndex((s, i) => s !== `reading ${i}`);
  if (got.length !== N || bad !== -1) fail(`server got ${got.length} (first out of order at ${bad}: ${got[bad]})`);
  else console.log(`server consumer: all ${N} exactly once, in order`);

  // A network drop: offline emulation, then a server publish, then back online.
  await page.waitForFunction(() => window.link.state === "up");
  await context.setOffline(true);
  const t0 = Date.now();
  await page.waitForFunction(() => window.link.state !== "up", null, { timeout: 15_000 });
  console.log(`offline: link ${await page.evaluate(() => window.link.state)} after ${Date.now() - t0} ms`);
  ch.publish("amq.topic", "field.commands.x", Buffer.from("stop pump 3"), { persistent: true });
  await within("publisher confirm", ch.waitForConfirms());
  await page.waitForTimeout(1000);
  const early = await page.evaluate(() => window.b.queueLength("inbox"));
  if (early !== 0) fail(`the inbox got the command while offline (${early})`);
  await context.setOffline(false);
  await page.waitForFunction(() => window.b.queueLength("inbox") === 1, null, { timeout: 20_000 });
  const cmd = await page.evaluate(() => {
    const m = window.b.get("inbox", { noAck: true });
    return [new TextDecoder().decode(m.body), m.properties.headers["x-link-topic"]];
  });
  if (cmd[0] !== "stop pump 3" || cmd[1] !== "field/commands/x") fail("inbox message", cmd);
  else console.log("inbox after the network came back:", cmd);
  await conn.close();

  const log = await page.evaluate(() => window.log.map(([t, s]) => `${t.toFixed(0)} ${s}`));
  console.log("link log:", log.join(" | "));
  await page.evaluate((lines) => {
    document.body.innerHTML = `<h1>Tab link</h1><pre>${lines.join("\n")}</pre>`;
  }, log);
  await page.screenshot({ path: shot });
  await page.evaluate(() => window.link.close());
  if (errors.length) fail("page errors", errors);
} catch (e) {
  fail(e);
} finally {
  await browser.close();
  http.close();
  await warren.close();
}
process.exit(failed ? 1 : 0);
