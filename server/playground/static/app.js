// specserve playground: chat over /v1/chat/completions (SSE) with `return_token_origins`, so each
// token arrives with its text and who proposed it; live speed and acceptance; /metrics polled.
"use strict";

const STORE = "specserve.playground";
const ORIGINS = ["draft", "ngram", "grammar", "target"];
const $ = (id) => document.getElementById(id);

const state = {
  messages: load("messages", []), // {role, content, spans?, stats?, pair?}
  controller: null, // the AbortController of the stream in flight
  model: null,
};

// ---------------------------------------------------------------- storage and settings

function load(key, fallback) {
  try {
    const raw = localStorage.getItem(`${STORE}.${key}`);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback;
  }
}

function save(key, value) {
  try {
    localStorage.setItem(`${STORE}.${key}`, JSON.stringify(value));
  } catch {
    // private mode or full storage: the page still works, it just forgets
  }
}

function settingInputs() {
  return [...document.querySelectorAll("[data-setting]")];
}

function restoreSettings() {
  const saved = load("settings", {});
  for (const el of settingInputs()) {
    if (!(el.id in saved)) continue;
    if (el.type === "checkbox") el.checked = saved[el.id];
    else el.value = saved[el.id];
  }
}

function saveSettings() {
  const values = {};
  for (const el of settingInputs()) values[el.id] = el.type === "checkbox" ? el.checked : el.value;
  save("settings", values);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The request body from the settings; `speculate` overrides the checkbox (the comparison).
function requestBody(messages, speculate) {
  const body = {
    model: state.model ?? undefined,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    return_token_origins: true,
    temperature: numberOr($("temperature").value, 0),
    max_tokens: Math.max(1, Math.floor(numberOr($("max-tokens").value, 256))),
  };
  const seed = $("seed").value.trim();
  if (seed !== "") body.seed = Math.floor(Number(seed));
  const k = $("k").value.trim();
  if (!speculate) body.num_speculative_tokens = 0;
  else if (k !== "") body.num_speculative_tokens = Math.floor(Number(k));
  const schema = $("schema").value.trim();
  if (schema) {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse(schema) },
    };
  }
  return body;
}

function numberOr(text, fallback) {
  const n = Number(text);
  return text === "" || Number.isNaN(n) ? fallback : n;
}

function conversation(upTo) {
  const out = [];
  const system = $("system").value.trim();
  if (system) out.push({ role: "system", content: system });
  for (const m of state.messages.slice(0, upTo)) {
    if (m.role === "user" || (m.role === "assistant" && !m.error)) {
      out.push({ role: m.role, content: m.content });
    }
  }
  return out;
}

// ---------------------------------------------------------------- streaming one answer

// Runs one streamed chat request; `view` is told of every chunk. Resolves to the answer's figures.
async function streamAnswer(body, view, signal) {
  const started = performance.now();
  const answer = { content: "", spans: [], spec: null, firstAt: null, lastAt: null, samples: [] };
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: headers(),
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 1);
      if (!line.startsWith("data:")) continue;
      const data = line.slice(5).trim();
      if (data === "[DONE]") return finish(answer, started);
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      addChunk(answer, chunk, started);
      view(answer, figures(answer, started));
    }
  }
  return finish(answer, started);
}

function addChunk(answer, chunk, started) {
  if (chunk.spec_decode && chunk.choices.length === 0) answer.spec = chunk.spec_decode;
  for (const choice of chunk.choices) {
    const spans = choice.token_origins ?? [];
    const now = performance.now();
    if (spans.length && answer.firstAt === null) answer.firstAt = now;
    for (const span of spans) answer.spans.push(span);
    answer.content += choice.delta?.content ?? spans.map((s) => s.text).join("");
    if (choice.spec_decode) answer.spec = choice.spec_decode;
    if (spans.length) {
      answer.lastAt = now;
      answer.samples.push({ t: (now - started) / 1000, tokens: answer.spans.length });
    }
  }
}

function finish(answer, started) {
  return { ...answer, figures: figures(answer, started) };
}

// Decode speed counts the tokens after the first over the time since it came (the first token
// carries the prompt's prefill); acceptance and tokens a step are the server's own figures.
function figures(answer, started) {
  const tokens = answer.spans.length;
  const decodeS = answer.firstAt === null ? 0 : (answer.lastAt - answer.firstAt) / 1000;
  const byOrigin = Object.fromEntries(ORIGINS.map((o) => [o, 0]));
  for (const s of answer.spans) byOrigin[s.origin] = (byOrigin[s.origin] ?? 0) + 1;
  return {
    tokens,
    tps: tokens > 1 && decodeS > 0 ? (tokens - 1) / decodeS : null,
    ttft: answer.firstAt === null ? null : (answer.firstAt - started) / 1000,
    acceptance: answer.spec?.acceptance_rate ?? null,
    mal: answer.spec?.mean_acceptance_length ?? null,
    drafted: tokens ? (tokens - byOrigin.target) / tokens : null,
    byOrigin,
  };
}

async function errorText(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status} ${response.statusText}`;
  }
}

// ---------------------------------------------------------------- rendering

function renderSpans(el, spans, fallback) {
  el.replaceChildren();
  if (!spans || !spans.length) {
    el.textContent = fallback ?? "";
    return;
  }
  const frag = document.createDocumentFragment();
  for (const span of spans) {
    const s = document.createElement("span");
    // a proposer the page has no colour for (an EAGLE head, say) shows as a draft, never as the target's
    s.className = `o-${ORIGINS.includes(span.origin) ? span.origin : "draft"}`;
    s.dataset.origin = span.origin;
    s.textContent = span.text;
    frag.append(s);
  }
  el.append(frag);
}

function messageElement(role, label) {
  const el = document.createElement("article");
  el.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = label;
  const text = document.createElement("div");
  text.className = "text";
  const stats = document.createElement("div");
  stats.className = "stats";
  el.append(who, text, stats);
  return el;
}

function statsLine(f) {
  if (!f) return "";
  const parts = [`${f.tokens} tokens`];
  if (f.tps !== null) parts.push(`${f.tps.toFixed(1)} tok/s`);
  if (f.acceptance !== null) parts.push(`acceptance ${(100 * f.acceptance).toFixed(0)}%`);
  if (f.mal !== null) parts.push(`${f.mal.toFixed(2)} tokens a step`);
  return parts.join(" · ");
}

function renderMessages() {
  const box = $("messages");
  box.replaceChildren();
  if (!state.messages.length) {
    const hint = document.createElement("p");
    hint.className = "empty";
    hint.textContent = "Ask something. Each token is coloured by who proposed it: drafts the target accepted, or the target's own token.";
    box.append(hint);
  }
  for (const m of state.messages) box.append(renderMessage(m));
}

function renderMessage(m) {
  if (m.role === "user") {
    const el = messageElement("user", "you");
    el.querySelector(".text").textContent = m.content;
    return el;
  }
  if (m.error) {
    const el = messageElement("assistant error", "error");
    el.setAttribute("role", "alert");
    el.querySelector(".text").textContent = m.error;
    return el;
  }
  const el = messageElement("assistant", state.model ?? "assistant");
  if (m.pair) {
    el.querySelector(".text").replaceWith(pairElement(m));
  } else {
    renderSpans(el.querySelector(".text"), m.spans, m.content);
  }
  el.querySelector(".stats").textContent = statsLine(m.stats);
  return el;
}

function pairElement(m) {
  const pair = document.createElement("div");
  pair.className = "pair";
  for (const [label, side] of [["speculative", m], ["plain", m.pair]]) {
    const text = column(pair, label, `${label} · ${side.stats?.tps?.toFixed(1) ?? "–"} tok/s`);
    renderSpans(text, side.spans, side.content);
  }
  return pair;
}

// One side of a comparison in `pair`: its heading, and the text element it returns.
function column(pair, side, heading) {
  const col = document.createElement("div");
  col.dataset.side = side;
  const head = document.createElement("div");
  head.className = "who";
  head.textContent = heading;
  const text = document.createElement("div");
  text.className = "text";
  col.append(head, text);
  pair.append(col);
  return text;
}

function showFigures(panel, values) {
  for (const dd of panel.querySelectorAll("dd[data-fig]")) {
    const v = values[dd.dataset.fig];
    dd.textContent = v === null || v === undefined ? "–" : v;
  }
}

function showLive(f) {
  showFigures($("live"), {
    tps: f.tps?.toFixed(1),
    acceptance: f.acceptance === null ? null : `${(100 * f.acceptance).toFixed(0)}%`,
    mal: f.mal?.toFixed(2),
    tokens: String(f.tokens),
    ttft: f.ttft === null ? null : `${f.ttft.toFixed(2)} s`,
    drafted: f.drafted === null ? null : `${(100 * f.drafted).toFixed(0)}%`,
  });
}

// Tokens per second over the answer: the rate in a sliding window of the last second.
function drawChart(samples) {
  const canvas = $("chart");
  const ctx = canvas.getContext("2d");
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width;
  const h = canvas.clientHeight || canvas.height;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const points = rates(samples);
  if (points.length < 2) return;
  const tMax = points[points.length - 1].t || 1;
  const rMax = Math.max(...points.map((p) => p.rate)) * 1.15 || 1;
  ctx.strokeStyle = getComputedStyle(document.documentElement).getPropertyValue("--accent");
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  points.forEach((p, i) => {
    const x = (p.t / tMax) * (w - 4) + 2;
    const y = h - 12 - (p.rate / rMax) * (h - 20);
    if (i) ctx.lineTo(x, y);
    else ctx.moveTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = getComputedStyle(document.documentElement).getPropertyValue("--muted");
  ctx.font = "10px system-ui";
  ctx.fillText(`${rMax.toFixed(0)} tok/s`, 4, 10);
}

function rates(samples) {
  const out = [];
  let j = 0;
  for (const s of samples) {
    while (samples[j].t < s.t - 1) j++;
    const dt = s.t - samples[j].t;
    if (dt > 0) out.push({ t: s.t, rate: (s.tokens - samples[j].tokens) / dt });
  }
  return out;
}

// ---------------------------------------------------------------- the conversation

function setBusy(busy) {
  $("send").disabled = busy;
  $("compare").disabled = busy;
  $("clear").disabled = busy;
  $("stop").disabled = !busy;
}

async function send(compare) {
  const prompt = $("prompt").value.trim();
  if (!prompt || state.controller) return;
  let speculativeBody, plainBody;
  state.messages.push({ role: "user", content: prompt });
  try {
    const messages = conversation(state.messages.length);
    speculativeBody = requestBody(messages, compare || $("speculate").checked);
    plainBody = compare ? requestBody(messages, false) : null;
  } catch (err) {
    state.messages.push({ role: "assistant", error: `Settings: ${err.message}` });
    return persist();
  }
  $("prompt").value = "";
  $("compare-result").hidden = true;
  renderMessages();
  const reply = { role: "assistant", content: "", spans: [] };
  const el = renderMessage(reply);
  $("messages").append(el);
  state.controller = new AbortController();
  setBusy(true);
  try {
    Object.assign(reply, await runInto(el, speculativeBody, compare ? "speculative" : null));
    if (compare) {
      reply.pair = await runInto(el, plainBody, "plain");
      showComparison(reply.stats, reply.pair.stats);
      showLive(reply.stats); // the panel shows the speculative answer; the line above, both
      drawChart(reply.samples);
    }
    state.messages.push(reply);
  } catch (err) {
    const partial = reply.spans.length ? reply : err.partial;
    if (partial?.spans?.length) state.messages.push(partial);
    if (err.name !== "AbortError") state.messages.push({ role: "assistant", error: err.message });
  } finally {
    state.controller = null;
    setBusy(false);
    persist();
    $("prompt").focus();
  }
}

// Streams one answer into `el` (into one column of it when comparing).
async function runInto(el, body, side) {
  let target = el.querySelector(".text");
  if (side) target = ensureColumn(el, side);
  let latest = null;
  const view = (answer, f) => {
    latest = { role: "assistant", content: answer.content, spans: answer.spans, stats: f };
    renderSpans(target, answer.spans, answer.content);
    el.querySelector(".stats").textContent = statsLine(f);
    showLive(f);
    drawChart(answer.samples);
  };
  try {
    const done = await streamAnswer(body, view, state.controller.signal);
    showLive(done.figures);
    drawChart(done.samples);
    return { role: "assistant", content: done.content, spans: done.spans, stats: done.figures, samples: done.samples };
  } catch (err) {
    err.partial = latest; // what had arrived: kept in the conversation when stopped
    throw err;
  }
}

function ensureColumn(el, side) {
  let pair = el.querySelector(".pair");
  if (!pair) {
    pair = document.createElement("div");
    pair.className = "pair";
    el.querySelector(".text").replaceWith(pair);
  }
  return column(pair, side, side);
}

function showComparison(spec, plain) {
  const box = $("compare-result");
  const fmt = (f) => (f?.tps ? `${f.tps.toFixed(1)} tok/s` : "–");
  const ratio = spec?.tps && plain?.tps ? ` · ${(spec.tps / plain.tps).toFixed(2)}x` : "";
  box.textContent = `speculative ${fmt(spec)} · plain ${fmt(plain)}${ratio}`;
  box.hidden = false;
}

function persist() {
  save("messages", state.messages);
  renderMessages();
}

// ---------------------------------------------------------------- the server panel

async function refreshServer() {
  if (document.hidden) return;
  try {
    const response = await fetch("/metrics");
    if (!response.ok) return;
    showServer(parseMetrics(await response.text()));
  } catch {
    // the server is restarting or gone: keep the last figures
  }
}

// Prometheus text exposition -> {name: [{labels, value}]} (only specserve:* series).
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^specserve:([a-z_]+)(?:\{([^}]*)\})? ([-+0-9.eE]+|NaN)$/);
    if (!m) continue;
    const labels = Object.fromEntries(
      [...(m[2] ?? "").matchAll(/(\w+)="([^"]*)"/g)].map((l) => [l[1], l[2]]),
    );
    (out[m[1]] ??= []).push({ labels, value: Number(m[3]) });
  }
  return out;
}

function total(series, name) {
  return (series[name] ?? []).reduce((sum, s) => sum + s.value, 0);
}

function showServer(series) {
  const drafted = total(series, "spec_decode_num_draft_tokens_total");
  const accepted = total(series, "spec_decode_num_accepted_tokens_total");
  showFigures($("server"), {
    running: String(total(series, "num_requests_running")),
    waiting: String(total(series, "num_requests_waiting")),
    kv: `${(100 * total(series, "kv_cache_usage_perc")).toFixed(1)}%`,
    acceptance: drafted ? `${((100 * accepted) / drafted).toFixed(0)}%` : null,
  });
  const rows = {};
  for (const s of series.spec_decode_proposer_draft_tokens_total ?? []) {
    (rows[s.labels.proposer] ??= [0, 0])[0] += s.value;
  }
  for (const s of series.spec_decode_proposer_accepted_tokens_total ?? []) {
    (rows[s.labels.proposer] ??= [0, 0])[1] += s.value;
  }
  const body = $("proposers");
  body.replaceChildren();
  for (const [name, [d, a]] of Object.entries(rows)) {
    const tr = document.createElement("tr");
    for (const cell of [name, d, a, d ? `${((100 * a) / d).toFixed(0)}%` : "–"]) {
      const td = document.createElement("td");
      td.textContent = String(cell);
      tr.append(td);
    }
    body.append(tr);
  }
  if (!body.children.length) {
    body.innerHTML = '<tr><td colspan="4">no drafts yet</td></tr>';
  }
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (!response.ok) throw new Error(await errorText(response));
    const card = (await response.json()).data[0];
    state.model = card.id;
    $("model-name").textContent = `${card.id} · context ${card.max_model_len} tokens`;
  } catch (err) {
    $("model-name").textContent = `server: ${err.message}`;
  }
}

// ---------------------------------------------------------------- wiring

function init() {
  restoreSettings();
  renderMessages();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send(false);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send(false);
    }
  });
  $("compare").addEventListener("click", () => send(true));
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("clear").addEventListener("click", () => {
    state.messages = [];
    persist();
  });
  $("settings-toggle").addEventListener("click", (e) => {
    const open = $("settings").classList.toggle("open");
    e.currentTarget.setAttribute("aria-expanded", String(open));
  });
  for (const el of settingInputs()) el.addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", loadModel);
  loadModel();
  refreshServer();
  setInterval(refreshServer, 2000);
}

init();
