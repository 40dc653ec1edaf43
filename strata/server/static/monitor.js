// Strata Monitor: polls /v1/status and renders it; a small chat box talks to /v1/chat/completions.
"use strict";

const POLL_MS = 500;
const $ = (id) => document.getElementById(id);
const state = { key: localStorage.getItem("strata-api-key") || "", lastH2d: null, chat: [], busy: false };

// ---- formatting ----
const fmtInt = (n) => (n == null ? "—" : Math.round(n).toLocaleString("en-US"));
const fmtRate = (n) => (n == null ? "—" : n >= 100 ? fmtInt(n) : n.toFixed(1));
const fmtPct = (x) => (x == null ? "—" : (100 * x).toFixed(1) + " %");
function fmtBytes(b) {
  if (b == null) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (b >= 1024 && i < units.length - 1) { b /= 1024; i++; }
  return (i === 0 ? b.toFixed(0) : b.toFixed(b >= 100 ? 0 : 2)) + " " + units[i];
}
function fmtMs(ms) {
  if (ms == null) return "—";
  return ms >= 1000 ? (ms / 1000).toFixed(2) + " s" : ms.toFixed(0) + " ms";
}
function fmtUptime(s) {
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60;
  return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : m ? `${m}m ${Math.floor(s % 60)}s` : `${Math.floor(s)}s`;
}
const pick = (obj, ...names) => { for (const n of names) if (obj && obj[n] != null) return obj[n]; return null; };

// ---- HTTP ----
async function api(path, options = {}) {
  const headers = Object.assign({}, options.headers || {});
  if (state.key) headers["Authorization"] = "Bearer " + state.key;
  const r = await fetch(path, Object.assign({}, options, { headers }));
  if (r.status === 401) { $("key-form").hidden = false; throw new Error("API key required"); }
  return r;
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  state.key = $("key-input").value.trim();
  localStorage.setItem("strata-api-key", state.key);
  $("key-form").hidden = true;
});

// ---- status ----
async function poll() {
  try {
    const r = await api("/v1/status");
    if (!r.ok) throw new Error("status " + r.status);
    render(await r.json());
    setConn(true, "live");
  } catch (err) {
    setConn(false, err.message === "API key required" ? "API key required" : "disconnected");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

function setConn(ok, text) {
  const el = $("conn");
  el.className = "conn " + (ok ? "ok" : "bad");
  el.textContent = text;
}

function render(s) {
  $("model-name").textContent = s.model || "—";
  $("device").textContent = s.device || "—";
  $("context").textContent = s.max_context ? fmtInt(s.max_context) + " ctx" : "";
  renderState(s);
  renderTotals(s);
  renderGpu(s);
  renderRequests(s.requests || []);
  $("last-error").textContent = s.last_error ? "last error: " + s.last_error : "";
}

function renderState(s) {
  const el = $("state");
  el.textContent = s.state;
  el.className = "state state-" + s.state;
  const cur = s.current;
  let detail = "";
  $("progress").hidden = !(cur && s.state === "reading");
  if (cur && s.state === "reading") {
    const pct = cur.prompt_total ? (100 * cur.prompt_done) / cur.prompt_total : 0;
    $("progress-bar").style.width = pct.toFixed(1) + "%";
    detail = `prompt ${fmtInt(cur.prompt_done)} / ${fmtInt(cur.prompt_total)}`;
  } else if (cur && s.state === "generating") {
    detail = `${fmtInt(cur.tokens)} tokens · ${fmtMs(cur.elapsed_ms)}`;
  } else if (s.state === "queued") {
    detail = `${s.queue.depth} waiting`;
  } else if (s.uptime_s != null) {
    detail = "up " + fmtUptime(s.uptime_s);
  }
  $("state-detail").textContent = detail;
  $("tps").textContent = fmtRate(s.tokens_per_second);
  $("tps-note").textContent = cur && cur.decode_tps ? "now" : "last request";
  $("batching").textContent = batchingText(s.slots, s.batching, s.kept_conversations);
  $("queue").textContent = s.queue ? s.queue.depth : 0;
  $("queue-max").textContent = s.queue ? "/ " + s.queue.max : "";
}

// "slots 2 / 4 busy · steps of up to 4 rows (auto) · 3 prefixes copied between slots (4,096 tokens)": the
// batch rule's current cap (--batch-max), and the prompt prefixes a slot took from another instead of reading them.
function batchingText(slots, b, kept) {
  if (!slots || slots.total <= 1) return "";
  const rule = !b ? "" : b.auto ? ` · steps of up to ${b.cap} rows (auto)` : ` · steps of up to ${b.cap} rows (--batch-max ${b.batch_max})`;
  const n = kept ? kept.shared_prefixes : 0;
  const shared = n ? ` · ${fmtInt(n)} prefix${n > 1 ? "es" : ""} copied between slots (${fmtInt(kept.shared_tokens)} tokens)` : "";
  return `slots ${slots.busy} / ${slots.total} busy${rule}${shared}`;
}

function renderTotals(s) {
  const t = s.totals || {};
  $("total-requests").textContent = fmtInt(t.requests);
  $("total-detail").textContent = `${fmtInt(t.cancelled)} cancelled · ${fmtInt(t.errors)} failed`;
  $("queue-detail").textContent = t.rejected ? `${fmtInt(t.rejected)} turned away (queue full)` : "waiting for the engine";
  $("total-generated").textContent = fmtInt(t.completion_tokens);
  $("token-detail").textContent = `${fmtInt(t.prompt_tokens)} prompt · ${fmtInt(t.cached_tokens)} reused`;
}

function renderGpu(s) {
  const g = s.gpu;
  $("gpu-cpu-note").hidden = !!g;
  $("gpu-body").hidden = !g;
  $("gpu-name").textContent = g ? pick(g, "name", "device_name") || "" : "";
  // What the last prompt ran with (before any prompt: the engine's plan). No ring on the CPU: nothing streams.
  const lp = s.last_prompt || { chunk: s.prefill_chunk, ring: s.prefill_ring };
  const ring = lp.ring ? `ring ${fmtInt(lp.ring)} slots` : "ring n/a";
  $("prompt-chunk").textContent = lp.chunk ? `chunk ${fmtInt(lp.chunk)} tokens · ${ring}` : "—";
  if (g) renderVram(s, g, s.expert_cache || {});
}

function h2dRate(bytes) {
  const now = performance.now(), last = state.lastH2d;
  state.lastH2d = { t: now, b: bytes };
  if (!last || now <= last.t) return null;
  return Math.max(0, (bytes - last.b) / ((now - last.t) / 1000) / 1e9);
}

// The KV format, its cells in VRAM and (--kv-resident) on the host, and what a decoded token reads over the bus.
function kvDetail(kv) {
  if (!kv) return "";
  const host = kv.cells_host ? ` · ${fmtInt(kv.cells_host)} on the host · ${fmtBytes(kv.bus_bytes_per_token)} over the bus a token` : "";
  return ` · ${kv.format} · ${fmtInt(kv.cells_vram)} cells in VRAM${host}`;
}

// --gpus 0,1: each card's layers and GPU, and the hand-off's measured time a decode step.
function splitText(ls) {
  const cards = (ls.cards || []).map(c => `layers ${c.layers[0]}–${c.layers[1] - 1} on GPU ${c.gpu}`).join(", ");
  const hand = ls.handoff_ms_per_step == null ? "" : ` · hand-off ${ls.handoff_ms_per_step.toFixed(3)} ms a step`;
  return `${cards}${hand}`;
}

function renderVram(s, g, ec) {
  const parts = [
    ["Dense weights", pick(g, "dense_bytes"), "var(--dense)"],
    ["Expert cache", pick(g, "expert_cache_bytes", "cache_bytes"), "var(--cache)"],
    ["KV cache", pick(g, "kv_bytes"), "var(--kv)"],
    ["Prompt path", pick(g, "prompt_bytes", "prefill_bytes"), "var(--prompt)"],
  ];
  const budget = pick(g, "vram_budget_bytes", "budget_bytes", "vram_total_bytes") ||
    parts.reduce((a, p) => a + (p[1] || 0), 0);
  $("vram-bar").innerHTML = parts.map(([name, b, color]) =>
    `<span style="width:${budget ? (100 * (b || 0)) / budget : 0}%;background:${color}" title="${name}: ${fmtBytes(b)}"></span>`).join("");
  $("vram-legend").innerHTML = parts.map(([name, , color]) => `<span><i style="background:${color}"></i>${name}</span>`).join("")
    + `<span class="legend-total">${fmtBytes(pick(g, "vram_used_bytes", "used_bytes"))} used of ${fmtBytes(budget)}</span>`;
  const slots = pick(ec, "slots", "num_slots");
  const resident = pick(ec, "resident", "experts_resident", "slots"), total = pick(ec, "total_experts", "num_experts");
  const gbps = h2dRate(s.bytes_h2d || 0);
  const rows = [
    ["Dense weights", fmtBytes(parts[0][1])],
    ["Expert cache", fmtBytes(parts[1][1]) + (slots == null ? "" : ` · ${fmtInt(slots)} slots`)],
    ["KV cache", fmtBytes(parts[2][1]) + kvDetail(s.kv)],
    ["Prompt path", fmtBytes(parts[3][1])],
    ["Experts in VRAM", resident == null ? "—" : `${fmtInt(resident)}${total ? " / " + fmtInt(total) : ""}`],
    ["Hit rate", fmtPct(pick(ec, "hit_rate"))],
    ["PCIe host → device", `${fmtBytes(s.bytes_h2d)} · ${gbps == null ? "—" : gbps.toFixed(2)} GB/s`],
  ];
  if (s.layer_split) rows.push(["Layer split", splitText(s.layer_split)]);
  $("gpu-rows").innerHTML = rows.map(([k, v]) => `<dt>${k}</dt><dd>${v}</dd>`).join("");
}

function renderRequests(rows) {
  const body = $("requests").tBodies[0];
  if (!rows.length) { body.innerHTML = '<tr class="empty-row"><td colspan="11">No requests yet.</td></tr>'; return; }
  body.innerHTML = rows.map((r) => `<tr>
    <td>${new Date(r.finished_at * 1000).toLocaleTimeString()}</td>
    <td>${r.kind === "chat" ? "chat" : "completion"}</td>
    <td class="num">${fmtInt(r.prompt_tokens)}</td>
    <td class="num">${fmtInt(r.cached_tokens)}</td>
    <td class="num">${fmtInt(r.completion_tokens)}</td>
    <td class="num">${fmtRate(r.prompt_tps)}</td>
    <td class="num">${fmtRate(r.decode_tps)}</td>
    <td class="num">${fmtPct(r.hit_rate)}</td>
    <td class="num"${r.draft_room ? ' title="the prompt read through the draft layer\'s expert memory (--mtp-room-min)"' : ""}>${r.draft_n ? `${fmtInt(r.draft_n_accepted)} / ${fmtInt(r.draft_n)}` : "—"}${r.draft_room ? " ·room" : ""}</td>
    <td class="num">${fmtMs(r.duration_ms)}</td>
    <td><span class="tag ${r.finish_reason}">${r.finish_reason}</span></td></tr>`).join("");
}

// ---- chat ----
function bubble(role, text) {
  const log = $("chat-log");
  const empty = log.querySelector(".empty");
  if (empty) empty.remove();
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.textContent = text;
  log.appendChild(el);
  log.scrollTop = log.scrollHeight;
  return el;
}

async function send(text) {
  state.chat.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  const body = {
    messages: state.chat, stream: true, stream_options: { include_usage: true },
    max_tokens: parseInt($("chat-max").value, 10) || 64, temperature: parseFloat($("chat-temp").value) || 0,
  };
  let reply = "", usage = null;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    if (!r.ok) throw new Error((await r.json()).error.message);
    for await (const event of sseEvents(r.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      for (const c of event.choices || []) reply += (c.delta && c.delta.content) || "";
      out.textContent = reply;
      $("chat-log").scrollTop = $("chat-log").scrollHeight;
    }
    state.chat.push({ role: "assistant", content: reply });
    if (usage) {
      const meta = document.createElement("span");
      meta.className = "meta";
      meta.textContent = `${usage.completion_tokens} tokens · ${usage.prompt_tokens} prompt, ${usage.prompt_tokens_details.cached_tokens} reused`;
      out.appendChild(meta);
    }
  } catch (err) {
    out.classList.add("failed");
    out.textContent = "Error: " + err.message;
    state.chat.pop();
  }
}

async function* sseEvents(stream) {
  const reader = stream.getReader(), decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const frame = buf.slice(0, i);
      buf = buf.slice(i + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

$("chat-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || state.busy) return;
  $("chat-input").value = "";
  state.busy = $("chat-send").disabled = true;
  try { await send(text); } finally { state.busy = $("chat-send").disabled = false; }
});
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-clear").addEventListener("click", () => {
  state.chat = [];
  $("chat-log").innerHTML = '<div class="muted small empty">Conversation cleared.</div>';
});

poll();
