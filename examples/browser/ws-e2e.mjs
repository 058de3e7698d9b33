// MQTT over WebSocket in a real browser: `warren serve` (WARREN_BIN, default
// ../../target/debug/warren) with ws and wss listeners; MQTT.js (the npm package's browser
// build, served from node_modules: no CDN) in headless Chromium connects over ws:// and
// wss://, subscribes, and must receive what a native MQTT client (MQTT.js over TCP in Node)
// and an AMQP client (amqplib, to amq.topic) publish. Saves a screenshot.
// `node ws-e2e.mjs [screenshot.png]`; exits non-zero on failure.
import { chromium } from "playwright-core";
import { spawn, execFileSync } from "node:child_process";
import { createServer } from "node:http";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";
import mqtt from "mqtt";
import amqp from "amqplib";

const here = dirname(fileURLToPath(import.meta.url));
const shot = process.argv[2] ?? "browser-ws-e2e.png";
const bin = process.env.WARREN_BIN ?? join(here, "../../target/debug/warren");
const dir = mkdtempSync(join(tmpdir(), "warren-ws-e2e-"));

// A self-signed certificate for wss (Chromium is told to accept it).
execFileSync("openssl", [
  "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
  "-keyout", join(dir, "key.pem"), "-out", join(dir, "cert.pem"),
], { stdio: "ignore" });

const broker = spawn(bin, [
  "serve", "--in-memory", "--data-dir", join(dir, "data"),
  "--amqp", "127.0.0.1:0", "--mqtt", "127.0.0.1:0",
  "--mqtt-ws", "127.0.0.1:0", "--mqtt-wss", "127.0.0.1:0",
  "--tls-cert", join(dir, "cert.pem"), "--tls-key", join(dir, "key.pem"),
  // Every listener this test does not use is off: another broker may hold the defaults.
  "--management", "none", "--prometheus", "none", "--stream", "none",
], { env: { ...process.env, RUST_LOG: "info" }, stdio: ["ignore", "pipe", "inherit"] });
const ports = await new Promise((resolve, reject) => {
  const found = {};
  const timer = setTimeout(() => reject(new Error("warren serve did not log its listeners")), 20_000);
  createInterface({ input: broker.stdout }).on("line", (line) => {
    const m = line.match(/listening on 127\.0\.0\.1:(\d+) (.*)/);
    if (!m) return;
    const kind = m[2].startsWith("(AMQP") ? "amqp" : m[2].startsWith("(MQTT") ? "mqtt"
      : m[2].includes("mqtt-wss") ? "wss" : m[2].includes("mqtt-ws") ? "ws" : null;
    if (kind) found[kind] = Number(m[1]);
    if (Object.keys(found).length === 4) {
      clearTimeout(timer);
      resolve(found);
    }
  });
  broker.on("exit", (code) => reject(new Error(`warren serve exited with ${code}`)));
});

// The page: MQTT.js's browser build, one client per URL, every message into a list.
const page = `<!doctype html><meta charset="utf-8"><title>MQTT over WebSocket</title>
<h1>MQTT.js over Warren's WebSocket listeners</h1><ul id="log"></ul>
<script src="/mqtt.min.js"></script>
<script>
  window.received = [];
  window.subscribed = 0;
  for (const url of ${JSON.stringify([`ws://127.0.0.1:${ports.ws}/mqtt`, `wss://localhost:${ports.wss}/mqtt`])}) {
    const client = mqtt.connect(url, { clientId: "browser-" + url.slice(0, 3), reconnectPeriod: 0 });
    client.on("connect", () => client.subscribe("browser/#", { qos: 1 }, () => window.subscribed++));
    client.on("message", (topic, payload) => {
      const line = url.split(":")[0] + " " + topic + ": " + payload.toString();
      window.received.push(line);
      const li = document.createElement("li");
      li.textContent = line;
      document.getElementById("log").appendChild(li);
    });
    client.on("error", (e) => console.error(url + " " + e.message));
  }
</script>`;
const bundle = readFileSync(join(here, "node_modules/mqtt/dist/mqtt.min.js"));
const http = createServer((req, res) => {
  if (req.url === "/mqtt.min.js") {
    res.writeHead(200, { "content-type": "text/javascript" }).end(bundle);
  } else {
    res.writeHead(200, { "content-type": "text/html" }).end(page);
  }
});
await new Promise((r) => http.listen(0, "127.0.0.1", r));

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  args: ["--no-sandbox", "--ignore-certificate-errors"],
});
let failed = false;
// A client step that gets no answer fails naming it (the catch below reports it), instead of
// running into the CI step's outer `timeout 120`.
const within = (what, promise, ms = 10_000) => {
  let timer;
  const expiry = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`no ${what} within ${ms} ms`)), ms);
  });
  return Promise.race([promise, expiry]).finally(() => clearTimeout(timer));
};
try {
  const tab = await browser.newPage();
  const errors = [];
  tab.on("pageerror", (e) => errors.push(String(e)));
  tab.on("console", (m) => m.type() === "error" && errors.push(m.text()));
  await tab.goto(`http://127.0.0.1:${http.address().port}/`);
  await tab.waitForFunction(() => window.subscribed === 2, null, { timeout: 10_000 });

  const native = mqtt.connect(`mqtt://127.0.0.1:${ports.mqtt}`, { clientId: "native" });
  await within("MQTT CONNACK", new Promise((r, j) => { native.on("connect", r); native.on("error", j); }));
  await within("MQTT PUBACK", native.publishAsync("browser/native", "from MQTT over TCP", { qos: 1 }));
  await within("MQTT disconnect", native.endAsync());
  const conn = await within("AMQP connection.open-ok", amqp.connect(`amqp://guest:guest@127.0.0.1:${ports.amqp}`));
  const ch = await within("AMQP channel.open-ok and confirm.select-ok", conn.createConfirmChannel());
  ch.publish("amq.topic", "browser.amqp", Buffer.from("from AMQP"));
  await within("AMQP publisher confirm", ch.waitForConfirms());
  await within("AMQP connection.close-ok", conn.close());

  const want = [
    "ws browser/native: from MQTT over TCP", "wss browser/native: from MQTT over TCP",
    "ws browser/amqp: from AMQP", "wss browser/amqp: from AMQP",
  ];
  await tab.waitForFunction((n) => window.received.length >= n, want.length, { timeout: 10_000 });
  const got = await tab.evaluate(() => window.received);
  await tab.screenshot({ path: shot, fullPage: true });
  console.log("received in the browser:", got);
  console.log("screenshot:", shot);
  if (JSON.stringify([...got].sort()) !== JSON.stringify([...want].sort())) {
    console.error("FAIL: expected", want);
    failed = true;
  }
  if (errors.length) {
    console.error("FAIL: page errors", errors);
    failed = true;
  }
} catch (e) {
  console.error("FAIL:", e);
  failed = true;
} finally {
  await browser.close();
  http.close();
  broker.kill("SIGTERM");
  rmSync(dir, { recursive: true, force: true });
}
process.exit(failed ? 1 : 0);
