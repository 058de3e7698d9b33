// The durable broker in headless Chromium (Debian's /usr/bin/chromium, driven by
// playwright-core), with a persistent profile so IndexedDB outlives the browser:
// 1. a page opens `Broker.open({ persist: "indexeddb" })`, publishes 10,000 persistent
//    100-byte messages awaiting each batch (publish rate measured), is reloaded, and finds
//    all 10,000 in order;
// 2. a second tab opening the same store gets the "locked" error, or with lock: "share" uses
//    the first tab's broker over BroadcastChannel, or with lock: "wait" opens it once freed;
// 3. a page publishes in a loop and the browser process is killed (SIGKILL) mid-write; after
//    a restart every publish whose promise resolved before the kill is there, in order.
// `node persist-e2e.mjs`; exits non-zero on failure.
import { chromium } from "playwright-core";
import { mkdtemp, rm, readdir, readFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { serve } from "./serve.mjs";

const N = 10_000;
const BATCH = 1_000;
const server = await serve(0);
const url = `http://127.0.0.1:${server.address().port}/persist-e2e.html`;
const profile = await mkdtemp(join(tmpdir(), "warren-persist-e2e-"));
const launch = () =>
  chromium.launchPersistentContext(profile, {
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--no-sandbox"],
  });
const failures = [];
const check = (ok, what) => {
  console.log(`${ok ? "ok" : "FAIL"}: ${what}`);
  if (!ok) failures.push(what);
};

async function page(ctx) {
  const p = await ctx.newPage();
  p.on("pageerror", (e) => failures.push(`page error: ${e}`));
  await p.goto(url);
  await p.waitForFunction(() => window.ready === true, null, { timeout: 10_000 });
  return p;
}

// The browser's main process (the one without --type=) of our profile.
async function browserPid() {
  for (const pid of await readdir("/proc")) {
    if (!/^\d+$/.test(pid)) continue;
    const cmd = await readFile(`/proc/${pid}/cmdline`, "utf8").catch(() => "");
    if (cmd.includes(`--user-data-dir=${profile}`) && !cmd.includes("--type=")) return Number(pid);
  }
  return undefined;
}

let ctx = await launch();
try {
  // 1. publish, reload, find them all.
  let p = await page(ctx);
  const run = await p.evaluate(
    async ({ N, BATCH }) => {
      const b = await window.Broker.open({ persist: "indexeddb", name: "e2e" });
      b.declareQueue("outbox", { durable: true });
      const pad = "x".repeat(100);
      const t0 = performance.now();
      for (let i = 0; i < N; i += BATCH) {
        const batch = [];
        for (let j = i; j < i + BATCH; j++) {
          const body = `${String(j).padStart(6, "0")} ${pad}`.slice(0, 100);
          batch.push(b.publish("", "outbox", body, { persistent: true }));
        }
        await Promise.all(batch);
      }
      const ms = performance.now() - t0;
      // The same with relaxed durability (no flush to disk before commit), for the record.
      const r = await window.Broker.open({ persist: "indexeddb", name: "e2e-relaxed", durability: "relaxed" });
      r.declareQueue("outbox", { durable: true });
      const t1 = performance.now();
      for (let i = 0; i < N; i += BATCH) {
        const batch = [];
        for (let j = i; j < i + BATCH; j++) batch.push(r.publish("", "outbox", pad, { persistent: true }));
        await Promise.all(batch);
      }
      const relaxedMs = performance.now() - t1;
      // And the in-memory broker, the cost without IndexedDB.
      const m = new window.Broker(1);
      m.declareQueue("outbox", { durable: true });
      const t2 = performance.now();
      for (let j = 0; j < N; j++) m.publish("", "outbox", pad, { persistent: true });
      const memoryMs = performance.now() - t2;
      return { ms, relaxedMs, memoryMs, length: b.queueLength("outbox") };
    },
    { N, BATCH },
  );
  const rate = Math.round(N / (run.ms / 1000));
  console.log(
    `publish with persistence (strict): ${N} x 100 B in ${run.ms.toFixed(0)} ms = ${rate} msg/s; ` +
      `relaxed: ${Math.round(N / (run.relaxedMs / 1000))} msg/s; in memory: ${Math.round(N / (run.memoryMs / 1000))} msg/s`,
  );
  check(run.length === N, `${N} messages in the queue before the reload`);
  await p.reload();
  await p.waitForFunction(() => window.ready === true, null, { timeout: 10_000 });
  const after = await p.evaluate(async () => {
    const b = await window.Broker.open({ persist: "indexeddb", name: "e2e" });
    const got = [];
    for (let m; (m = b.get("outbox")); ) {
      got.push(Number(new TextDecoder().decode(m.body).slice(0, 6)));
      b.ack(m);
    }
    await b.close();
    return got;
  });
  check(after.length === N && after.every((v, i) => v === i), `all ${N} back in order after the reload (${after.length})`);

  // 2. one broker per store: a second tab gets "locked".
  const holder = await page(ctx);
  await holder.evaluate(async () => {
    window.held = await window.Broker.open({ persist: "indexeddb", name: "shared" });
  });
  const second = await page(ctx);
  const code = await second.evaluate(() =>
    window.Broker.open({ persist: "indexeddb", name: "shared" }).then(
      () => "opened",
      (e) => e.code,
    ),
  );
  check(code === "locked", `a second tab opening the same store is refused: ${code}`);
  // ... or, with lock: "share", uses the first tab's broker over BroadcastChannel.
  const shared = await second.evaluate(async () => {
    const tab = await window.Broker.open({ persist: "indexeddb", name: "shared", lock: "share" });
    await tab.declareQueue("both", { durable: true });
    const routed = await tab.publish("", "both", "from the second tab", { persistent: true });
    const got = [];
    await tab.consume("both", (m) => {
      got.push(new TextDecoder().decode(m.body));
      tab.ack(m);
    });
    await new Promise((r) => setTimeout(r, 200));
    await tab.close();
    return { routed, got };
  });
  const leaderSaw = await holder.evaluate(async () => {
    await window.held.publish("", "both", "from the first tab", { persistent: true });
    return window.held.queueLength("both");
  });
  check(
    shared.routed === true && shared.got.join() === "from the second tab" && leaderSaw === 1,
    `a second tab shares the first one's broker (lock: "share"): ${JSON.stringify(shared)}, leader's queue ${leaderSaw}`,
  );
  const waited = second.evaluate(() =>
    window.Broker.open({ persist: "indexeddb", name: "shared", lock: "wait" }).then(() => "opened"),
  );
  await holder.evaluate(() => window.held.close());
  check((await waited) === "opened", "with lock: 'wait' it opens once the first tab closes it");

  // 3. killed mid-write.
  p = await page(ctx);
  let confirmed = -1;
  await p.exposeFunction("confirmed", (n) => (confirmed = Math.max(confirmed, n)));
  await p.evaluate(async () => {
    const b = await window.Broker.open({ persist: "indexeddb", name: "kill" });
    b.declareQueue("q", { durable: true });
    let i = 0;
    (async () => {
      for (;;) {
        const batch = [];
        for (let j = 0; j < 200; j++, i++) {
          const n = i;
          batch.push(b.publish("", "q", String(n), { persistent: true }).then(() => window.confirmed(n)));
        }
        await Promise.all(batch);
      }
    })();
  });
  const t0 = Date.now();
  while (confirmed < 3000 && Date.now() - t0 < 30_000) await new Promise((r) => setTimeout(r, 5));
  const pid = await browserPid();
  const seen = confirmed;
  process.kill(pid, "SIGKILL");
  console.log(`killed the browser (pid ${pid}) with ${seen + 1} publishes confirmed`);
  await ctx.close().catch(() => {});
  ctx = await launch();
  p = await page(ctx);
  const kept = await p.evaluate(async () => {
    const b = await window.Broker.open({ persist: "indexeddb", name: "kill" });
    const got = [];
    for (let m; (m = b.get("q")); ) got.push(Number(new TextDecoder().decode(m.body)));
    return got;
  });
  check(seen >= 3000, `the loop got to ${seen + 1} confirmed publishes`);
  check(kept.length > seen && kept.every((v, i) => v === i), `after the kill: ${kept.length} kept, in order, every confirmed one (${seen + 1}) among them`);
} catch (e) {
  failures.push(String(e?.stack ?? e));
} finally {
  await ctx.close().catch(() => {});
  server.close();
  await rm(profile, { recursive: true, force: true });
}
if (failures.length) console.error("FAIL:", failures);
process.exit(failures.length ? 1 : 0);
