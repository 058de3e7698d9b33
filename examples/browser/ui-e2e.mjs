// The management web UI in a real browser: `warren serve` (WARREN_BIN, default
// ../../target/debug/warren) with its HTTP listener; headless Chromium logs in, declares a
// queue, publishes and gets a message from the UI, watches the rate chart move while an AMQP
// client (amqplib) publishes, and closes that client's connection from the UI (the client
// must see the close). Also: a wrong password is refused, and a queue whose name is HTML is
// shown as text, not run. Saves screenshots: `node ui-e2e.mjs [screenshot-prefix]`.
import { chromium } from "playwright-core";
import { spawn } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import amqp from "amqplib";

const here = dirname(fileURLToPath(import.meta.url));
const prefix = process.argv[2] ?? "ui-e2e";
const bin = process.env.WARREN_BIN ?? join(here, "../../target/debug/warren");
const dir = mkdtempSync(join(tmpdir(), "warren-ui-e2e-"));

const broker = spawn(bin, [
  "serve", "--in-memory", "--data-dir", join(dir, "data"),
  "--amqp", "127.0.0.1:0", "--mqtt", "127.0.0.1:0",
  "--management", "127.0.0.1:0", "--prometheus", "none", "--stream", "none",
], { env: { ...process.env, RUST_LOG: "info" }, stdio: ["ignore", "pipe", "inherit"] });
const ports = await new Promise((resolve, reject) => {
  const found = {};
  const timer = setTimeout(() => reject(new Error("warren serve did not log its listeners")), 20_000);
  createInterface({ input: broker.stdout }).on("line", (line) => {
    const m = line.match(/listening on 127\.0\.0\.1:(\d+) (.*)/);
    if (!m) return;
    const kind = m[2].startsWith("(AMQP") ? "amqp" : m[2].startsWith("(HTTP") ? "http" : null;
    if (kind) found[kind] = Number(m[1]);
    if (found.amqp && found.http) {
      clearTimeout(timer);
      resolve(found);
    }
  });
  broker.on("exit", (code) => reject(new Error(`warren serve exited with ${code}`)));
});

const check = (cond, what) => {
  if (!cond) throw new Error(`check failed: ${what}`);
  console.log("ok:", what);
};

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  args: ["--no-sandbox"],
});
let failed = false;
let publisher;
try {
  const tab = await browser.newPage({ viewport: { width: 1400, height: 900 } });
  const errors = [];
  tab.on("pageerror", (e) => errors.push(String(e)));
  const base = `http://127.0.0.1:${ports.http}/?refresh=1000`;
  await tab.goto(base);

  // A wrong password is refused on the login form.
  await tab.fill("#login input[name=username]", "guest");
  await tab.fill("#login input[name=password]", "wrong");
  await tab.click("#login button[type=submit]");
  await tab.waitForFunction(() => document.querySelector("#login-error").textContent.length > 0, null, { timeout: 5_000 });
  check(await tab.isVisible("#login"), "a wrong password keeps the login form up with an error");

  // Log in.
  await tab.fill("#login input[name=password]", "guest");
  await tab.click("#login button[type=submit]");
  await tab.waitForSelector(".tile", { timeout: 10_000 });
  check(await tab.isVisible("#top"), "guest logs in and sees the overview");

  // Declare a queue from the UI.
  await tab.goto(`${base}#/queues`);
  await tab.waitForSelector("form[data-form=add-queue]");
  await tab.fill("form[data-form=add-queue] input[name=name]", "ui-orders");
  await tab.click("form[data-form=add-queue] button[type=submit]");
  await tab.waitForSelector('tr[data-queue="ui-orders"]', { timeout: 10_000 });
  check(true, "a queue declared in the UI is listed");

  // Publish from the UI and get it back.
  await tab.goto(`${base}#/queue/%2F/ui-orders`);
  await tab.waitForSelector("form[data-form=publish]");
  await tab.fill("form[data-form=publish] textarea[name=payload]", "hello from the UI");
  await tab.click("form[data-form=publish] button[type=submit]");
  await tab.waitForFunction(() => document.querySelector("#toast")?.textContent === "Message published", null, { timeout: 5_000 });
  await tab.click("form[data-form=get] button[type=submit]");
  await tab.waitForSelector(".payload", { timeout: 5_000 });
  check((await tab.textContent(".payload")) === "hello from the UI", "the message published in the UI is read back by Get messages");
  await tab.screenshot({ path: `${prefix}-queue.png`, fullPage: true });

  // An AMQP client publishes steadily: the overview's rate chart moves.
  publisher = await amqp.connect(`amqp://guest:guest@127.0.0.1:${ports.amqp}`, { clientProperties: { connection_name: "ui-e2e-publisher" } });
  let closedByServer = null;
  publisher.on("error", (e) => { closedByServer = e; });
  publisher.on("close", (e) => { closedByServer ??= e ?? new Error("closed"); });
  const ch = await publisher.createChannel();
  const html = "<img src=x onerror=window.pwned=1>";
  await ch.assertQueue(html, { durable: false });
  const pump = setInterval(() => {
    for (let i = 0; i < 50; i++) ch.sendToQueue("ui-orders", Buffer.from("from amqplib"));
  }, 50);
  await tab.goto(`${base}#/overview`);
  await tab.waitForFunction(() => {
    const rates = document.querySelector('svg[data-chart="overview.rates"]');
    const queued = document.querySelector('svg[data-chart="overview.queued"]');
    return rates && queued && Number(rates.dataset.last.split(",")[0]) > 0 && Number(queued.dataset.last.split(",")[0]) > 0
      && Number(rates.dataset.samples) >= 3;
  }, null, { timeout: 20_000 });
  clearInterval(pump);
  const last = await tab.getAttribute('svg[data-chart="overview.rates"]', "data-last");
  check(true, `the overview's publish-rate chart moves (last sample: ${last} msg/s)`);
  await tab.screenshot({ path: `${prefix}-overview.png`, fullPage: true });

  // A queue named with HTML is shown as text.
  await tab.goto(`${base}#/queues`);
  await tab.waitForSelector('tr[data-queue="ui-orders"]');
  const names = await tab.$$eval("tr[data-queue] td:nth-child(2)", (tds) => tds.map((td) => td.textContent));
  check(names.includes(html), "a queue named with HTML is listed by its literal name");
  check(await tab.evaluate(() => window.pwned === undefined), "and its name is not run as HTML");

  // Close the AMQP connection from the UI: the client sees the broker close it.
  await tab.goto(`${base}#/connections`);
  await tab.waitForSelector("tr[data-connection] button[data-act=close-connection]", { timeout: 5_000 });
  await tab.screenshot({ path: `${prefix}-connections.png`, fullPage: true });
  await tab.click("tr[data-connection] button[data-act=close-connection]");
  await tab.click("tr[data-connection] button[data-act=close-connection][data-armed='1']");
  const deadline = Date.now() + 5_000;
  while (!closedByServer && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
  check(closedByServer !== null, `the AMQP client sees its connection closed from the UI (${closedByServer?.message})`);
  publisher = null;
  await tab.waitForFunction(() => !document.querySelector("tr[data-connection]"), null, { timeout: 5_000 });
  check(true, "the connections page no longer lists it");

  check(errors.length === 0, `no page errors (${errors.join("; ")})`);
} catch (e) {
  console.error("FAIL:", e);
  failed = true;
} finally {
  await publisher?.close().catch(() => {});
  await browser.close();
  broker.kill("SIGTERM");
  rmSync(dir, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
