// redraft playground: streams a chat completion with `stream_denoise` and draws every forward of the model.
// Plain browser JavaScript, no build step and no network beyond this server. What it draws is kept in
// `window.playground` as data too, so a test (or a curious person in the console) can read the frames.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { columns: [], running: false, controller: null };
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
  const column = { title, node, frames: [], forwards: 0, edits: 0, tokens: 0, committed: 0, masks: 0, text: "",
    finalText: null, summary: null, error: null, done: false, seen: new Map(), seenEnd: 0,
    framesWithMasks: 0, tokenCounts: [] };
  state.columns.push(column);
  return column;
}

function cell(piece, status, confidence, replaced) {
  const span = document.createElement("span");
  span.className = "cell " + status;
  if (status === "mask") {
    span.textContent = "\u00a0";
    return span;
  }
  if (status === "edited" && replaced != null) {
    const old = document.createElement("s");
    old.className = "old";
    old.textContent = visible(replaced);
    span.appendChild(old);
  }
  span.appendChild(document.createTextNode(visible(piece)));
  if (/^<\|[^|]*\|>$/.test(piece || "")) span.classList.add("special");
  if (status === "drafted" || status === "edited") span.style.setProperty("--conf", String(confidence ?? 0.5));
  const parts = [];
  if (confidence != null) parts.push("confidence " + confidence.toFixed(3));
  if (status === "edited") parts.push("replaced " + JSON.stringify(replaced ?? ""));
  if (span.classList.contains("special")) parts.unshift(piece);
  if (parts.length) span.title = parts.join(", ");
  return span;
}

// Whitespace and control characters drawn so that a cell never collapses to nothing.
function visible(piece) {
  if (piece == null || piece === "") return "\u2205";
  if (/^<\|[^|]*\|>$/.test(piece)) return piece === "<|endoftext|>" ? "eos" : piece.slice(2, -2).slice(0, 6);  // special
  if (!piece.trim()) return piece.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u2423");
  return piece.replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5").replace(/ /g, "\u00a0");
}

function drawFrame(column, event) {
  column.node.querySelector(".committed").textContent = event.committed_text;
  const holder = column.node.querySelector(".window");
  holder.replaceChildren();
  column.forwards = event.forward;
  column.committed = event.committed_tokens;
  if (event.event !== "forward") { drawCounts(column); return; }
  const w = event.window;
  let row = null;
  w.tokens.forEach((id, i) => {
    const pos = w.offset + i;
    if (w.states[i] === "edited" && !event.opening) column.edits += 1;
    if (pos < event.committed_tokens) return;  // settled: shown in the committed text
    if (!row || (event.prompt_tokens + pos) % w.block_size === 0) {  // one row per block of the open window
      row = document.createElement("div");
      row.className = "block";
      holder.appendChild(row);
    }
    row.appendChild(cell(w.pieces[i], w.states[i], w.confidence[i], w.replaced_pieces[i]));
  });
  column.masks = w.states.filter((s) => s === "mask").length;
  if (holder.querySelector(".cell.mask")) column.framesWithMasks += 1;
  column.tokens = answerTokens(w);
  const f = column.node.querySelector(".frame");
  f.textContent = "forward " + event.forward + (column.masks ? " \u00b7 " + column.masks + " masks left" : "");
  drawCounts(column);
}

// The output tokens the answer holds if nothing changes any more: those before the window, then the window's placed
// positions up to its first end-of-text token, included (as usage counts it). A short answer's block fills up
// with drafted end-of-text cells: they are not part of it.
function answerTokens(w) {
  let n = w.offset;
  for (let i = 0; i < w.tokens.length; i++) {
    if (w.states[i] === "mask") continue;
    n += 1;
    if (isEnd(w.tokens[i], w.pieces[i])) break;
  }
  return n;
}

function isEnd(id, piece) {
  return state.eosIds ? state.eosIds.has(id) : piece === "<|endoftext|>";
}

// A block opens all-mask: before the first forward that shows new positions, a frame of them as grey cells
// (drawn only; `frames` keeps the server's events).
function openingFrame(column, event) {
  const w = event.window;
  if (w.offset + w.tokens.length <= column.seenEnd) return null;
  const n = w.tokens.length;
  const pieces = w.tokens.map((_, i) => column.seen.get(w.offset + i));
  const states = pieces.map((p) => (p === undefined ? "mask" : "kept"));
  return { ...event, event: "forward", forward: event.forward - 1, opening: true,
    window: { ...w, states, pieces, confidence: Array(n).fill(null), replaced_pieces: Array(n).fill(null) } };
}

function rememberWindow(column, w) {
  w.tokens.forEach((_, i) => {
    if (w.states[i] === "mask") column.seen.delete(w.offset + i);
    else column.seen.set(w.offset + i, w.pieces[i]);
  });
  column.seenEnd = Math.max(column.seenEnd, w.offset + w.tokens.length);
}

function drawCounts(column) {
  const q = (sel) => column.node.querySelector(sel);
  column.tokenCounts.push(column.tokens);  // every value shown, for the browser test
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
    const d = chunk.diffusion;
    if (d && (d.event === "forward" || d.event === "commit")) {
      const opening = d.event === "forward" ? openingFrame(column, d) : null;
      if (opening) {
        drawFrame(column, opening);
        if (delay) await sleep(delay);
      }
      column.frames.push(d);
      drawFrame(column, d);
      if (d.event === "forward") rememberWindow(column, d.window);
      if (delay) await sleep(delay);
    } else if (d && d.forwards != null) {
      column.summary = d;  // the usage chunk's figures for the whole request
    }
    for (const choice of chunk.choices || []) column.text += (choice.delta && choice.delta.content) || "";
  }
  column.finalText = column.text;
  column.node.querySelector(".committed").textContent = column.text;
  column.node.querySelector(".window").replaceChildren();
  if (column.summary) {
    column.forwards = column.summary.forwards;
    column.edits = column.summary.edits;
  }
  const last = column.frames[column.frames.length - 1];
  column.tokens = last ? last.committed_tokens : column.tokens;
  column.node.classList.add("done");
  column.node.querySelector(".frame").textContent = "done in " + column.forwards + " forwards";
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
      const column = newColumn(columnTitle(mode));
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

function columnTitle(mode) {
  const t = mode === "custom" ? { threshold: $("threshold").value, edit_threshold: $("edit-threshold").value } : PRESETS[mode];
  const name = mode === "custom" ? "custom" : mode === "S" ? "S · speed" : "Q · quality";
  return name + "  (threshold " + t.threshold + ", edit " + t.edit_threshold + ", MBE " + $("mbe-window").value + ")";
}

function showError(column) {
  const p = column.node.querySelector(".error");
  p.textContent = column.error;
  p.hidden = false;
}

function setRunning(running) {
  state.running = running;
  $("run").disabled = $("race").disabled = running;
  $("stop").disabled = !running;
}

async function loadModel() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (!response.ok) throw new Error("GET /v1/models: " + response.status + (response.status === 401 ? " (type the API key)" : ""));
  state.model = (await response.json()).data[0].id;
  const info = await fetch("/tokenizer_info", { headers: headers() });  // the ids that end an answer
  const ids = info.ok ? (await info.json()).eos_token_ids : null;
  state.eosIds = ids && ids.length ? new Set(ids) : null;
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
