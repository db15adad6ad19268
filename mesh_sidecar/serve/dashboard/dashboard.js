"use strict";
// The /mesh dashboard: polls /mesh/state about once a second and redraws the page from it.
// Every value from the state goes in with textContent: member names come from other machines.

const STATE_URL = "/mesh/state";
const POLL_MS = 1000;
const KEY_STORAGE = "mesh-inference-api-key"; // sessionStorage: gone when the tab closes
const SPARK_POINTS = 60; // a minute of tokens/s at one poll a second
const GIB = 1024 ** 3; // sizes are binary everywhere, as in the CLI (mesh_sidecar/units.py)
const PALETTE = ["#6aa7ff", "#4cc38a", "#e5b454", "#c48cf0", "#ef8f6b", "#5fd0d6", "#e07bb0", "#a7c957"];

const tokenRates = [];
let nextPoll = null;

function $(id) {
  return document.getElementById(id);
}

function el(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (className) node.className = className;
  return node;
}

// One colour per node id, the same in the layer map and the members table.
function colourOf(id) {
  let hash = 0;
  for (const c of id) hash = (hash * 31 + c.charCodeAt(0)) >>> 0;
  return PALETTE[hash % PALETTE.length];
}

function fixed(value, digits) {
  return value === null || value === undefined ? "–" : Number(value).toFixed(digits);
}

// The CLI's format_gib: two decimals under 1 GiB, one above.
function gib(bytes) {
  if (bytes === null || bytes === undefined) return fixed(bytes, 0);
  const value = bytes / GIB;
  return fixed(value, value < 1 ? 2 : 1);
}

function clock(epochSeconds) {
  return new Date(epochSeconds * 1000).toLocaleTimeString([], { hour12: false });
}

async function poll() {
  const key = sessionStorage.getItem(KEY_STORAGE);
  try {
    const response = await fetch(STATE_URL, {
      headers: key ? { Authorization: `Bearer ${key}` } : {},
      cache: "no-store",
    });
    if (response.status === 401) {
      askForKey(key !== null);
    } else if (!response.ok) {
      showApiState(`error ${response.status}`, "bad");
    } else {
      showDashboard();
      draw(await response.json());
    }
  } catch (error) {
    showApiState("node unreachable", "bad");
  }
  // Cleared first: a poll started by the key form must not start a second loop.
  clearTimeout(nextPoll);
  nextPoll = setTimeout(poll, POLL_MS);
}

function askForKey(refused) {
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-error").textContent = refused ? "That key was refused." : "";
  showApiState("needs the API key", "warn");
}

function showDashboard() {
  $("key-form").hidden = true;
  $("main").hidden = false;
}

function showApiState(text, tone) {
  const pill = $("api-state");
  pill.textContent = text;
  pill.className = `pill ${tone}`;
}

function draw(state) {
  $("node-name").textContent = `${state.node.name} (${state.node.short_id})`;
  $("model-name").textContent = `${state.model.name} · ctx ${state.model.ctx_size}`;
  const models = state.models || [];
  if (state.plan) showApiState("serving", "good");
  else if (state.refusal) showApiState("refusing requests", "bad");
  else if (!servesHere(state)) {
    // A node that serves no model: its API forwards to the nodes that do.
    const ready = models.some((m) => m.state === "ready");
    showApiState(ready ? "API forwards to the mesh" : "no model ready in the mesh", ready ? "good" : "warn");
  } else showApiState("loading", "warn");
  $("updated").textContent = `updated ${new Date().toLocaleTimeString([], { hour12: false })}`;
  drawFigures(state);
  drawModels(models);
  drawLayerMap(state);
  drawMembers(state.members);
  drawEvents(state.events);
}

function servesHere(state) {
  const self = state.members.find((m) => m.state === "self");
  return Boolean(self && self.serving);
}

function drawFigures(state) {
  const live = state.live || {};
  const now = live.tokens_per_second_now ?? 0;
  $("tps-now").textContent = fixed(now, 1);
  $("tps-last").textContent = fixed(live.last_request_tokens_per_second, 1);
  tokenRates.push(now);
  if (tokenRates.length > SPARK_POINTS) tokenRates.shift();
  const top = Math.max(1, ...tokenRates);
  // The newest figure at the right edge; older ones scroll off to the left.
  const offset = SPARK_POINTS - tokenRates.length;
  const points = tokenRates.map((v, i) => `${((offset + i) * 120) / (SPARK_POINTS - 1)},${30 - (v / top) * 28}`);
  $("tps-spark").querySelector("polyline").setAttribute("points", points.join(" "));

  const peers = state.members.filter((m) => m.state !== "self");
  const connected = peers.filter((m) => m.state === "connected").length;
  $("members-count").textContent = `${connected + 1} of ${peers.length + 1}`;
  const counters = state.counters || {};
  $("requests").textContent = `${counters.requests ?? 0} · ${counters.failovers ?? 0}`;
}

function drawLayerMap(state) {
  const map = $("layer-map");
  const plan = state.plan;
  if (!plan) {
    $("plan-caption").textContent = "";
    $("plan-notes").textContent = "";
    let why = "No plan yet: waiting for members.";
    if (state.refusal) why = `No plan: ${state.refusal}`;
    else if (!servesHere(state)) why = "This node serves no model: see the models in the mesh above.";
    map.replaceChildren(el("div", why, "no-plan"));
    return;
  }
  $("plan-caption").textContent = `${plan.n_layers} layers over ${plan.segments.length} node(s)`;
  const bar = el("div", null, "layer-bar");
  const axis = el("div", null, "layer-axis");
  axis.append(tick(0, plan.n_layers));
  for (const s of plan.segments) {
    const label = `${s.name}: ${s.start}–${s.end}`;
    const segment = el("div", label, "segment");
    segment.dataset.node = s.name;
    segment.dataset.id = s.id;
    segment.dataset.start = s.start;
    segment.dataset.end = s.end;
    segment.title = `${s.name}: layers [${s.start}, ${s.end})${s.output ? " + output head" : ""}`;
    segment.style.flex = `${s.end - s.start} 1 0`;
    segment.style.background = colourOf(s.id);
    bar.append(segment);
    axis.append(tick(s.end, plan.n_layers));
  }
  map.replaceChildren(bar, axis);
  const notes = [];
  if (plan.left_out.length) notes.push(`Left out (too small): ${plan.left_out.join(", ")}.`);
  for (const r of plan.refused) notes.push(`Refused: ${r.name} (${r.reason}: ${r.detail}).`);
  $("plan-notes").textContent = notes.join(" ");
}

const MODEL_STATE_TONES = { ready: "good", loading: "warn", unavailable: "bad" };

// One row per node serving a model (a replica); the model's name on its first row only.
function drawModels(models) {
  const rows = [];
  for (const model of models) {
    const replicas = model.replicas.length ? model.replicas : [null];
    replicas.forEach((replica, index) => {
      const row = el("tr");
      row.dataset.model = model.id;
      const name = el("td");
      if (index === 0) {
        name.append(el("span", model.id, "mono"));
        if (model.default && models.length > 1) name.append(el("span", "default", "self-tag"));
        if (model.vision) name.append(el("span", "images", "self-tag"));
      }
      const state = replica ? replica.state : model.state;
      const servedBy = el("td");
      if (replica) {
        row.dataset.node = replica.node.name;
        const swatch = el("span", null, "swatch");
        swatch.style.background = colourOf(replica.node.id);
        servedBy.append(swatch, el("span", replica.node.name));
        if (replica.local) servedBy.append(el("span", "this node", "self-tag"));
      } else {
        servedBy.textContent = "–";
      }
      row.append(
        name,
        el("td", state, MODEL_STATE_TONES[state] || "muted"),
        servedBy,
        el("td", replica && replica.members.length ? replica.members.map((m) => m.name).join(", ") : "–"),
        el("td", replica ? replica.in_flight : "–", "num"),
      );
      rows.push(row);
    });
  }
  $("models").querySelector("tbody").replaceChildren(...rows);
  $("models").hidden = models.length === 0;
  $("models-empty").hidden = models.length > 0;
  const ready = models.filter((m) => m.state === "ready").length;
  $("models-caption").textContent = models.length ? `${ready} of ${models.length} ready` : "";
}

function tick(layer, nLayers) {
  const mark = el("span", layer);
  mark.style.left = `${(layer / nLayers) * 100}%`;
  return mark;
}

function memberState(m) {
  if (m.state === "self") return ["this node", "good"];
  if (m.state === "connected" && m.health === "degraded") return ["degraded", "warn"];
  if (m.state === "connected") return ["connected", "good"];
  if (m.state === "lost") return ["lost", "bad"];
  return [m.state, "muted"];
}

function drawMembers(members) {
  const rows = members.map((m) => {
    const row = el("tr");
    row.dataset.node = m.name;
    row.dataset.id = m.id;
    row.dataset.state = m.state;
    const name = el("td");
    const swatch = el("span", null, "swatch");
    swatch.style.background = colourOf(m.id);
    name.append(swatch, el("span", m.name), el("span", m.short_id, "self-tag mono"));
    const [stateText, tone] = memberState(m);
    row.append(
      name,
      el("td", stateText, tone),
      el("td", (m.address ?? "–") + (m.path ? ` (${m.path})` : ""), "addr"),
      el("td", fixed(m.rtt_ms, 1), "num"),
      el("td", fixed(m.rtt_p50_ms, 1), "num"),
      el("td", gib(m.capacity_bytes), "num"),
      el("td", m.devices || "–"),
      el("td", m.serving ? "serving" : "", m.serving ? "good" : ""),
    );
    return row;
  });
  $("members").querySelector("tbody").replaceChildren(...rows);
}

function drawEvents(events) {
  const items = events.slice().reverse().map((e) => {
    const item = el("li");
    item.append(el("time", clock(e.time)), el("span", e.message));
    return item;
  });
  $("events").replaceChildren(...items);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key-input").value.trim();
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  $("key-input").value = "";
  poll();
});

poll();
