// The operators' dashboard: runs and heads, per-version sizes and commit latency, the fleet.
// Every request goes to the board that served this page, with the read token the operator
// entered (kept in sessionStorage, sent as a bearer header, never put in a URL). Updates
// come from the board's event stream (GET /v1/runs/{run}/events), read with fetch() because
// EventSource cannot send an Authorization header; nothing here polls.
"use strict";

const TOKEN_KEY = "deltaboard.token";
const HISTORY = 1000; // versions charted per run
const STALE_S = 30; // a node silent this long (on the board's clock) is flagged stale
const FLEET_SAMPLES = 500; // points kept in the node-version chart
const RETRY_MS = [1000, 2000, 5000, 10000];

const $ = (id) => document.getElementById(id);

class Refused extends Error {}

const state = {
  run: null,
  versions: [], // VersionSummary, oldest first
  head: null,
  fleetTimes: [],
  fleetSeries: new Map(), // node id -> versions aligned with fleetTimes
  headSeries: [],
  charts: {},
  stream: null, // AbortController of the event stream
  rendered: false, // the run's first complete render was marked
  loaded: Promise.resolve(), // the run's version history, drawn
};

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

function say(text, error = false) {
  $("status").textContent = text;
  $("status").className = error ? "error" : "";
}

async function api(path) {
  const headers = {};
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const answer = await fetch(path, { headers, cache: "no-store" });
  if (answer.status === 401 || answer.status === 403) {
    throw new Refused(await errorText(answer));
  }
  if (!answer.ok) throw new Error(`${path}: ${await errorText(answer)}`);
  return answer;
}

async function errorText(answer) {
  try {
    const body = await answer.json();
    return `${body.error.message} (${answer.status} ${body.error.code})`;
  } catch {
    return `HTTP ${answer.status}`;
  }
}

function refused(error) {
  sessionStorage.removeItem(TOKEN_KEY);
  stopStream();
  $("run").hidden = true;
  $("runs").tBodies[0].replaceChildren();
  say(`The board refused this token: ${error.message}. Enter a read token for this board.`, true);
}

async function guarded(work) {
  try {
    await work();
  } catch (error) {
    if (error instanceof Refused) refused(error);
    else say(`Could not reach the board: ${error.message}`, true);
  }
}

// ---- runs ---------------------------------------------------------------------------

async function loadRuns() {
  const runs = await (await api("/v1/runs")).json();
  const body = $("runs").tBodies[0];
  body.replaceChildren(
    ...runs.map((run) => {
      const row = document.createElement("tr");
      row.dataset.run = run.name;
      row.className = run.name === state.run ? "selected" : "";
      row.append(cell(run.name), cell(run.head ?? "-"), cell(new Date(run.created_at * 1000).toLocaleString()));
      row.addEventListener("click", () => {
        location.hash = `run=${encodeURIComponent(run.name)}`;
      });
      return row;
    }),
  );
  return runs;
}

function cell(text, className = "") {
  const td = document.createElement("td");
  td.textContent = String(text);
  if (className) td.className = className;
  return td;
}

function chosenRun(runs) {
  const wanted = new URLSearchParams(location.hash.slice(1)).get("run");
  if (wanted && runs.some((r) => r.name === wanted)) return wanted;
  return runs.length ? runs[0].name : null;
}

async function connect() {
  await guarded(async () => {
    const runs = await loadRuns();
    const run = chosenRun(runs);
    say(runs.length ? `connected: ${runs.length} run(s)` : "connected: no runs yet");
    if (run !== state.run || !state.stream) await openRun(run);
  });
}

// ---- one run ------------------------------------------------------------------------

async function openRun(run) {
  stopStream();
  Object.assign(state, {
    run,
    versions: [],
    head: null,
    fleetTimes: [],
    fleetSeries: new Map(),
    headSeries: [],
    rendered: false,
  });
  for (const row of $("runs").tBodies[0].rows) row.className = row.dataset.run === run ? "selected" : "";
  $("run").hidden = run === null;
  if (run === null) return;
  $("run-name").textContent = run;
  const path = `/v1/runs/${encodeURIComponent(run)}`;
  // The history and the event stream are fetched at once; a commit event waits for the
  // history (`onCommit`). The fleet is read on the first event, which brings the head that
  // its lags need.
  state.loaded = (async () => {
    state.versions = await (await api(`${path}/versions?limit=${HISTORY}`)).json();
    drawVersions();
  })();
  listen(path, 0);
  await state.loaded;
}

function stopStream() {
  if (state.stream) state.stream.abort();
  state.stream = null;
}

async function listen(path, attempt) {
  const controller = new AbortController();
  state.stream = controller;
  try {
    const headers = { Accept: "text/event-stream" };
    if (token()) headers.Authorization = `Bearer ${token()}`;
    const answer = await fetch(`${path}/events`, { headers, signal: controller.signal, cache: "no-store" });
    if (answer.status === 401 || answer.status === 403) throw new Refused(await errorText(answer));
    if (!answer.ok) throw new Error(await errorText(answer));
    attempt = 0;
    const reader = answer.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const message = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        await onMessage(message);
      }
    }
  } catch (error) {
    if (controller.signal.aborted) return;
    if (error instanceof Refused) return refused(error);
    say(`event stream interrupted (${error.message}); reconnecting`, true);
  }
  if (state.stream !== controller) return;
  // The board went away or closed the stream: reconnect, backing off.
  setTimeout(() => state.stream === controller && listen(path, attempt + 1), RETRY_MS[Math.min(attempt, RETRY_MS.length - 1)]);
}

async function onMessage(message) {
  let event = "message";
  let data = "";
  for (const line of message.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  await guarded(async () => {
    if (event === "commit") await onCommit(JSON.parse(data));
    else await loadFleet(); // a keepalive: nodes move between commits too
  });
}

async function onCommit(head) {
  await state.loaded;
  state.head = head.version;
  $("head").textContent = head.version ?? "none yet";
  $("head-kind").textContent = head.kind ? `(${head.kind}, epoch ${head.epoch})` : "";
  const runRow = $("runs").querySelector(`tr[data-run="${CSS.escape(state.run)}"]`);
  if (runRow) runRow.cells[1].textContent = head.version ?? "-";
  const last = state.versions.length ? state.versions[state.versions.length - 1].version : -1;
  if (head.version !== null && head.version > last) {
    const missing = Math.min(HISTORY, head.version - last);
    const path = `/v1/runs/${encodeURIComponent(state.run)}/versions?limit=${missing}`;
    const fresh = (await (await api(path)).json()).filter((v) => v.version > last);
    state.versions = state.versions.concat(fresh).slice(-HISTORY);
    drawVersions();
  }
  say(`connected: head ${head.version} at ${new Date().toLocaleTimeString()}`);
  await loadFleet();
  if (!state.rendered) {
    // Charts, head and fleet are drawn: mark the first complete render in the frame that
    // shows it (`deltaboard bench ui` reads this mark).
    state.rendered = true;
    requestAnimationFrame(() => performance.mark("deltaboard:rendered"));
  }
  await loadRuns(); // the other runs' heads (this run's is set above)
}

// ---- fleet --------------------------------------------------------------------------

async function loadFleet() {
  const answer = await api(`/v1/runs/${encodeURIComponent(state.run)}/fleet`);
  const nodes = await answer.json();
  // Staleness on the board's clock (its Date header), not this browser's.
  const boardNow = Date.parse(answer.headers.get("date")) / 1000 || Date.now() / 1000;
  nodes.sort((a, b) => a.node_id.localeCompare(b.node_id));
  let behind = 0;
  let stale = 0;
  const rows = nodes.map((node) => {
    const lag = node.version === null || state.head === null ? null : Math.max(0, state.head - node.version);
    const age = Math.max(0, boardNow - node.last_seen);
    const row = document.createElement("tr");
    row.dataset.node = node.node_id;
    const lagClass = lag === null ? "lag-2" : `lag-${Math.min(lag, 2)}`;
    if (lag === null || lag > 0) behind += 1;
    const seen = cell(`${age.toFixed(0)} s ago`);
    if (age > STALE_S) {
      stale += 1;
      row.className = "stale";
      const flag = document.createElement("span");
      flag.className = "flag";
      flag.textContent = "stale";
      seen.append(" ", flag);
    }
    row.append(cell(node.node_id), cell(node.engine || "-"), cell(node.version ?? "none"), cell(lag ?? "-", `lag ${lagClass}`), seen);
    return row;
  });
  $("fleet").tBodies[0].replaceChildren(...rows);
  $("fleet-summary").textContent = `${nodes.length} node(s), ${behind} behind, ${stale} stale`;
  recordFleet(Date.now() / 1000, nodes);
}

function recordFleet(t, nodes) {
  const n = state.fleetTimes.length;
  state.fleetTimes.push(t);
  state.headSeries.push(state.head);
  for (const node of nodes) {
    if (!state.fleetSeries.has(node.node_id)) state.fleetSeries.set(node.node_id, new Array(n).fill(null));
  }
  for (const [id, series] of state.fleetSeries) {
    const node = nodes.find((x) => x.node_id === id);
    series.push(node ? node.version : null);
  }
  if (state.fleetTimes.length > FLEET_SAMPLES) {
    state.fleetTimes.shift();
    state.headSeries.shift();
    for (const series of state.fleetSeries.values()) series.shift();
  }
  const ids = [...state.fleetSeries.keys()];
  const stepped = uPlot.paths.stepped({ align: 1 });
  const series = [{}, { label: "head", stroke: "#1d1f21", width: 2, paths: stepped }];
  ids.forEach((id, i) =>
    series.push({ label: id, stroke: palette(i), width: 1, paths: stepped, points: { size: 4 } }),
  );
  draw("fleet", series, [state.fleetTimes, state.headSeries, ...ids.map((id) => state.fleetSeries.get(id))], {
    time: true,
  });
}

// ---- charts -------------------------------------------------------------------------

function palette(i) {
  return `hsl(${(i * 137.5) % 360}, 65%, 45%)`;
}

function drawVersions() {
  const xs = state.versions.map((v) => v.version);
  const split = (value) => [
    state.versions.map((v) => (v.kind === "delta" ? value(v) : null)),
    state.versions.map((v) => (v.kind === "full" ? value(v) : null)),
  ];
  // Points are drawn where uPlot finds room for them (its default): 1,000 forced markers
  // per chart took about 0.2 s of the first render in headless Chromium on 2 cores.
  const kinds = (unit) => [
    {},
    { label: `delta ${unit}`, stroke: "#1a73e8", width: 1, points: { size: 4 }, spanGaps: true },
    { label: `keyframe ${unit}`, stroke: "#d93025", width: 0, points: { show: true, size: 9, fill: "#d93025" } },
  ];
  draw("bytes", kinds("bytes"), [xs, ...split((v) => v.bytes)], { values: (u, ticks) => ticks.map(bytes) });
  draw("changed", kinds("fraction"), [xs, ...split((v) => v.changed_fraction)], { y: { range: [0, 1] } });
  draw("latency", [{}, { label: "commit ms", stroke: "#188038", width: 1, points: { size: 4 } }], [
    xs,
    state.versions.map((v) => (v.commit_s === null ? null : v.commit_s * 1000)),
  ]);
}

function bytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) {
    n /= 1000;
    i += 1;
  }
  return `${+n.toFixed(1)} ${units[i]}`;
}

// `time`: the x axis holds seconds since the epoch; `values`: how the y axis labels its ticks;
// `y`: the y scale's options.
function draw(name, series, data, { time = false, values, y = {} } = {}) {
  const element = $(`chart-${name}`);
  const old = state.charts[name];
  if (old && old.series.length === series.length) {
    old.setData(data);
    return;
  }
  if (old) old.destroy();
  const width = Math.max(320, element.clientWidth || 460);
  state.charts[name] = new uPlot(
    {
      width,
      height: 200,
      series,
      scales: { x: { time }, y },
      axes: [{}, { size: 70, ...(values ? { values } : {}) }],
      legend: { show: series.length <= 12 },
    },
    data,
    element,
  );
}

// ---- start --------------------------------------------------------------------------

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value);
  $("token").value = "";
  stopStream();
  state.run = null;
  connect();
});
$("logout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  stopStream();
  say("token forgotten");
});
window.addEventListener("hashchange", () => guarded(async () => openRun(chosenRun(await loadRuns()))));

if (token() === null) say("Enter a read token to connect (empty if this board allows anonymous reads).");
else connect();
