// The web page: a chat over this server's OpenAI-compatible /v1/chat/completions (streamed), and a live monitor
// polling /v1/monitor. Plain browser JavaScript, no build step, nothing loaded from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["model", "key", "max-tokens", "temperature", "top-p", "top-k", "thinking", "system"];
const POLL_MS = 1000;
const CHART_POINTS = 120;

const chat = {history: [], controller: null};
const monitor = {series: [], updates: 0, servedName: ""};

// ---------------------------------------------------------------------------------------------------- settings
function loadSettings() {
  for (const name of SETTINGS) {
    const el = $("set-" + name);
    const saved = localStorage.getItem("strata." + name);
    if (saved === null) continue;
    if (el.type === "checkbox") el.checked = saved === "true"; else el.value = saved;
  }
  for (const name of SETTINGS) {
    const el = $("set-" + name);
    el.addEventListener("change", () => localStorage.setItem("strata." + name, el.type === "checkbox" ? el.checked : el.value));
  }
  $("settings-toggle").addEventListener("click", () => toggleSettings());
}

function toggleSettings(show) {
  const panel = $("settings");
  panel.hidden = show === undefined ? !panel.hidden : !show;
  $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
}

function authHeaders() {
  const key = $("set-key").value.trim();
  return key ? {"Authorization": "Bearer " + key} : {};
}

function numberSetting(name, parse) {
  const raw = $("set-" + name).value.trim();
  if (raw === "") return undefined;
  const value = parse(raw);
  return Number.isFinite(value) ? value : undefined;
}

// -------------------------------------------------------------------------------------------------------- chat
function addMessage(role, text) {
  $("empty-hint").hidden = true;
  const box = document.createElement("div");
  box.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "body";
  if (role === "user") body.textContent = text; else body.innerHTML = renderMarkdown(text || "");
  box.appendChild(body);
  $("messages").appendChild(box);
  scrollToEnd();
  return box;
}

function scrollToEnd() {
  const list = $("messages");
  list.scrollTop = list.scrollHeight;
}

function requestBody() {
  const messages = [];
  const system = $("set-system").value.trim();
  if (system) messages.push({role: "system", content: system});
  messages.push(...chat.history);
  const body = {
    model: $("set-model").value.trim() || monitor.servedName || "default",
    messages,
    stream: true,
    stream_options: {include_usage: true},
    max_tokens: numberSetting("max-tokens", parseInt),
    temperature: numberSetting("temperature", parseFloat),
    top_p: numberSetting("top-p", parseFloat),
    top_k: numberSetting("top-k", parseInt),
    chat_template_kwargs: {enable_thinking: $("set-thinking").checked},
  };
  return JSON.stringify(body);
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chat.controller) return;
  $("prompt").value = "";
  chat.history.push({role: "user", content: text});
  addMessage("user", text);
  const box = addMessage("assistant", "");
  box.classList.add("streaming");
  const reply = {content: "", reasoning: "", finish: null, usage: null, tokens: 0};
  const started = performance.now();
  let firstAt = null;
  chat.controller = new AbortController();
  setBusy(true);
  let scheduled = false;
  const render = () => {
    scheduled = false;
    renderReply(box, reply, started, firstAt);
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: chat.controller.signal,
      headers: {"Content-Type": "application/json", ...authHeaders()}, body: requestBody(),
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      if (chunk.usage) reply.usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content) {
        if (firstAt === null) firstAt = performance.now();
        reply.tokens += 1;
      }
      reply.content += delta.content || "";
      reply.reasoning += delta.reasoning_content || "";
      if (choice.finish_reason) reply.finish = choice.finish_reason;
      if (!scheduled) {
        scheduled = true;
        requestAnimationFrame(render);
      }
    }
  } catch (err) {
    if (err.name === "AbortError") reply.finish = "stopped";
    else showError(box, err.message);
  } finally {
    chat.controller = null;
    setBusy(false);
    box.classList.remove("streaming");
    renderReply(box, reply, started, firstAt);
    if (reply.content) chat.history.push({role: "assistant", content: reply.content});
    $("prompt").focus();
  }
}

async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of frame.split("\n")) {
        if (line.startsWith("data:")) yield line.slice(5).trim();
      }
    }
  }
}

async function errorText(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || message;
  } catch (_) { /* not JSON */ }
  if (response.status === 401) {
    toggleSettings(true);
    $("set-key").focus();
    message += " (enter the server's API key in Settings)";
  }
  return message;
}

function renderReply(box, reply, started, firstAt) {
  const body = box.querySelector(".body");
  let html = "";
  if (reply.reasoning) {
    const open = reply.content ? "" : " open";
    html += `<details class="thinking"${open}><summary>thinking</summary>${renderMarkdown(reply.reasoning)}</details>`;
  }
  html += renderMarkdown(reply.content);
  body.innerHTML = html;
  let meta = box.querySelector(".meta");
  if (!meta) {
    meta = document.createElement("div");
    meta.className = "meta";
    box.appendChild(meta);
  }
  const parts = [];
  const tokens = reply.usage ? reply.usage.completion_tokens : reply.tokens;
  if (firstAt !== null) parts.push(`first token ${((firstAt - started) / 1000).toFixed(2)} s`);
  if (tokens) parts.push(`${tokens} tokens`);
  const seconds = (performance.now() - (firstAt ?? started)) / 1000;
  if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tok/s`);
  if (reply.usage && reply.usage.prompt_tokens_details) {
    parts.push(`prompt ${reply.usage.prompt_tokens} (${reply.usage.prompt_tokens_details.cached_tokens} cached)`);
  }
  if (reply.finish) parts.push(reply.finish === "stopped" ? "stopped" : `finish: ${reply.finish}`);
  meta.textContent = parts.join(" · ");
  scrollToEnd();
}

function showError(box, message) {
  const note = document.createElement("div");
  note.className = "error";
  note.textContent = message;
  box.appendChild(note);
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

function copyCode(event) {
  const button = event.target.closest("button.copy");
  if (!button) return;
  const code = button.closest(".code").querySelector("code").textContent;
  navigator.clipboard.writeText(code).then(() => {
    button.textContent = "copied";
    setTimeout(() => { button.textContent = "copy"; }, 1200);
  }).catch(() => { button.textContent = "select and copy"; });
}

// ----------------------------------------------------------------------------------------------------- monitor
async function poll() {
  try {
    const response = await fetch("/v1/monitor", {headers: authHeaders(), cache: "no-store"});
    if (response.status === 401) {
      setStatus("key needed", "warn");
      showMonitorError("The monitor needs the server's API key: enter it in Settings.");
      return;
    }
    if (!response.ok) throw new Error(`${response.status} ${response.statusText}`);
    showMonitorError("");
    renderMonitor(await response.json());
  } catch (err) {
    setStatus("offline", "bad");
    showMonitorError("The server does not answer: " + err.message);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function showMonitorError(text) {
  $("mon-error").hidden = !text;
  $("mon-error").textContent = text;
}

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = "status status-" + kind;
}

const pct = (x) => (x === null || x === undefined ? "-" : (100 * x).toFixed(1) + " %");
const secs = (x) => (x === null || x === undefined ? "-" : x.toFixed(2) + " s");
const num = (x) => (x === null || x === undefined ? "-" : x.toLocaleString());

function renderMonitor(m) {
  monitor.servedName = m.model;
  $("model-name").textContent = m.model;
  $("set-model").placeholder = m.model;
  setStatus(m.status === "ok" ? "ready" : m.status, m.status === "ok" ? "ok" : m.status === "loading" ? "warn" : "bad");
  const busy = m.slots.busy;
  const total = m.slots.total;
  $("mon-slots").textContent = total ? `${busy} / ${total}` : String(busy);
  $("mon-slots-bar").style.width = total ? `${(100 * busy) / total}%` : "0";
  $("mon-queue").textContent = num(m.queue);
  $("mon-tok-s").textContent = m.tok_s.toFixed(1);
  $("mon-ttft").textContent = secs(m.recent.ttft_last_s);
  $("mon-ttft-p50").textContent = m.recent.ttft_p50_s === null ? "last request" :
    `last request; median of ${m.recent.count}: ${secs(m.recent.ttft_p50_s)}`;
  $("mon-prefix").textContent = pct(m.totals.prefix_cache_hit_rate);
  $("mon-experts").textContent = m.totals.expert_gpu_hit_rate === null ? "all" : pct(m.totals.expert_gpu_hit_rate);
  $("mon-requests-total").textContent = num(m.totals.requests);
  $("mon-tokens-total").textContent = `${num(m.totals.prompt_tokens)} prompt / ${num(m.totals.generated_tokens)} generated tokens`;
  $("mon-draft").textContent = pct(m.totals.draft_acceptance);
  fillRows("mon-requests", m.requests.map((r) => [short(r.id), r.api, r.state,
    `${num(r.prompt_tokens)} (${num(r.cached_tokens)})`, `${num(r.output_tokens)} / ${num(r.max_tokens)}`,
    secs(r.ttft_s), r.tok_s.toFixed(1)]), "no request in flight", 7);
  fillRows("mon-recent", m.recent.last.slice().reverse().map((r) => [short(r.request_id), r.api,
    `${num(r.prompt_tokens)} (${num(r.cached_tokens)})`, num(r.output_tokens), secs(r.ttft_s),
    r.tok_s === null ? "-" : r.tok_s.toFixed(1), r.stop]), "none yet", 7);
  const about = m.about || {};
  const rows = [["context per slot", num(m.context_length)]];
  for (const key of ["model", "dtype", "backend", "slots", "draft"]) if (about[key] !== undefined) rows.push([key, String(about[key])]);
  if (about.plan_summary) rows.push(["memory plan", about.plan_summary]);
  for (const [label, value] of about.plan || []) rows.push([label, value]);
  fillRows("mon-plan", rows, "", 2);
  monitor.series.push(m.tok_s);
  if (monitor.series.length > CHART_POINTS) monitor.series.shift();
  drawChart();
  monitor.updates += 1;
  const stamp = $("mon-updated");
  stamp.dataset.count = String(monitor.updates);
  stamp.textContent = "updated " + new Date().toLocaleTimeString();
}

function short(id) {
  return id.length > 14 ? id.slice(0, 14) + "…" : id;
}

function fillRows(tableId, rows, emptyText, columns) {
  const body = $(tableId).querySelector("tbody");
  body.replaceChildren();
  if (!rows.length && emptyText) rows = [[emptyText]];
  for (const cells of rows) {
    const tr = document.createElement("tr");
    cells.forEach((text) => {
      const td = document.createElement("td");
      td.textContent = text;
      if (cells.length === 1) td.colSpan = columns;
      tr.appendChild(td);
    });
    body.appendChild(tr);
  }
}

function drawChart() {
  const canvas = $("mon-chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width;
  const h = canvas.height;
  ctx.clearRect(0, 0, w, h);
  const top = Math.max(1, ...monitor.series);
  ctx.strokeStyle = "#2f6fdf";
  ctx.lineWidth = 2;
  ctx.beginPath();
  monitor.series.forEach((v, i) => {
    const x = (i / (CHART_POINTS - 1)) * w;
    const y = h - 4 - (v / top) * (h - 18);
    if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
  });
  ctx.stroke();
  ctx.fillStyle = "#667";
  ctx.font = "11px sans-serif";
  ctx.fillText(`tok/s, last ${CHART_POINTS} s (max ${top.toFixed(1)})`, 6, 12);
}

// --------------------------------------------------------------------------------------------------------- start
function start() {
  loadSettings();
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || e.shiftKey || e.isComposing) return;
    e.preventDefault();
    $("composer").requestSubmit();
  });
  $("stop").addEventListener("click", () => chat.controller && chat.controller.abort());
  $("clear").addEventListener("click", () => {
    if (chat.controller) chat.controller.abort();
    chat.history = [];
    $("messages").querySelectorAll(".msg").forEach((el) => el.remove());
    $("empty-hint").hidden = false;
  });
  $("messages").addEventListener("click", copyCode);
  poll();
}

start();
