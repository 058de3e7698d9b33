// A real `warren serve` for the tab link's tests (link.test.mjs, examples/browser/link-e2e.mjs):
// AMQP and MQTT-over-WebSocket on loopback, every other listener off (another broker may hold
// the default ports), a data dir that survives `restart()`. WARREN_BIN overrides the binary
// (default target/debug/warren of this tree). Importing this file starts nothing.
import { spawn, execFileSync } from "node:child_process";
import { createServer } from "node:net";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, dirname } from "node:path";
import { fileURLToPath } from "node:url";
import { createInterface } from "node:readline";

const repo = join(dirname(fileURLToPath(import.meta.url)), "../../..");
export const warrenBin = process.env.WARREN_BIN ?? join(repo, "target/debug/warren");

/** A loopback port free now (for a server started later on a URL known in advance). */
export async function freePort() {
  const s = createServer();
  await new Promise((r) => s.listen(0, "127.0.0.1", r));
  const { port } = s.address();
  await new Promise((r) => s.close(r));
  return port;
}

export class Warren {
  /** `ports`: `{ amqp, ws }`, 0 for any (kept across restarts once bound). */
  constructor({ amqp = 0, ws = 0 } = {}) {
    this.dir = mkdtempSync(join(tmpdir(), "warren-link-"));
    this.ports = { amqp, ws };
    this.proc = null;
  }

  async start() {
    const args = [
      "serve", "--data-dir", join(this.dir, "data"),
      "--amqp", `127.0.0.1:${this.ports.amqp}`, "--mqtt-ws", `127.0.0.1:${this.ports.ws}`,
      "--mqtt", "none", "--management", "none", "--prometheus", "none", "--stream", "none",
    ];
    const proc = spawn(warrenBin, args, { env: { ...process.env, RUST_LOG: "info" }, stdio: ["ignore", "pipe", "pipe"] });
    this.proc = proc;
    this.log = [];
    proc.stderr.on("data", (d) => this.log.push(String(d)));
    const found = await new Promise((resolve, reject) => {
      const got = {};
      const timer = setTimeout(() => reject(new Error(`warren serve did not log its listeners:\n${this.log.join("")}`)), 20_000);
      createInterface({ input: proc.stdout }).on("line", (line) => {
        this.log.push(line + "\n");
        const m = line.match(/listening on 127\.0\.0\.1:(\d+) (.*)/);
        if (!m) return;
        if (m[2].startsWith("(AMQP")) got.amqp = Number(m[1]);
        else if (m[2].includes("mqtt-ws")) got.ws = Number(m[1]);
        if (got.amqp && got.ws) { clearTimeout(timer); resolve(got); }
      });
      proc.on("exit", (code) => { clearTimeout(timer); reject(new Error(`warren serve exited with ${code}:\n${this.log.join("")}`)); });
    });
    this.ports = found;
    return this;
  }

  get wsUrl() { return `ws://127.0.0.1:${this.ports.ws}/mqtt`; }
  get amqpUrl() { return `amqp://guest:guest@127.0.0.1:${this.ports.amqp}`; }

  /** Stops it (SIGTERM, or `signal`) and waits for the exit. */
  async stop(signal = "SIGTERM") {
    const proc = this.proc;
    if (!proc || proc.exitCode !== null) return;
    this.proc = null;
    await new Promise((r) => { proc.once("exit", r); proc.kill(signal); });
  }

  async restart(signal) {
    await this.stop(signal);
    return this.start();
  }

  /** `warren ctl` against this server's data dir. */
  ctl(...args) {
    return execFileSync(warrenBin, ["ctl", "--data-dir", join(this.dir, "data"), ...args], { encoding: "utf8" });
  }

  async close() {
    await this.stop();
    rmSync(this.dir, { recursive: true, force: true });
  }
}
