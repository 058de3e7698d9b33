// rhea (npm, a JavaScript AMQP 1.0 client nobody here wrote) against a running `warren
// serve`: RabbitMQ 4's management node over a link pair, then publish and consume on v2
// addresses. Broker address from WARREN_AMQP (host:port), default 127.0.0.1:5672.
//
// rhea comes from examples/browser's lockfile (scripts/test.sh `setup_npm`).
import { test } from "node:test";
import assert from "node:assert/strict";
import { createRequire } from "node:module";
import { randomUUID } from "node:crypto";

const require = createRequire(new URL("../../examples/browser/package.json", import.meta.url));
const rhea = require("rhea");

const [HOST, PORT] = (process.env.WARREN_AMQP ?? "127.0.0.1:5672").split(/:(?=\d+$)/);

/** Resolves with the first `event` of `emitter` (rejects on an error event or after `ms`). */
function once(emitter, event, ms = 10000) {
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no ${event} within ${ms} ms`)), ms);
    const fail = (ctx) => {
      clearTimeout(timer);
      reject(new Error(`${event}: ${JSON.stringify(ctx?.link?.error ?? ctx?.connection?.error ?? ctx?.error ?? "error")}`));
    };
    emitter.once(event, (ctx) => {
      clearTimeout(timer);
      emitter.removeListener("receiver_error", fail);
      emitter.removeListener("sender_error", fail);
      resolve(ctx);
    });
    emitter.once("receiver_error", fail);
    emitter.once("sender_error", fail);
  });
}

async function connect() {
  const container = rhea.create_container({ id: `rhea-${randomUUID()}` });
  const connection = container.connect({
    host: HOST,
    port: Number(PORT),
    username: "guest",
    password: "guest",
    reconnect: false,
  });
  const opened = await once(connection, "connection_open");
  return { container, connection, properties: opened.connection.remote.open.properties };
}

/** The management link pair: one name, `paired: true`; rhea finds a link's attach by its
 * name, so the halves are attached one after the other. */
async function managementPair(connection) {
  const name = `mgmt-${randomUUID()}`;
  const properties = { paired: true };
  const sender = connection.open_sender({
    name,
    target: { address: "/management" },
    source: { address: "/management" },
    snd_settle_mode: 1,
    properties,
  });
  await once(sender, "sender_open");
  const receiver = connection.open_receiver({
    name,
    source: { address: "/management" },
    target: { address: "/management" },
    snd_settle_mode: 1,
    properties,
    credit_window: 8,
  });
  await once(receiver, "receiver_open");
  const waiting = new Map();
  receiver.on("message", (ctx) => {
    const w = waiting.get(ctx.message.correlation_id);
    if (w) {
      waiting.delete(ctx.message.correlation_id);
      w(ctx.message);
    }
  });
  let next = 0;
  return {
    request(method, path, body) {
      const id = `req-${next++}`;
      return new Promise((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`no response to ${method} ${path}`)), 10000);
        waiting.set(id, (m) => {
          clearTimeout(timer);
          resolve({ status: Number(m.subject), body: m.body, message: m });
        });
        sender.send({ message_id: id, to: path, subject: method, reply_to: "$me", body });
      });
    },
  };
}

test("rhea: RabbitMQ's server properties, the management node, publish and consume", async () => {
  const { connection, properties } = await connect();
  assert.equal(properties.product, "RabbitMQ");
  assert.equal(properties["warren-product"], "Warren");
  const mgmt = await managementPair(connection);
  const q = `rhea-q-${randomUUID().slice(0, 8)}`;

  const created = await mgmt.request("PUT", `/queues/${q}`, {
    durable: true,
    arguments: { "x-queue-type": "quorum" },
  });
  assert.equal(created.status, 201);
  assert.equal(created.body.name, q);
  assert.equal(created.body.type, "quorum");
  assert.equal(created.message.correlation_id, "req-0", "correlation-id is the message-id");
  assert.equal(created.message.application_properties["http:response"], "1.1");
  assert.equal((await mgmt.request("PUT", `/queues/${q}`, { durable: true, arguments: { "x-queue-type": "quorum" } })).status, 200);
  assert.equal((await mgmt.request("PUT", `/queues/${q}`, { durable: false })).status, 409);

  const ex = `rhea-ex-${randomUUID().slice(0, 8)}`;
  assert.equal((await mgmt.request("PUT", `/exchanges/${ex}`, { type: "fanout", durable: false })).status, 204);
  const bind = { source: ex, destination_queue: q, binding_key: "", arguments: {} };
  assert.equal((await mgmt.request("POST", "/bindings", bind)).status, 204);

  // Publish 5 through the exchange, settled by the broker with accepted.
  const sender = connection.open_sender({ target: { address: `/exchanges/${ex}` } });
  await once(sender, "sendable");
  const accepted = [];
  for (let i = 0; i < 5; i++) {
    const delivery = sender.send({ body: `m${i}`, durable: true });
    accepted.push(new Promise((resolve, reject) => {
      delivery.link.once("accepted", resolve);
      delivery.link.once("rejected", reject);
    }));
  }
  await Promise.all(accepted);
  const info = await mgmt.request("GET", `/queues/${q}`);
  assert.equal(info.status, 200);
  assert.equal(Number(info.body.message_count), 5);

  // Consume 3 (accepted), then purge the other 2.
  const receiver = connection.open_receiver({ source: { address: `/queues/${q}` }, credit_window: 0, autoaccept: true });
  const got = [];
  const three = new Promise((resolve) => {
    receiver.on("message", (ctx) => {
      got.push(ctx.message.body);
      if (got.length === 3) resolve();
    });
  });
  await once(receiver, "receiver_open");
  receiver.add_credit(3);
  await three;
  // An amqp-value string body is the message body; it comes back as a data section.
  assert.deepEqual(got.map((b) => Buffer.from(b.content ?? b).toString()), ["m0", "m1", "m2"]);
  // Accepting them gave the core room for the other two, but the link has no credit left:
  // nothing more may come (rhea would log "Received transfer when credit was 0").
  await new Promise((r) => setTimeout(r, 300));
  assert.equal(got.length, 3, "no transfer beyond the link credit");
  receiver.close();
  await once(receiver, "receiver_close");
  const purged = await mgmt.request("DELETE", `/queues/${q}/messages`);
  assert.equal(purged.status, 200);
  assert.equal(Number(purged.body.message_count), 2);

  // Bad requests: their status codes, the pair still serving.
  assert.equal((await mgmt.request("GET", "/nodes")).status, 404);
  assert.equal((await mgmt.request("PATCH", `/queues/${q}`)).status, 405);
  assert.equal((await mgmt.request("GET", `/queues/${q}-missing`)).status, 404);
  assert.equal((await mgmt.request("PUT", "/queues/amq.nope", {})).status, 403);

  assert.equal((await mgmt.request("DELETE", `/queues/${q}`)).status, 200);
  assert.equal((await mgmt.request("DELETE", `/exchanges/${ex}`)).status, 204);
  connection.close();
  await once(connection, "connection_close");
});

test("rhea: an unpaired attach to /management is refused with invalid-field", async () => {
  const { connection } = await connect();
  const sender = connection.open_sender({ target: { address: "/management" } });
  const closed = await new Promise((resolve) => sender.once("sender_close", resolve));
  assert.equal(closed.sender.error?.condition, "amqp:invalid-field");
  connection.close();
  await once(connection, "connection_close");
});
