// redraft playground: streams a chat completion with `stream_denoise` and draws every forward of the model.
// Plain browser JavaScript, no build step and no network beyond this server. What it draws is kept in
// `window.playground` as data too, so a test (or a curious person in the console) can read the frames.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { columns: [], running: 0, controller: null };
window.playground = state;

const PRESETS = { S: { threshold: 0.5, edit_threshold: 0.0 }, Q: { threshold: 0.7, edit_threshold: 0.5 } };

function apiKey() { return $("api-key").value.trim(); }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}

// Server-sent events from a fetch body: yields each `data:` payload (parsed JSON, or the string "[DONE]").
async function* sseData(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data) yield data === "[DONE]" ? data : JSON.parse(data);
    }
  }
}

function requestBody(mode, prompt) {
  const body = {
    model: state.model,
    messages: [{ role: "user", content: prompt }],
    stream: true,
    stream_denoise: true,
    stream_options: { include_usage: true },
    max_tokens: Number($("max-tokens").value),
    mbe_window: Number($("mbe-window").value),
  };
  if (mode === "custom") {
    body.threshold = Number($("threshold").value);
    body.edit_threshold = Number($("edit-threshold").value);
  } else {
    body.mode = mode;
  }
  return body;
}

function newColumn(title) {
  const node = $("column-template").content.firstElementChild.cloneNode(true);
  node.querySelector(".title").textContent = title;
  $("columns").appendChild(node);
  const column = { title, node, frames: [], forwards: 0, edits: 0, tokens: 0, text: "", finalText: null, error: null, done: false };
  state.columns.push(column);
  return column;
}

function cell(piece, status, confidence, replaced) {
  const span = document.createElement("span");
  span.className = "cell " + status;
  span.textContent = status === "mask" ? "\u00a0" : piece;
  if (status === "drafted") span.style.setProperty("--conf", String(confidence ?? 0.5));
  if (status === "edited") span.title = "replaced " + JSON.stringify(replaced ?? "");
  else if (confidence != null) span.title = "confidence " + confidence.toFixed(3);
  return span;
}

function drawFrame(column, event) {
  const w = event.window;
  column.node.querySelector(".committed").textContent = event.committed_text;
  const holder = column.node.querySelector(".window");
  holder.replaceChildren();
  w.tokens.forEach((id, i) => {
    if (i > 0 && (w.offset + i) % w.block_size === 0) {
      const bar = document.createElement("span");
      bar.className = "block-end";
      holder.appendChild(bar);
    }
    holder.appendChild(cell(w.pieces[i], w.states[i], w.confidence[i], w.replaced_pieces ? w.replaced_pieces[i] : w.replaced[i]));
  });
  column.forwards = event.forward;
  column.edits += w.states.filter((s) => s === "edited").length;
  column.tokens = event.committed_tokens + w.states.filter((s) => s !== "mask").length;
  drawCounts(column);
}

function drawCounts(column) {
  const q = (sel) => column.node.querySelector(sel);
  q(".forwards").textContent = column.forwards;
  q(".tokens").textContent = column.tokens;
  q(".tpf").textContent = column.forwards ? (column.tokens / column.forwards).toFixed(2) : "-";
  q(".edits").textContent = column.edits;
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function runColumn(column, mode, prompt, signal) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(requestBody(mode, prompt)), signal,
  });
  if (!response.ok) {
    const err = await response.json().catch(() => ({}));
    throw new Error((err.error && err.error.message) || response.status + " " + response.statusText);
  }
  const delay = Number($("speed").value);
  for await (const chunk of sseData(response)) {
    if (chunk === "[DONE]") break;
    if (chunk.error) throw new Error(chunk.error.message);
    if (chunk.diffusion && chunk.diffusion.event === "forward") {
      column.frames.push(chunk.diffusion);
      drawFrame(column, chunk.diffusion);
      if (delay) await sleep(delay);
    }
    for (const choice of chunk.choices || []) column.text += (choice.delta && choice.delta.content) || "";
  }
  column.finalText = column.text;
  column.node.querySelector(".committed").textContent = column.text;
  column.node.querySelector(".window").replaceChildren();
  column.tokens = column.frames.length ? column.frames[column.frames.length - 1].committed_tokens : 0;
  drawCounts(column);
}

async function start(modes) {
  const prompt = $("prompt").value;
  $("columns").replaceChildren();
  state.columns = [];
  state.controller = new AbortController();
  setRunning(true);
  $("status").textContent = "running";
  try {
    if (!state.model) await loadModel();
    const jobs = modes.map((mode) => {
      const column = newColumn(mode === "custom" ? "custom thresholds" : mode === "S" ? "S (speedy)" : "Q (quality)");
      return runColumn(column, mode, prompt, state.controller.signal).then(
        () => { column.done = true; },
        (err) => { column.error = String(err.message || err); showError(column); });
    });
    await Promise.all(jobs);
    $("status").textContent = state.columns.some((c) => c.error) ? "finished with an error" : "done";
  } catch (err) {
    $("status").textContent = String(err.message || err);
  } finally {
    setRunning(false);
  }
}

function showError(column) {
  const p = column.node.querySelector(".error");
  p.textContent = column.error;
  p.hidden = false;
}

function setRunning(running) {
  $("run").disabled = $("race").disabled = running;
  $("stop").disabled = !running;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw new Error("GET /v1/models: " + response.status + (response.status === 401 ? " (type the API key)" : ""));
  state.model = (await response.json()).data[0].id;
}

function syncThresholds() {
  const mode = $("mode").value;
  const custom = mode === "custom";
  $("threshold").disabled = $("edit-threshold").disabled = !custom;
  if (!custom) {
    $("threshold").value = PRESETS[mode].threshold;
    $("edit-threshold").value = PRESETS[mode].edit_threshold;
  }
}

$("mode").addEventListener("change", syncThresholds);
$("run").addEventListener("click", () => start([$("mode").value]));
$("race").addEventListener("click", () => start(["S", "Q"]));
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("api-key").value = localStorage.getItem("redraft-api-key") || "";
$("api-key").addEventListener("change", () => { localStorage.setItem("redraft-api-key", apiKey()); state.model = null; });
syncThresholds();
state.ready = true;
