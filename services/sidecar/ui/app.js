// The sidecar's status page: what this node serves, the board's head, the lag, requests in
// flight, the last swaps and the errors. It reads GET /sidecar/status from the sidecar that
// served it (no token: the route has none) and asks again every IDLE_MS, or every
// SWAPPING_MS while a swap is in progress: the sidecar has no event stream to follow.
"use strict";

const IDLE_MS = 2000;
const SWAPPING_MS = 500;
const ERRORS_KEPT = 20;

const $ = (id) => document.getElementById(id);

// The sidecar reports only its latest error and problem; the page keeps the distinct ones
// it has seen, with when it first saw each.
const seen = [];

function say(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

function text(id, value) {
  $(id).textContent = value === null || value === undefined ? "-" : String(value);
}

function lagClass(lag) {
  if (lag === null) return "";
  return `lag-${Math.min(lag, 2)}`;
}

function cell(row, value, className = "") {
  const td = row.insertCell();
  td.textContent = value === null || value === undefined ? "-" : String(value);
  if (className) td.className = className;
}

function engineText(engine) {
  if (!engine) return null;
  const parts = [`version ${engine.version ?? "-"}`];
  if (engine.loads !== null) parts.push(`load ${engine.loads}`);
  if (engine.source) parts.push(engine.source);
  return parts.join(", ");
}

function remember(error) {
  if (!error || seen.some((e) => e.text === error)) return;
  seen.unshift({ text: error, at: new Date() });
  seen.length = Math.min(seen.length, ERRORS_KEPT);
}

function renderErrors() {
  const items = seen.map((e) => {
    const item = document.createElement("li");
    const at = document.createElement("time");
    at.dateTime = e.at.toISOString();
    at.textContent = e.at.toLocaleTimeString();
    item.append(at, e.text);
    return item;
  });
  const none = Object.assign(document.createElement("li"), { textContent: "none", className: "none" });
  $("errors").replaceChildren(...(items.length ? items : [none]));
}

function render(status) {
  text("node", status.node_id);
  $("about").textContent =
    `run ${status.run}, ${status.mode} mode, ${status.hot ? "hot updates on" : "reloads only"}`;
  text("served", status.served);
  text("head", status.head);
  text("lag", status.lag);
  $("lag").className = lagClass(status.lag);
  text("inflight", status.inflight);
  text("pins", (status.pins || []).length);
  text("swapping", status.swapping ? "yes" : "no");
  text("healthy", status.healthy ? "yes" : `no${status.problem ? `: ${status.problem}` : ""}`);
  $("healthy").className = status.healthy ? "" : "bad";
  text("engine", engineText(status.engine));
  const body = $("swaps").tBodies[0];
  body.replaceChildren();
  for (const swap of [...status.swaps].reverse()) {
    const row = body.insertRow();
    row.dataset.version = swap.version;
    cell(row, swap.version);
    cell(row, swap.path, swap.path);
    cell(row, swap.pause_ms === null ? null : swap.pause_ms.toFixed(1), "pause");
    cell(row, swap.ready_s === null ? null : swap.ready_s.toFixed(3), "ready");
  }
  remember(status.problem);
  remember(status.last_error);
  renderErrors();
}

async function refresh() {
  let next = IDLE_MS;
  try {
    const answer = await fetch("/sidecar/status", { cache: "no-store" });
    if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
    const status = await answer.json();
    render(status);
    if (status.swapping) next = SWAPPING_MS;
    say(`updated ${new Date().toLocaleTimeString()}${status.swapping ? " (swap in progress)" : ""}`);
  } catch (error) {
    say(`the sidecar did not answer: ${error.message}`, true);
  }
  setTimeout(refresh, next);
}

renderErrors();
refresh();
