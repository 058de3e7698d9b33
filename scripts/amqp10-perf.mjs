// A quick AMQP 1.0 throughput run with rhea (npm, examples/browser's lockfile): 1 sender,
// 1 receiver (two connections), one durable classic queue declared through the management node, durable
// messages of SIZE bytes, at most CREDIT unsettled publishes (PerfTest's -c) and a receiver
// credit of CREDIT (PerfTest's -q), COUNT messages. Prints one JSON line.
//   node scripts/amqp10-perf.mjs [host:port] [count] [size] [credit]
import { createRequire } from "node:module";
import { randomUUID } from "node:crypto";

const require = createRequire(new URL("../examples/browser/package.json", import.meta.url));
const rhea = require("rhea");

const [HOST, PORT] = (process.argv[2] ?? "127.0.0.1:5672").split(/:(?=\d+$)/);
const COUNT = Number(process.argv[3] ?? 100000);
const SIZE = Number(process.argv[4] ?? 12);
const CREDIT = Number(process.argv[5] ?? 200);
const queue = `perf-amqp10-${randomUUID().slice(0, 8)}`;

// Two connections, as PerfTest's producer and consumer have.
const open = () =>
  rhea.create_container({ id: `perf-${randomUUID()}` }).connect({
    host: HOST, port: Number(PORT), username: "guest", password: "guest", reconnect: false,
  });
const connection = open();
const consuming = open();
const bound = setTimeout(() => {
  console.error(`perf: not done within 300 s`);
  process.exit(1);
}, 300000);

function event(emitter, name) {
  return new Promise((resolve, reject) => {
    emitter.once(name, resolve);
    emitter.once("error", reject);
  });
}

async function management(method, path, body) {
  const name = `perf-mgmt-${randomUUID()}`;
  const opts = { name, snd_settle_mode: 1, properties: { paired: true } };
  const s = connection.open_sender({ ...opts, target: { address: "/management" } });
  await event(s, "sender_open");
  const r = connection.open_receiver({ ...opts, source: { address: "/management" } });
  await event(r, "receiver_open");
  const answer = event(r, "message");
  s.send({ message_id: "1", to: path, subject: method, reply_to: "$me", body });
  const { message } = await answer;
  s.close();
  r.close();
  return Number(message.subject);
}

await Promise.all([event(connection, "connection_open"), event(consuming, "connection_open")]);
const status = await management("PUT", `/queues/${queue}`, {
  durable: true, arguments: { "x-queue-type": "classic" },
});
if (status !== 201) throw new Error(`declare answered ${status}`);

const body = Buffer.alloc(SIZE, 0x61);
let received = 0;
let accepted = 0;
let sent = 0;
const start = process.hrtime.bigint();
let publishedAt = null;

const receiver = consuming.open_receiver({
  source: { address: `/queues/${queue}` }, credit_window: CREDIT, autoaccept: true,
});
const done = new Promise((resolve) => {
  receiver.on("message", () => {
    received++;
    if (received === COUNT) resolve(process.hrtime.bigint());
  });
});

const sender = connection.open_sender({ target: { address: `/queues/${queue}` } });
function pump() {
  while (sent < COUNT && sent - accepted < CREDIT && sender.sendable()) {
    sender.send({ body: rhea.message.data_section(body), durable: true });
    sent++;
  }
}
sender.on("sendable", pump);
sender.on("accepted", () => {
  accepted++;
  if (accepted === COUNT) publishedAt = process.hrtime.bigint();
  pump();
});
sender.on("rejected", (ctx) => {
  console.error("rejected", ctx.delivery.remote_state);
  process.exit(1);
});

const end = await done;
const secs = (t) => Number(t - start) / 1e9;
const all = secs(end);
console.log(JSON.stringify({
  client: "rhea 3.0.5", protocol: "AMQP 1.0", count: COUNT, size: SIZE, credit: CREDIT,
  publish_rate: Math.round(COUNT / secs(publishedAt ?? end)),
  consume_rate: Math.round(COUNT / all),
  seconds: Number(all.toFixed(2)),
}));
clearTimeout(bound);
await management("DELETE", `/queues/${queue}`);
connection.close();
consuming.close();
await Promise.all([event(connection, "connection_close"), event(consuming, "connection_close")]);
