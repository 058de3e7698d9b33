// Warren's management UI: a single page over the HTTP API (`/api/...`, RabbitMQ 3.10's
// shapes), no framework and no CDN, so it works on a machine without internet. Credentials
// stay in sessionStorage and go to the API as HTTP basic auth, as RabbitMQ's UI does.
// Every value from the broker is escaped before it reaches the page (`html` below): queue,
// exchange, user and client names are client-chosen strings.
"use strict";

// ---------------------------------------------------------------------------------------
// HTML with escaping by default

class Raw { constructor(s) { this.s = s; } }
const raw = (s) => new Raw(s);
const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
function render(v) {
  if (v instanceof Raw) return v.s;
  if (Array.isArray(v)) return v.map(render).join("");
  if (v === null || v === undefined || v === false) return "";
  return esc(v);
}
function html(strings, ...values) {
  let out = strings[0];
  values.forEach((v, i) => { out += render(v) + strings[i + 1]; });
  return raw(out);
}
const $ = (sel, root = document) => root.querySelector(sel);

// ---------------------------------------------------------------------------------------
// The API

const auth = {
  get header() { return sessionStorage.getItem("warren.auth"); },
  set(user, pass) { sessionStorage.setItem("warren.auth", "Basic " + btoa(unescape(encodeURIComponent(`${user}:${pass}`)))); },
  clear() { sessionStorage.removeItem("warren.auth"); },
};

class ApiError extends Error {
  constructor(status, reason) { super(reason); this.status = status; }
}

async function api(method, path, body) {
  // X-Requested-With: the API then answers a refusal without a browser password prompt.
  const headers = { authorization: auth.header ?? "", "x-requested-with": "XMLHttpRequest" };
  if (body !== undefined) headers["content-type"] = "application/json";
  const res = await fetch("/api" + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  if (res.status === 401) { auth.clear(); showLogin("Your credentials were refused."); throw new ApiError(401, "unauthorised"); }
  const text = await res.text();
  const data = text ? JSON.parse(text) : null;
  if (!res.ok) throw new ApiError(res.status, (data && (data.reason || data.error)) || res.statusText);
  return data;
}
const get = (path) => api("GET", path);
const enc = encodeURIComponent;

// ---------------------------------------------------------------------------------------
// Formatting

const num = (n) => (n ?? 0).toLocaleString("en-US");
const rate = (d) => (d && typeof d.rate === "number" ? d.rate.toLocaleString("en-US", { maximumFractionDigits: 1 }) : "0") + "/s";
const bytes = (n) => {
  if (!n) return "0 B";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(u.length - 1, Math.floor(Math.log2(n) / 10));
  return (n / 2 ** (10 * i)).toLocaleString("en-US", { maximumFractionDigits: 1 }) + " " + u[i];
};
const since = (ms) => {
  if (!ms) return "";
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  return s < 60 ? `${s}s` : s < 3600 ? `${Math.floor(s / 60)}m` : `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
};
const features = (o) => [
  o.durable ? html`<span class="pill accent" title="durable">D</span>` : "",
  o.auto_delete ? html`<span class="pill" title="auto-delete">AD</span>` : "",
  o.exclusive ? html`<span class="pill" title="exclusive">Excl</span>` : "",
  o.internal ? html`<span class="pill" title="internal">I</span>` : "",
  o.policy ? html`<span class="pill warn" title="policy">${o.policy}</span>` : "",
  ...Object.entries(o.arguments || {}).map(([k, v]) => html`<span class="pill" title="${k} = ${JSON.stringify(v)}">${k.replace(/^x-/, "")}</span>`),
];
const vhostSelect = (vhosts, name = "vhost") => html`<label>Virtual host <select name="${name}">${vhosts.map((v) => html`<option>${v.name}</option>`)}</select></label>`;
const table = (head, rows, empty) => html`<table><thead><tr>${head.map((h) => html`<th class="${h.startsWith("#") ? "num" : ""}">${h.replace(/^#/, "")}</th>`)}</tr></thead>
  <tbody>${rows.length ? rows : html`<tr><td class="empty" colspan="${head.length}">${empty}</td></tr>`}</tbody></table>`;

// `key=value` lines to an arguments table; numbers and booleans typed as RabbitMQ's UI does.
function parseArgs(text) {
  const out = {};
  for (const line of (text || "").split("\n").map((l) => l.trim()).filter(Boolean)) {
    const at = line.indexOf("=");
    if (at <= 0) throw new Error(`'${line}' is not key=value`);
    const key = line.slice(0, at).trim();
    const value = line.slice(at + 1).trim();
    out[key] = /^-?\d+$/.test(value) ? Number(value) : value === "true" ? true : value === "false" ? false : value;
  }
  return out;
}
const formData = (form) => Object.fromEntries(new FormData(form).entries());

function toast(message, bad = false) {
  const t = $("#toast");
  t.textContent = message;
  t.className = bad ? "bad" : "";
  t.hidden = false;
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { t.hidden = true; }, 3500);
}

// ---------------------------------------------------------------------------------------
// Charts: samples kept in the page (the API gives current rates; the page remembers them)

const HISTORY = 90;
const samples = new Map(); // key -> [{t, values: [..]}]
function remember(key, values) {
  const h = samples.get(key) ?? [];
  h.push({ t: Date.now(), values });
  while (h.length > HISTORY) h.shift();
  samples.set(key, h);
  return h;
}

function chart(key, title, series, values, unit = "") {
  const h = remember(key, values);
  const W = 600, H = 170, L = 48, B = 18;
  const max = Math.max(1, ...h.flatMap((s) => s.values));
  const step = niceStep(max);
  const top = Math.ceil(max / step) * step;
  const x = (i) => L + ((W - L - 6) * i) / Math.max(1, HISTORY - 1);
  const y = (v) => 6 + (H - B - 6) * (1 - v / top);
  const offset = HISTORY - h.length;
  const grid = [];
  for (let v = 0; v <= top + 1e-9; v += step) {
    grid.push(html`<line class="grid" x1="${L}" x2="${W}" y1="${y(v)}" y2="${y(v)}"></line><text x="${L - 6}" y="${y(v) + 4}" text-anchor="end">${short(v)}</text>`);
  }
  const lines = series.map((s, si) => {
    const pts = h.map((sample, i) => `${x(i + offset).toFixed(1)},${y(sample.values[si]).toFixed(1)}`).join(" ");
    return html`<polyline fill="none" stroke="${s.color}" stroke-width="2" stroke-linejoin="round" points="${pts}"></polyline>`;
  });
  const last = h[h.length - 1].values;
  return html`<div class="card"><h2>${title}</h2>
    <svg class="chart" data-chart="${key}" data-samples="${h.length}" data-last="${last.join(",")}" viewBox="0 0 ${W} ${H}" preserveAspectRatio="none">${grid}${lines}</svg>
    <div class="legend">${series.map((s, i) => html`<span><i style="background:${s.color}"></i>${s.name} <b>${short(last[i])}${unit}</b></span>`)}</div></div>`;
}
function niceStep(max) {
  const raw = max / 4;
  const p = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw) ?? raw;
}
function short(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1).replace(/\.0$/, "") + "M";
  if (v >= 1e3) return (v / 1e3).toFixed(1).replace(/\.0$/, "") + "k";
  return Number.isInteger(v) ? String(v) : v.toFixed(1);
}

// ---------------------------------------------------------------------------------------
// Views: each returns the page's HTML; actions are `data-act` buttons and forms

const views = {
  async overview() {
    const o = await get("/overview");
    const q = o.queue_totals, t = o.object_totals, m = o.message_stats || {};
    const tiles = [["Connections", t.connections], ["Channels", t.channels], ["Exchanges", t.exchanges],
      ["Queues", t.queues], ["Consumers", t.consumers], ["Ready", q.messages_ready], ["Unacked", q.messages_unacknowledged]];
    return html`<h1>Overview <span class="muted">${o.node}</span></h1>
      <div class="tiles">${tiles.map(([l, n]) => html`<div class="tile"><div class="n">${num(n)}</div><div class="l">${l}</div></div>`)}</div>
      <div class="charts">
        ${chart("overview.queued", "Queued messages", [{ name: "Ready", color: "var(--c1)" }, { name: "Unacked", color: "var(--c2)" }], [q.messages_ready, q.messages_unacknowledged])}
        ${chart("overview.rates", "Message rates", [{ name: "Publish", color: "var(--c1)" }, { name: "Deliver", color: "var(--c2)" }, { name: "Ack", color: "var(--c3)" }],
          [m.publish_details?.rate ?? 0, m.deliver_get_details?.rate ?? 0, m.ack_details?.rate ?? 0], "/s")}
      </div>
      <div class="card"><h2>Listeners</h2>${table(["Protocol", "Address", "#Port"],
        o.listeners.map((l) => html`<tr><td>${l.protocol}</td><td>${l.ip_address}</td><td class="num">${l.port}</td></tr>`), "none")}
        <p class="muted">${o.product_name} ${o.product_version} · API of RabbitMQ ${o.rabbitmq_version}</p></div>`;
  },

  async connections(filter = (c) => true, title = "Connections") {
    const list = (await get("/connections")).filter(filter);
    return html`<h1>${title}</h1><div class="card">${table(
      ["Name", "User", "Virtual host", "Protocol", "Client", "TLS", "State", "#Channels", "Connected", ""],
      list.map((c) => html`<tr data-connection="${c.name}"><td>${c.user_provided_name || c.name}</td><td>${c.user}</td><td>${c.vhost}</td>
        <td><span class="pill">${c.protocol}</span></td><td>${c.client_id || c.client_properties?.product || ""}</td>
        <td>${c.ssl ? html`<span class="pill ok">TLS</span>` : ""}</td>
        <td><span class="pill ${c.state === "running" ? "ok" : "warn"}">${c.state}</span></td><td class="num">${c.channels}</td>
        <td>${since(c.connected_at)}</td>
        <td><button class="danger" data-act="close-connection" data-name="${c.name}">Close</button></td></tr>`),
      "No connections")}</div>`;
  },

  async channels() {
    const list = await get("/channels");
    return html`<h1>Channels</h1><div class="card">${table(
      ["Channel", "User", "Virtual host", "Mode", "#Prefetch", "#Unacked", "#Consumers", "Publish", "Deliver"],
      list.map((c) => html`<tr><td>${c.name}</td><td>${c.user}</td><td>${c.vhost}</td>
        <td>${c.confirm ? html`<span class="pill accent">confirm</span>` : ""}${c.transactional ? html`<span class="pill">tx</span>` : ""}</td>
        <td class="num">${num(c.prefetch_count)}</td><td class="num">${num(c.messages_unacknowledged)}</td><td class="num">${num(c.consumer_count)}</td>
        <td class="num">${rate(c.message_stats?.publish_details)}</td><td class="num">${rate(c.message_stats?.deliver_get_details)}</td></tr>`),
      "No channels")}</div>`;
  },

  async exchanges() {
    const [list, vhosts] = await Promise.all([get("/exchanges"), get("/vhosts")]);
    return html`<h1>Exchanges</h1><div class="card">${table(["Virtual host", "Name", "Type", "Features", "#Publish in"],
      list.map((x) => html`<tr><td>${x.vhost}</td><td><a href="#/exchange/${enc(x.vhost)}/${enc(x.name || "amq.default")}">${x.name || "(AMQP default)"}</a></td>
        <td>${x.type}</td><td>${features(x)}</td><td class="num">${rate(x.message_stats?.publish_in_details)}</td></tr>`), "No exchanges")}</div>
      <form class="card" data-form="add-exchange"><h2>Add an exchange</h2><div class="row">${vhostSelect(vhosts)}
        <label>Name <input name="name" required></label>
        <label>Type <select name="type">${o(["direct", "fanout", "topic", "headers"])}</select></label>
        <label>Durability <select name="durable"><option value="true">Durable</option><option value="false">Transient</option></select></label>
        <label>Arguments <textarea name="arguments" placeholder="alternate-exchange=my-ae"></textarea></label>
        <button type="submit">Add exchange</button></div></form>`;
  },

  async exchange(vhost, name) {
    const [x, bindings, queues] = await Promise.all([
      get(`/exchanges/${enc(vhost)}/${enc(name)}`), get(`/bindings/${enc(vhost)}`), get(`/queues/${enc(vhost)}`)]);
    const source = name === "amq.default" ? "" : name;
    const out = bindings.filter((b) => b.source === source);
    return html`<h1>Exchange <span class="muted">${name}</span></h1>
      <div class="card"><dl class="kv"><dt>Virtual host</dt><dd>${vhost}</dd><dt>Type</dt><dd>${x.type}</dd><dt>Features</dt><dd>${features(x)}</dd></dl></div>
      <div class="card"><h2>Bindings</h2>${table(["To", "Routing key", "Arguments", ""], out.map((b) => html`<tr><td>${b.destination_type}: ${b.destination}</td>
        <td>${b.routing_key}</td><td>${JSON.stringify(b.arguments)}</td>
        <td>${source ? html`<button class="danger" data-act="unbind" data-vhost="${vhost}" data-source="${b.source}" data-kind="${b.destination_type === "queue" ? "q" : "e"}" data-destination="${b.destination}" data-props="${b.properties_key}">Unbind</button>` : ""}</td></tr>`), "No bindings")}
        ${source ? html`<form data-form="bind" data-vhost="${vhost}" data-source="${source}"><div class="row">
          <label>To queue <select name="destination">${o(queues.map((q) => q.name))}</select></label>
          <label>Routing key <input name="routing_key"></label><button type="submit">Bind</button></div></form>` : ""}</div>
      ${publishForm(vhost, name, "")}
      ${source && !source.startsWith("amq.") ? html`<div class="card"><button class="danger" data-act="delete-exchange" data-vhost="${vhost}" data-name="${name}">Delete this exchange</button></div>` : ""}`;
  },

  async queues() {
    const [list, vhosts] = await Promise.all([get("/queues"), get("/vhosts")]);
    return html`<h1>Queues</h1><div class="card">${table(
      ["Virtual host", "Name", "Type", "Features", "#Ready", "#Unacked", "#Total", "#Consumers", "#Incoming", "#Deliver", "#Ack"],
      list.map((q) => html`<tr data-queue="${q.name}"><td>${q.vhost}</td><td><a href="#/queue/${enc(q.vhost)}/${enc(q.name)}">${q.name}</a></td>
        <td>${q.type}</td><td>${features(q)}</td><td class="num">${num(q.messages_ready)}</td><td class="num">${num(q.messages_unacknowledged)}</td>
        <td class="num">${num(q.messages)}</td><td class="num">${num(q.consumers)}</td><td class="num">${rate(q.message_stats?.publish_details)}</td>
        <td class="num">${rate(q.message_stats?.deliver_get_details)}</td><td class="num">${rate(q.message_stats?.ack_details)}</td></tr>`),
      "No queues")}</div>
      <form class="card" data-form="add-queue"><h2>Add a queue</h2><div class="row">${vhostSelect(vhosts)}
        <label>Name <input name="name" required></label>
        <label>Durability <select name="durable"><option value="true">Durable</option><option value="false">Transient</option></select></label>
        <label>Auto delete <select name="auto_delete"><option value="false">No</option><option value="true">Yes</option></select></label>
        <label>Arguments <textarea name="arguments" placeholder="x-message-ttl=60000&#10;x-max-length=1000"></textarea></label>
        <button type="submit">Add queue</button></div></form>`;
  },

  async queue(vhost, name) {
    const [q, bindings, consumers, exchanges] = await Promise.all([
      get(`/queues/${enc(vhost)}/${enc(name)}`), get(`/queues/${enc(vhost)}/${enc(name)}/bindings`),
      get(`/consumers/${enc(vhost)}`), get(`/exchanges/${enc(vhost)}`)]);
    const mine = consumers.filter((c) => c.queue?.name === name);
    const m = q.message_stats || {};
    return html`<h1>Queue <span class="muted">${name}</span></h1>
      <div class="charts">
        <div class="card"><h2>Details</h2><dl class="kv"><dt>Virtual host</dt><dd>${vhost}</dd><dt>Type</dt><dd>${q.type}</dd>
          <dt>Features</dt><dd>${features(q)}</dd><dt>State</dt><dd><span class="pill ok">${q.state}</span></dd>
          <dt>Ready</dt><dd>${num(q.messages_ready)}</dd><dt>Unacked</dt><dd>${num(q.messages_unacknowledged)}</dd>
          <dt>Consumers</dt><dd>${num(q.consumers)}</dd><dt>Memory</dt><dd>${bytes(q.memory)}</dd></dl></div>
        ${chart(`queue.${vhost}.${name}`, "Message rates", [{ name: "Publish", color: "var(--c1)" }, { name: "Deliver", color: "var(--c2)" }, { name: "Ack", color: "var(--c3)" }],
          [m.publish_details?.rate ?? 0, m.deliver_get_details?.rate ?? 0, m.ack_details?.rate ?? 0], "/s")}
      </div>
      <div class="card"><h2>Consumers</h2>${table(["Channel", "Tag", "Ack required", "#Prefetch"], mine.map((c) => html`<tr>
        <td>${c.channel_details?.name}</td><td>${c.consumer_tag}</td><td>${c.ack_required ? "yes" : "no"}</td><td class="num">${c.prefetch_count}</td></tr>`), "No consumers")}</div>
      <div class="card"><h2>Bindings</h2>${table(["From", "Routing key", ""], bindings.map((b) => html`<tr><td>${b.source || "(AMQP default)"}</td><td>${b.routing_key}</td>
        <td>${b.source ? html`<button class="danger" data-act="unbind" data-vhost="${vhost}" data-source="${b.source}" data-kind="q" data-destination="${name}" data-props="${b.properties_key}">Unbind</button>` : ""}</td></tr>`), "No bindings")}
        <form data-form="bind" data-vhost="${vhost}" data-destination="${name}"><div class="row">
          <label>From exchange <select name="source">${o(exchanges.filter((x) => x.name).map((x) => x.name))}</select></label>
          <label>Routing key <input name="routing_key"></label><button type="submit">Bind</button></div></form></div>
      ${publishForm(vhost, "amq.default", name)}
      <form class="card" data-form="get" data-vhost="${vhost}" data-name="${name}"><h2>Get messages</h2><div class="row">
        <label>Ack mode <select name="ackmode"><option value="ack_requeue_true">Nack, requeue</option><option value="ack_requeue_false">Ack, remove</option></select></label>
        <label>Messages <input name="count" type="number" value="1" min="1" max="10000"></label><button type="submit">Get messages</button></div>
        <div id="got"></div></form>
      <div class="card row"><button class="secondary" data-act="purge" data-vhost="${vhost}" data-name="${name}">Purge messages</button>
        <button class="danger" data-act="delete-queue" data-vhost="${vhost}" data-name="${name}">Delete queue</button></div>`;
  },

  async mqtt() {
    const [conns, queues] = await Promise.all([get("/connections"), get("/queues")]);
    const clients = conns.filter((c) => String(c.protocol).startsWith("MQTT"));
    const sessions = queues.filter((q) => q.name.startsWith("mqtt-subscription-"));
    return html`<h1>MQTT</h1>
      <div class="card"><h2>Clients</h2>${table(["Client id", "User", "Virtual host", "Protocol", "Peer", "Connected", ""],
        clients.map((c) => html`<tr><td>${c.client_id}</td><td>${c.user}</td><td>${c.vhost}</td><td><span class="pill">${c.protocol}</span></td>
          <td>${c.peer_host}:${c.peer_port}</td><td>${since(c.connected_at)}</td>
          <td><button class="danger" data-act="close-connection" data-name="${c.name}">Disconnect</button></td></tr>`), "No MQTT clients")}</div>
      <div class="card"><h2>Sessions</h2><p class="muted">A persistent session's subscriptions and QoS 1 messages live in its queue; it stays while the client is away.</p>
        ${table(["Session queue", "Virtual host", "#Messages", "#Consumers", "State"], sessions.map((q) => html`<tr>
          <td><a href="#/queue/${enc(q.vhost)}/${enc(q.name)}">${q.name}</a></td><td>${q.vhost}</td><td class="num">${num(q.messages)}</td>
          <td class="num">${q.consumers}</td><td>${q.consumers ? html`<span class="pill ok">connected</span>` : html`<span class="pill">away</span>`}</td></tr>`), "No MQTT sessions")}</div>`;
  },

  async admin(tab = "users") {
    const tabs = ["users", "vhosts", "policies", "definitions"];
    const head = html`<h1>Admin</h1><div class="tabs">${tabs.map((t) => html`<a href="#/admin/${t}" class="${t === tab ? "active" : ""}">${t[0].toUpperCase() + t.slice(1)}</a>`)}</div>`;
    if (tab === "users") {
      const [users, perms, vhosts] = await Promise.all([get("/users"), get("/permissions"), get("/vhosts")]);
      return html`${head}<div class="card">${table(["Name", "Tags", "Permissions", ""], users.map((u) => html`<tr><td>${u.name}</td>
        <td>${(Array.isArray(u.tags) ? u.tags : String(u.tags || "").split(",")).filter(Boolean).map((t) => html`<span class="pill accent">${t}</span>`)}</td>
        <td>${perms.filter((p) => p.user === u.name).map((p) => html`<span class="pill" title="configure ${p.configure} · write ${p.write} · read ${p.read}">${p.vhost}</span>`)}</td>
        <td><button class="danger" data-act="delete-user" data-name="${u.name}">Delete</button></td></tr>`), "No users")}</div>
        <form class="card" data-form="add-user"><h2>Add a user</h2><div class="row"><label>Username <input name="name" required></label>
          <label>Password <input name="password" type="password"></label><label>Tags <input name="tags" placeholder="administrator, monitoring"></label>
          <button type="submit">Add user</button></div></form>
        <form class="card" data-form="set-permission"><h2>Set permissions</h2><div class="row"><label>User <select name="user">${o(users.map((u) => u.name))}</select></label>
          ${vhostSelect(vhosts)}<label>Configure <input name="configure" value=".*"></label><label>Write <input name="write" value=".*"></label>
          <label>Read <input name="read" value=".*"></label><button type="submit">Set permission</button></div></form>`;
    }
    if (tab === "vhosts") {
      const vhosts = await get("/vhosts");
      return html`${head}<div class="card">${table(["Name", "#Messages", ""], vhosts.map((v) => html`<tr><td>${v.name}</td><td class="num">${num(v.messages)}</td>
        <td>${v.name === "/" ? "" : html`<button class="danger" data-act="delete-vhost" data-name="${v.name}">Delete</button>`}</td></tr>`), "No virtual hosts")}</div>
        <form class="card" data-form="add-vhost"><h2>Add a virtual host</h2><div class="row"><label>Name <input name="name" required></label><button type="submit">Add virtual host</button></div></form>`;
    }
    if (tab === "policies") {
      const [policies, vhosts] = await Promise.all([get("/policies"), get("/vhosts")]);
      return html`${head}<div class="card">${table(["Virtual host", "Name", "Pattern", "Apply to", "Definition", "#Priority", ""], policies.map((p) => html`<tr>
        <td>${p.vhost}</td><td>${p.name}</td><td><code>${p.pattern}</code></td><td>${p["apply-to"]}</td><td><code>${JSON.stringify(p.definition)}</code></td>
        <td class="num">${p.priority}</td><td><button class="danger" data-act="delete-policy" data-vhost="${p.vhost}" data-name="${p.name}">Delete</button></td></tr>`), "No policies")}</div>
        <form class="card" data-form="add-policy"><h2>Add a policy</h2><div class="row">${vhostSelect(vhosts)}<label>Name <input name="name" required></label>
          <label>Pattern <input name="pattern" required placeholder="^orders\\."></label>
          <label>Apply to <select name="apply-to">${o(["all", "queues", "exchanges"])}</select></label>
          <label>Priority <input name="priority" type="number" value="0"></label>
          <label>Definition <textarea name="definition" placeholder="max-length=1000&#10;message-ttl=60000"></textarea></label>
          <button type="submit">Add policy</button></div></form>`;
    }
    return html`${head}<div class="card"><h2>Export definitions</h2><p class="muted">Users, virtual hosts, permissions, policies, exchanges, queues and bindings, as RabbitMQ's definitions JSON.</p>
        <button data-act="export">Download definitions</button></div>
      <form class="card" data-form="import"><h2>Import definitions</h2><label>File <input type="file" name="file" accept=".json,application/json"></label>
        <p><button type="submit">Import</button></p></form>`;
  },
};

const o = (names) => names.map((n) => html`<option>${n}</option>`);
const publishForm = (vhost, exchange, key) => html`<form class="card" data-form="publish" data-vhost="${vhost}" data-exchange="${exchange}"><h2>Publish a message</h2>
  <div class="row"><label>Routing key <input name="routing_key" value="${key}"></label>
  <label>Delivery mode <select name="delivery_mode"><option value="2">Persistent</option><option value="1">Transient</option></select></label>
  <label>Headers <textarea name="headers" placeholder="key=value"></textarea></label>
  <label>Payload <textarea name="payload"></textarea></label><button type="submit">Publish message</button></div></form>`;

// ---------------------------------------------------------------------------------------
// Actions

const actions = {
  async "close-connection"(d) {
    await api("DELETE", `/connections/${enc(d.name)}`);
    return "Connection closed";
  },
  async purge(d) { await api("DELETE", `/queues/${enc(d.vhost)}/${enc(d.name)}/contents`); return "Queue purged"; },
  async "delete-queue"(d) { await api("DELETE", `/queues/${enc(d.vhost)}/${enc(d.name)}`); location.hash = "#/queues"; return "Queue deleted"; },
  async "delete-exchange"(d) { await api("DELETE", `/exchanges/${enc(d.vhost)}/${enc(d.name)}`); location.hash = "#/exchanges"; return "Exchange deleted"; },
  async unbind(d) { await api("DELETE", `/bindings/${enc(d.vhost)}/e/${enc(d.source)}/${d.kind}/${enc(d.destination)}/${enc(d.props)}`); return "Binding removed"; },
  async "delete-user"(d) { await api("DELETE", `/users/${enc(d.name)}`); return "User deleted"; },
  async "delete-vhost"(d) { await api("DELETE", `/vhosts/${enc(d.name)}`); return "Virtual host deleted"; },
  async "delete-policy"(d) { await api("DELETE", `/policies/${enc(d.vhost)}/${enc(d.name)}`); return "Policy deleted"; },
  async export() {
    const defs = await get("/definitions");
    const a = document.createElement("a");
    a.href = URL.createObjectURL(new Blob([JSON.stringify(defs, null, 2)], { type: "application/json" }));
    a.download = "warren-definitions.json";
    a.click();
    return "Definitions exported";
  },
};
// Destructive actions ask once more in place ("Sure?") instead of a modal dialog.
const DESTRUCTIVE = new Set(["close-connection", "purge", "delete-queue", "delete-exchange", "delete-user", "delete-vhost", "delete-policy"]);

const forms = {
  async "add-queue"(f) {
    await api("PUT", `/queues/${enc(f.vhost)}/${enc(f.name)}`, { durable: f.durable === "true", auto_delete: f.auto_delete === "true", arguments: parseArgs(f.arguments) });
    return `Queue ${f.name} declared`;
  },
  async "add-exchange"(f) {
    await api("PUT", `/exchanges/${enc(f.vhost)}/${enc(f.name)}`, { type: f.type, durable: f.durable === "true", auto_delete: false, internal: false, arguments: parseArgs(f.arguments) });
    return `Exchange ${f.name} declared`;
  },
  async publish(f, form) {
    const headers = parseArgs(f.headers);
    const r = await api("POST", `/exchanges/${enc(form.dataset.vhost)}/${enc(form.dataset.exchange)}/publish`, {
      routing_key: f.routing_key, payload: f.payload, payload_encoding: "string",
      properties: { delivery_mode: Number(f.delivery_mode), headers },
    });
    return r.routed ? "Message published" : "Message published, but not routed to any queue";
  },
  async get(f, form) {
    const msgs = await api("POST", `/queues/${enc(form.dataset.vhost)}/${enc(form.dataset.name)}/get`, { count: Number(f.count), ackmode: f.ackmode, encoding: "auto", truncate: 50000 });
    $("#got", form).innerHTML = render(msgs.length ? msgs.map((m, i) => html`<div class="message"><b>Message ${i + 1}</b>
      <dl class="kv"><dt>Exchange</dt><dd>${m.exchange || "(AMQP default)"}</dd><dt>Routing key</dt><dd>${m.routing_key}</dd>
      <dt>Redelivered</dt><dd>${m.redelivered ? "yes" : "no"}</dd><dt>Properties</dt><dd><code>${JSON.stringify(m.properties)}</code></dd></dl>
      <pre class="payload">${m.payload}</pre></div>`) : html`<p class="muted">Queue is empty</p>`);
    return null;
  },
  async bind(f, form) {
    const d = form.dataset;
    const source = d.source ?? f.source, destination = d.destination ?? f.destination;
    await api("POST", `/bindings/${enc(d.vhost)}/e/${enc(source)}/q/${enc(destination)}`, { routing_key: f.routing_key, arguments: {} });
    return "Bound";
  },
  async "add-user"(f) {
    await api("PUT", `/users/${enc(f.name)}`, { password: f.password, tags: f.tags.split(",").map((t) => t.trim()).filter(Boolean).join(",") });
    return `User ${f.name} added`;
  },
  async "set-permission"(f) {
    await api("PUT", `/permissions/${enc(f.vhost)}/${enc(f.user)}`, { configure: f.configure, write: f.write, read: f.read });
    return "Permissions set";
  },
  async "add-vhost"(f) { await api("PUT", `/vhosts/${enc(f.name)}`, {}); return `Virtual host ${f.name} added`; },
  async "add-policy"(f) {
    await api("PUT", `/policies/${enc(f.vhost)}/${enc(f.name)}`, { pattern: f.pattern, "apply-to": f["apply-to"], priority: Number(f.priority), definition: parseArgs(f.definition) });
    return `Policy ${f.name} set`;
  },
  async import(_f, form) {
    const file = form.elements.file.files[0];
    if (!file) throw new Error("choose a definitions file first");
    await api("POST", "/definitions", JSON.parse(await file.text()));
    return "Definitions imported";
  },
};

// ---------------------------------------------------------------------------------------
// Routing, refresh, login

const REFRESH_MS = Number(new URLSearchParams(location.search).get("refresh")) || 5000;
let rendering = false;
let again = false;

function route() {
  const [name, ...args] = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  return { name: views[name] ? name : "overview", args };
}

async function show(quiet = false) {
  if (!auth.header) return;
  // Don't redraw under a user who is typing in a form.
  if (quiet && document.activeElement?.closest("form")) return;
  if (rendering) { again = !quiet || again; return; }
  rendering = true;
  const { name, args } = route();
  document.querySelectorAll("#nav a").forEach((a) => a.classList.toggle("active", a.getAttribute("href") === `#/${name}` ||
    (name === "queue" && a.getAttribute("href") === "#/queues") || (name === "exchange" && a.getAttribute("href") === "#/exchanges")));
  try {
    const out = await views[name](...args);
    const got = $("#got")?.innerHTML;
    $("#view").innerHTML = render(out);
    if (got && $("#got")) $("#got").innerHTML = got;
  } catch (e) {
    if (e.status !== 401) $("#view").innerHTML = render(html`<div class="card"><p class="error">${e.message}</p></div>`);
  } finally {
    rendering = false;
    if (again) { again = false; show(); }
  }
}

function showLogin(message = "") {
  $("#top").hidden = true;
  $("#view").innerHTML = "";
  $("#login").hidden = false;
  $("#login-error").textContent = message;
}

async function start() {
  try {
    const me = await get("/whoami");
    const o = await get("/overview");
    $("#user").textContent = me.name;
    $("#node").textContent = o.node;
    $("#login").hidden = true;
    $("#top").hidden = false;
    await show();
  } catch (e) {
    if (e.status !== 401) showLogin(e.message);
  }
}

$("#login").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const f = formData(ev.target);
  auth.set(f.username, f.password);
  await start();
});
$("#logout").addEventListener("click", () => { auth.clear(); samples.clear(); showLogin(); });
window.addEventListener("hashchange", () => show());

document.addEventListener("click", async (ev) => {
  const button = ev.target.closest("button[data-act]");
  if (!button) return;
  const act = button.dataset.act;
  if (DESTRUCTIVE.has(act) && button.dataset.armed !== "1") {
    button.dataset.armed = "1";
    button.textContent = "Sure?";
    return;
  }
  try {
    const message = await actions[act](button.dataset);
    if (message) toast(message);
  } catch (e) {
    toast(e.message, true);
  }
  await show();
});

document.addEventListener("submit", async (ev) => {
  const form = ev.target.closest("form[data-form]");
  if (!form) return;
  ev.preventDefault();
  try {
    const message = await forms[form.dataset.form](formData(form), form);
    if (message) {
      toast(message);
      document.activeElement?.blur();
      await show();
    }
  } catch (e) {
    toast(e.message, true);
  }
});

setInterval(() => show(true), REFRESH_MS);
if (auth.header) start(); else showLogin();
