// The broker runs in this tab: one publisher, two subscribers. Served by serve.mjs, which
// maps /pkg/ to the npm package in wasm/js.
import { init, Broker } from "/pkg/index.js";

const $ = (id) => document.getElementById(id);
const show = (list, text) => {
  const li = document.createElement("li");
  li.textContent = text;
  $(list).append(li);
};

await init();
// Time comes from the host: the page's clock.
const broker = new Broker(1, Date.now());

// Subscriber A: MQTT-style filter with a callback.
broker.mqttSubscribe("home/+/temp", (m) => {
  show("sub-a", `${m.topic}: ${new TextDecoder().decode(m.payload)}`);
});

// Subscriber B: an AMQP queue bound to amq.topic, read with an async iterator, acked.
broker.declareQueue("b", { exclusive: true });
broker.bindQueue("b", "amq.topic", "home.#");
(async () => {
  for await (const m of broker.messages("b")) {
    show("sub-b", `${m.routingKey}: ${new TextDecoder().decode(m.body)}`);
    broker.ack(m);
  }
})();

let count = 0;
$("publish").addEventListener("click", () => {
  broker.setTime(Date.now());
  const routed = broker.mqttPublish($("topic").value, $("payload").value);
  $("published").textContent = `published ${++count} (${routed ? "routed" : "no subscriber"})`;
});
$("publish").disabled = false;
$("status").textContent = "broker running in this tab";
