// The coding-stack console: live from /events, /v1/models, /running, /healthz,
// /logs/<model>/stream and /ui/activity on this origin, and, for an admin key with
// the key store on, /admin/keys and /admin/usage. No library, no build step.
// A `use` key (the key store's role without the admin routes: /load, /unload,
// /logs, /upstream, /admin) is told by its 403 admin_only on /admin/keys, asked
// at start: its console shows no Load / Unload and no log, and asks no admin route
// again until the key is changed.
// The API key (when the stack has one) lives in localStorage and goes only in the
// Authorization header: /events and the log are read with fetch() streams, not
// EventSource (which cannot send headers). A new key's token is kept only in the
// box that shows it, until that box is closed. Every array here is bounded.
"use strict";

const KEY_STORE = "coding-stack.api-key";
const MAX_ACTIVITY = 200;      // as the proxy's ring
const SHOWN_ACTIVITY = 50;
const MAX_LOG_LINES = 1000;
const MAX_SAMPLES = 300;       // one per POLL_MS: 10 minutes
const POLL_MS = 2000;
const CALL_MS = 10000;         // a poll's call that has not answered by then is given up
const MODELS_EVERY_MS = 10000;
const KEYS_EVERY_MS = 10000;
const USAGE_DAYS = 7;
const STALE_MS = 45000;        // no byte on /events for this long: reconnect
const TPS_WINDOW_S = 10;

const S = {
  authed: false,
  models: [],             // /v1/models entries
  modelIds: "",
  status: {},             // id -> {value, failure?, ...} (events and /v1/models)
  progress: {},           // id -> the last `progress` / `downloading` event
  loadT0: {},             // id -> Date.now() when its load_started arrived
  running: null,          // /running
  runningAt: 0,           // Date.now() when /running answered
  activity: [],
  seq: 0,
  samples: [],
  lastEvent: null,
  events: null,           // {ctl, lastByte}
  log: null,              // {model, ctl}
  timers: [],
  pollTimer: null,        // the next poll (one at a time)
  pollGen: 0,             // bumped by stopAll: an older poll chain ends
  refreshTimer: null,
  modelsAt: 0,
  callMs: CALL_MS,        // (a test shortens it)
  keys: freshKeys(),      // the keys section (/admin/keys, /admin/usage)
};

// state: "unknown" (not asked yet), "on" (an admin key, the store on), "off" (no
// store: 404 keys_off), "forbidden" (a `use` key: 403 admin_only, on /admin/keys or
// any other admin route). The last two are asked once per start. error: what the
// last refresh met (a 503, no answer); the last list is kept and shown under it.
function freshKeys() {
  return { state: "unknown", list: null, usage: null, error: "", at: 0, listAt: 0,
           asked: 0, kept: 0 };
}

// A poll's calls end: one that hangs must not hold the one poll chain forever.
const bounded = () => ({ signal: AbortSignal.timeout(S.callMs) });

class AuthError extends Error {}

const $ = (id) => document.getElementById(id);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function authHeaders() {
  const k = localStorage.getItem(KEY_STORE);
  return k ? { Authorization: "Bearer " + k } : {};
}

async function api(path, opts = {}) {
  const keys = S.keys;                // this start's: a later key's state is not ours to set
  const r = await fetch(path, {
    ...opts, cache: "no-store", credentials: "omit",
    headers: { ...authHeaders(), ...(opts.headers || {}) },
  });
  if (r.status === 401) {
    needKey(localStorage.getItem(KEY_STORE) ? "That key was refused." : "");
    throw new AuthError("401");
  }
  if (r.status === 403) {
    let code = "";
    try { code = ((await r.clone().json()).error || {}).code; } catch (e) { code = ""; }
    if (code === "admin_only") notAdmin(keys);
  }
  return r;
}

// A `use` key: no admin route is asked again (the log follow ends, Load / Unload
// and the keys section go) until the key is changed (start() asks afresh).
const isUseKey = () => S.keys.state === "forbidden";

function notAdmin(keys) {
  if (keys.state === "forbidden") return;
  keys.state = "forbidden";
  if (keys !== S.keys) return;
  stopLog();
  render();
}

async function apiJson(path, opts) {
  const r = await api(path, opts);
  let body = null;
  try { body = await r.json(); } catch (e) { body = null; }
  if (!r.ok) {
    const err = body && body.error ? body.error : {};
    const e = new Error(err.message || "HTTP " + r.status);
    e.status = r.status;
    e.code = err.code || "";
    throw e;
  }
  return body;
}

// ------------------------------------------------------------------ the key
function needKey(message) {
  stopAll();
  S.authed = false;
  S.models = []; S.modelIds = ""; S.status = {}; S.progress = {}; S.loadT0 = {}; S.running = null;
  S.activity = []; S.seq = 0; S.samples = []; S.lastEvent = null;
  S.keys = freshKeys();
  $("main").hidden = true;
  $("models").tBodies[0].textContent = "";
  $("activity").tBodies[0].textContent = "";
  $("log").textContent = "";
  clearKeys();
  $("keybox").hidden = false;
  $("key-msg").textContent = message || "";
  $("forget-key").hidden = !localStorage.getItem(KEY_STORE);
  setConn("key", "API key needed");
  $("key").focus();
}

function stopAll() {
  for (const t of S.timers) clearInterval(t);
  S.timers = [];
  S.pollGen++;
  clearTimeout(S.pollTimer);
  if (S.events) { S.events.ctl.abort(); S.events = null; }
  stopLog();
}

// ------------------------------------------------------------------ start
// The models and, with a key given, its role (GET /admin/keys: 403 admin_only for
// a `use` key) are asked before anything shows: a `use` key never sees a Load
// button nor asks for a log. No key given: the door is open (an admin's) or asks
// for one; the first poll asks /admin/keys, and a closed door counts one failure.
async function start() {
  stopAll();
  S.keys = freshKeys();
  const jobs = [refreshModels()];
  if (localStorage.getItem(KEY_STORE)) jobs.push(refreshKeys());
  const [models, ...rest] = await Promise.allSettled(jobs);
  if ([models, ...rest].some((r) => r.status === "rejected" && r.reason instanceof AuthError)) return;
  if (models.status === "rejected") setConn("reconnecting", "reconnecting");
  S.authed = true;
  renderRole();
  $("keybox").hidden = true;
  $("main").hidden = false;
  $("forget-key").hidden = !localStorage.getItem(KEY_STORE);
  S.events = { ctl: new AbortController(), lastByte: Date.now(), conn: null };
  followEvents(S.events);
  poll();
  S.timers.push(setInterval(render, 1000));
}

// A streamed answer's body, decoded, piece by piece as it arrives.
async function* texts(r) {
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    yield dec.decode(value, { stream: true });
  }
}

// ------------------------------------------------------------------ /events
async function followEvents(state) {
  let backoff = 500;
  while (!state.ctl.signal.aborted) {
    const conn = new AbortController();
    state.conn = conn;
    const onAbort = () => conn.abort();
    state.ctl.signal.addEventListener("abort", onAbort);
    try {
      const r = await api("/events", { signal: conn.signal, headers: { Accept: "text/event-stream" } });
      if (!r.ok || !r.body) throw new Error("HTTP " + r.status);
      state.lastByte = Date.now();
      let buf = "";
      for await (const text of texts(r)) {
        state.lastByte = Date.now();
        buf += text.replace(/\r\n?/g, "\n");
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, i);
          buf = buf.slice(i + 2);
          const data = block.split("\n").filter((l) => l.startsWith("data:"))
            .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
          if (!data) continue;
          let ev = null;
          try { ev = JSON.parse(data); } catch (e) { continue; }
          backoff = 500;
          setConn("live", "live");
          onEvent(ev);
        }
        if (buf.length > 1 << 20) buf = "";          // no event is that big
      }
    } catch (e) {
      if (e instanceof AuthError) return;
    } finally {
      state.ctl.signal.removeEventListener("abort", onAbort);
    }
    if (state.ctl.signal.aborted) return;
    setConn("reconnecting", "reconnecting");
    await sleep(backoff);
    backoff = Math.min(backoff * 2, 10000);
  }
}

function onEvent(ev) {
  const m = ev.model;
  S.lastEvent = ev;
  switch (ev.event) {
    case "state":
      if (ev.models) S.status = { ...ev.models };
      break;
    case "load_started":      // expected_seconds: from this model's past loads
      if (m) {
        S.status[m] = { value: "loading", expected_seconds: ev.expected_seconds };
        delete S.progress[m]; S.loadT0[m] = Date.now();
      }
      break;
    case "ready":
      if (m) { S.status[m] = { value: "loaded" }; delete S.progress[m]; }
      break;
    case "unloading":
      if (m) S.status[m] = { value: "unloading" };
      break;
    case "unloaded":
      if (m && (S.status[m] || {}).value !== "failed") S.status[m] = { value: "unloaded" };
      break;
    case "load_failed":
      if (m) S.status[m] = { value: "failed", failure: ev.error };
      break;
    case "progress":
      if (m) S.progress[m] = ev;
      break;
    case "download_started":
    case "download_progress": {
      if (m) {
        const { event, time, model, ...fields } = ev;
        S.status[m] = { ...(S.status[m] || {}), ...fields, value: "downloading" };
      }
      break;
    }
    case "downloaded":
      if (m) S.status[m] = { value: "unloaded" };
      break;
    case "download_failed":
      if (m) S.status[m] = { value: "failed", failure: ev.error };
      break;
  }
  refreshSoon();
  render();
}

// ------------------------------------------------------------------ polling
function refreshSoon() {
  if (S.refreshTimer) return;
  S.refreshTimer = setTimeout(async () => {
    S.refreshTimer = null;
    try { await Promise.all([refreshModels(), refreshRunning()]); } catch (e) { /* next poll */ }
    render();
  }, 300);
}

async function refreshModels() {
  const body = await apiJson("/v1/models", bounded());
  S.modelsAt = Date.now();
  S.models = (body && body.data) || [];
  for (const mdl of S.models) if (mdl.status) S.status[mdl.id] = mdl.status;
}

async function refreshRunning() {
  S.running = await apiJson("/running", bounded());
  S.runningAt = Date.now();
  followLogOf(S.running);
}

// Entries are keyed by their sequence number: one that is already listed (an answer
// that raced another) is never appended again.
async function refreshActivity() {
  const body = await apiJson("/ui/activity?since=" + S.seq, bounded());
  if (body.newest < S.seq) {          // the proxy restarted: start over
    S.seq = 0; S.activity = [];
    return refreshActivity();
  }
  for (const e of body.data || []) if (e.seq > S.seq) { S.activity.push(e); S.seq = e.seq; }
  if (S.activity.length > MAX_ACTIVITY) S.activity.splice(0, S.activity.length - MAX_ACTIVITY);
}

async function refreshHealth() {
  const h = $("health");
  try {
    const r = await fetch("/healthz", { cache: "no-store", credentials: "omit", ...bounded() });
    const body = await r.json();
    const up = body.upstream || {};
    if (up.status === "unreachable") {
      h.dataset.state = "unreachable"; h.textContent = "swapper: unreachable";
    } else if (up.body && up.body.docker === false) {
      h.dataset.state = "degraded"; h.textContent = "swapper: Docker unreachable";
    } else if (up.status === "ok") {
      h.dataset.state = "ok"; h.textContent = "swapper: ok";
    } else {
      h.dataset.state = "degraded"; h.textContent = "swapper: " + (up.status || "?");
    }
  } catch (e) {
    h.dataset.state = "unreachable"; h.textContent = "proxy: unreachable";
  }
}

// One poll at a time: the next starts POLL_MS after this one ended, so a slow link
// never has two polls asking for the same activity at once. A poll of an older
// start (stopAll bumps pollGen) schedules nothing.
async function poll(gen = S.pollGen) {
  if (!S.authed || gen !== S.pollGen) return;
  try {
    const jobs = [refreshRunning(), refreshActivity(), refreshHealth()];
    if (Date.now() - S.modelsAt > MODELS_EVERY_MS) jobs.push(refreshModels());
    if (Date.now() - S.keys.at > KEYS_EVERY_MS) jobs.push(refreshKeys());
    const results = await Promise.allSettled(jobs);
    if (results.some((r) => r.status === "rejected" && r.reason instanceof AuthError)) return;
    if (S.events && Date.now() - S.events.lastByte > STALE_MS && S.events.conn) {
      S.events.conn.abort();            // a silent stream: reconnect
      S.events.lastByte = Date.now();
    }
    sample();
    render();
  } finally {
    if (S.authed && gen === S.pollGen) {
      clearTimeout(S.pollTimer);
      S.pollTimer = setTimeout(() => poll(gen), POLL_MS);
    }
  }
}

function sample() {
  const now = Date.now() / 1000;
  let tokens = 0;
  for (const e of S.activity) {
    const end = (e.time || 0) + (e.seconds || 0);
    if (end > now - TPS_WINDOW_S && e.completion_tokens) tokens += e.completion_tokens;
  }
  const r = S.running || {};
  S.samples.push({ t: now, tps: tokens / TPS_WINDOW_S, queued: r.queued || 0, inflight: r.in_flight || 0 });
  if (S.samples.length > MAX_SAMPLES) S.samples.splice(0, S.samples.length - MAX_SAMPLES);
}

// ------------------------------------------------------------------ the log
function followLogOf(running) {
  if (isUseKey()) return;
  const model = running && running.model && ["loading", "ready"].includes(running.state)
    ? running.model : null;
  if (!model || (S.log && S.log.model === model)) return;
  stopLog();
  const state = { model, ctl: new AbortController() };
  S.log = state;
  $("log-model").textContent = "(" + model + ")";
  logLine("── " + model + " ──");
  followLog(state);
}

function stopLog() {
  if (S.log) { S.log.ctl.abort(); S.log = null; }
}

async function followLog(state) {
  let backoff = 1000;
  let tail = 200;
  while (!state.ctl.signal.aborted) {
    try {
      const r = await api("/logs/" + encodeURIComponent(state.model) + "/stream?tail=" + tail,
        { signal: state.ctl.signal });
      if (r.ok && r.body) {
        let buf = "";
        for await (const text of texts(r)) {
          buf += text;
          const lines = buf.split("\n");
          buf = lines.pop();
          logLines(lines.map((l) => l.replace(/\r$/, "")));
          if (buf.length > 65536) { logLine(buf); buf = ""; }
          backoff = 1000;
        }
        if (buf) logLine(buf);
        tail = 0;                     // a reconnect follows on, it does not repeat
      }
    } catch (e) {
      if (e instanceof AuthError) return;
    }
    if (state.ctl.signal.aborted) return;
    await sleep(backoff);
    backoff = Math.min(backoff * 2, 10000);
    // Still the resident model? (followLogOf starts another follower otherwise.)
    const r = S.running;
    if (!r || r.model !== state.model) { if (S.log === state) S.log = null; return; }
  }
}

// A chunk of lines at once: one layout read, one append, one trim (a line at a time,
// each reading the scroll position, froze the page for seconds on a burst of lines).
function logLines(texts) {
  if (!texts.length) return;
  const pre = $("log");
  const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
  const frag = document.createDocumentFragment();
  for (const t of texts.slice(-MAX_LOG_LINES)) frag.appendChild(document.createTextNode(t + "\n"));
  pre.appendChild(frag);
  for (let extra = pre.childNodes.length - MAX_LOG_LINES; extra > 0; extra--) pre.removeChild(pre.firstChild);
  if (stick) pre.scrollTop = pre.scrollHeight;
}

function logLine(text) { logLines([text]); }

// ------------------------------------------------------------------ actions
// A button stays focusable (and focused) through its action: aria-disabled while it
// runs or while it has nothing to do; a press then does nothing.
async function act(button, path, what) {
  if (isUseKey() || button.getAttribute("aria-disabled") === "true" || button.dataset.busy) return;
  button.dataset.busy = "1";
  button.setAttribute("aria-disabled", "true");
  announce(what + "…");
  try {
    const body = await apiJson(path, { method: "POST" });
    if (body && body.loaded) toast(what + ": " + body.loaded + " ready in " + body.seconds + " s");
  } catch (e) {
    if (!(e instanceof AuthError)) toast(what + " failed: " + e.message);
  } finally {
    delete button.dataset.busy;
    button.setAttribute("aria-disabled", "false");
    refreshSoon();
    render();
  }
}

// Status changes, said once to a screen reader (a polite live region that is never
// hidden; the toast comes and goes).
function announce(text) {
  const a = $("announce");
  if (a.textContent === text) a.textContent = "";
  a.textContent = text;
}

let toastTimer = null;
function toast(text) {
  const t = $("toast");
  announce(text);
  t.textContent = text;
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => { t.hidden = true; }, 8000);
}

// ------------------------------------------------------------------ rendering
function setConn(state, text) {
  const c = $("conn");
  if (c.textContent !== text && state !== "starting") announce("connection: " + text);
  c.dataset.state = state;
  c.textContent = text;
}

function fmtSeconds(s) {
  if (s == null || !isFinite(s)) return "–";
  if (s < 1) return Math.round(s * 1000) + " ms";
  if (s < 90) return s.toFixed(1) + " s";
  if (s < 5400) return Math.floor(s / 60) + " min " + Math.round(s % 60) + " s";
  return (s / 3600).toFixed(1) + " h";
}

function fmtBytes(n) {
  if (n == null || !isFinite(n)) return "?";
  const u = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < u.length - 1) { n /= 1000; i++; }
  return n.toFixed(i ? 1 : 0) + " " + u[i];
}

function pick(obj, names) {
  for (const n of names) if (obj && obj[n] != null) return obj[n];
  return null;
}

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text != null) e.textContent = text;
  return e;
}

function residentSince() {
  const r = S.running;
  if (!r || r.since_seconds == null) return null;
  return r.since_seconds + (Date.now() - S.runningAt) / 1000;
}

function buildModelRows() {
  const ids = S.models.map((m) => m.id).join("\n");
  if (ids === S.modelIds) return;
  S.modelIds = ids;
  const tbody = $("models").tBodies[0];
  tbody.textContent = "";
  for (const m of S.models) {
    const tr = el("tr");
    tr.dataset.model = m.id;
    const vram = pick(m, ["vram", "vram_gb", "estimated_vram", "vram_estimate"]);
    tr.append(el("td", "id", m.id), el("td", null, (m.aliases || []).join(", ")),
      el("td", null, m.kind || ""), el("td", null, (m.gpus || []).length ? "GPU " + m.gpus.join(", ") : "CPU"),
      el("td", "num", m.context_length ? String(m.context_length) : "–"),
      el("td", "num", vram == null ? "–" : (typeof vram === "number" ? vram + " GB" : String(vram))));
    const st = el("td", "status");
    st.append(el("span", "value"), el("span", "detail"));
    const actions = el("td", "actions");
    // Named per model for a screen reader ("Load qwen-35b"); never `disabled` (a
    // disabled button drops the keyboard focus): aria-disabled, and act() refuses.
    const load = el("button", "load", "Load");
    load.type = "button";
    load.setAttribute("aria-label", "Load " + m.id);
    load.addEventListener("click", () => act(load, "/load/" + encodeURIComponent(m.id), "load " + m.id));
    const unload = el("button", "unload", "Unload");
    unload.type = "button";
    unload.setAttribute("aria-label", "Unload " + m.id);
    unload.addEventListener("click", () => act(unload, "/unload", "unload " + m.id));
    actions.append(load, unload);
    tr.append(st, actions);
    tbody.append(tr);
  }
}

function statusText(id) {
  const st = S.status[id] || { value: "unloaded" };
  const p = S.progress[id];
  let detail = "";
  if (st.value === "loading") {
    const r = S.running;
    const elapsed = r && r.model === id && r.state === "loading" ? residentSince()
      : S.loadT0[id] ? (Date.now() - S.loadT0[id]) / 1000 : pick(p, ["seconds"]) ?? st.elapsed_seconds;
    detail = fmtSeconds(elapsed);
    const expected = pick(st, ["expected_seconds"]) ?? pick(p, ["expected_seconds"]);
    if (expected != null && elapsed != null) {       // past it: what it usually takes
      detail += expected - elapsed > 0.5 ? " · ~" + fmtSeconds(expected - elapsed) + " left"
        : " · usually " + fmtSeconds(expected);
    }
    if (p && p.detail) detail += " · " + p.detail;
  } else if (st.value === "downloading") {
    // The swapper's fields (scheduler.download_progress): done_bytes, total_bytes,
    // bytes_per_second, eta_seconds (any of them null until known); waiting_for
    // while another model's download on the same disk goes first.
    if (st.waiting_for) {
      detail = st.waiting_for === "another process"     // the swapper's OTHER_PROCESS
        ? "after another process's download into MODELS_DIR"
        : "after " + st.waiting_for + "'s download (same disk)";
    } else {
      const parts = [fmtBytes(st.done_bytes || 0) + (st.total_bytes ? " / " + fmtBytes(st.total_bytes) : "")];
      if (st.bytes_per_second) parts.push(fmtBytes(st.bytes_per_second) + "/s");
      if (st.eta_seconds != null) parts.push("~" + fmtSeconds(st.eta_seconds) + " left");
      detail = parts.join(" · ");
    }
  } else if (st.value === "failed") {
    detail = st.failure || "";
  }
  const fraction = st.value === "downloading" && st.total_bytes
    ? Math.max(0, Math.min(1, (st.done_bytes || 0) / st.total_bytes)) : null;
  return { value: st.value, detail, done: fraction };
}

function renderModels() {
  buildModelRows();
  for (const tr of $("models").tBodies[0].rows) {
    const id = tr.dataset.model;
    const s = statusText(id);
    const cell = tr.querySelector("td.status");
    if (cell.dataset.value && cell.dataset.value !== s.value) announce(id + ": " + s.value);
    cell.dataset.value = s.value;
    cell.querySelector(".value").textContent = s.value;
    const d = cell.querySelector(".detail");
    d.textContent = s.detail;
    d.title = s.detail;
    let bar = cell.querySelector(".bar");
    if (s.done != null) {
      if (!bar) { bar = el("span", "bar"); bar.append(el("i")); cell.append(bar); }
      bar.firstChild.style.width = (s.done * 100).toFixed(1) + "%";
    } else if (bar) bar.remove();
    const unload = tr.querySelector("button.unload");
    if (!unload.dataset.busy) {
      unload.setAttribute("aria-disabled", String(!["loaded", "loading", "downloading"].includes(s.value)));
    }
  }
}

// A `use` key: the actions column and the log give way to a line saying why.
function renderRole() {
  const use = isUseKey();
  if ($("main").dataset.role === (use ? "use" : "admin")) return;
  $("main").dataset.role = use ? "use" : "admin";
  $("models-note").hidden = !use;
  $("log-note").hidden = !use;
  $("log").hidden = use;
  if (use) { $("log").textContent = ""; $("log-model").textContent = ""; }
}

function renderResident() {
  const r = S.running;
  $("r-model").textContent = r && r.model ? r.model : "none";
  $("r-phase").textContent = r ? r.state : "–";
  $("r-since").textContent = r ? fmtSeconds(residentSince()) + " ago" : "–";
  $("r-inflight").textContent = r ? String(r.in_flight) + (r.slots ? " / " + r.slots + " slots" : "") : "–";
  $("r-queued").textContent = r ? String(r.queued) : "–";
  $("r-lastload").textContent = secs(r && r.last_load_seconds);
  $("r-lastswap").textContent = secs(r && r.last_swap_seconds);
  // What the last swap cost phase by phase, and what its first answers still
  // re-prefilled; the share of the GPU's busy time spent answering (swapper/swaps.py).
  const sw = r && r.swaps;
  const last = sw && sw.last_swap;
  $("r-phases").textContent = last
    ? Object.entries(last.phases).map(([k, v]) => k + " " + secs(v)).join(", ")
      + (last.saved ? "; saved " + last.saved.prompts + " prompt" + (last.saved.prompts === 1 ? "" : "s") + " (" + fmtBytes(last.saved.bytes) + ")" : "")
      + (last.restored ? "; restored " + last.restored.prompts : "")
      + "; re-prefilled " + last.reprefill.tokens.toLocaleString() + " tokens (" + secs(last.reprefill.seconds) + ")"
    : "–";
  const share = sw && sw.last_hour && sw.last_hour.serving_share;
  $("r-share").textContent = share != null
    ? (share * 100).toFixed(1) + " % (" + secs(sw.last_hour.swap_seconds) + " swapping, "
      + secs(sw.last_hour.reprefill_seconds) + " re-prefilling)"
    : "–";
  // Saved prompt caches on disk (KV_CACHE_DIR; off when unset).
  const kv = r && r.kv_cache;
  $("r-kept").textContent = !r ? "–" : !kv ? "off (KV_CACHE_DIR unset)"
    : Object.values(kv.models).reduce((n, m) => n + m.prompts, 0) + " prompts, "
      + fmtBytes(kv.bytes) + " of " + fmtBytes(kv.max_bytes)
      + " (up to " + kv.conversations_per_model + " conversations a model)";
  // Swaps per hour and the GPU's seconds lost to them; why another model waits.
  $("r-loads").textContent = r && r.loads_last_hour != null
    ? r.loads_last_hour + " (" + secs(r.load_seconds_last_hour) + " loading)" : "–";
  const h = r && r.hold;
  $("r-hold").textContent = h
    ? "for " + h.sessions + " agent session" + (h.sessions === 1 ? "" : "s") + " up to "
      + secs(h.until_seconds) + "; " + (h.waiting_model || "another model") + " in "
      + secs(h.quantum_ends_in) + " at most"
    : r && r.policy === "fifo" ? "never (SWAP_POLICY=fifo)" : "no";
  const downloads = Object.entries(S.status).filter(([, st]) => st.value === "downloading")
    .map(([id, st]) => id + " " + fmtBytes(st.done_bytes) + (st.total_bytes ? " / " + fmtBytes(st.total_bytes) : ""));
  $("r-downloads").textContent = downloads.length ? downloads.join(", ") : "none";
  const e = S.lastEvent;
  $("r-event").textContent = e ? e.event + (e.model ? " " + e.model : "") + " at "
    + new Date(e.time * 1000).toLocaleTimeString() : "–";
}

function renderActivity() {
  const tbody = $("activity").tBodies[0];
  const shown = S.activity.slice(-SHOWN_ACTIVITY).reverse();
  const key = shown.map((e) => e.seq).join(",");
  $("activity-empty").hidden = shown.length > 0;
  if (tbody.dataset.key === key) return;
  tbody.dataset.key = key;
  tbody.textContent = "";
  for (const e of shown) {
    const tr = el("tr");
    tr.dataset.seq = e.seq;
    for (const [cls, text] of ACTIVITY_COLUMNS) tr.append(el("td", cls, text(e)));
    tbody.append(tr);
  }
}

// The activity table's cells (class, text), in the order of its header.
const num = (v) => (v == null ? "–" : String(v));
const secs = (v) => (v == null ? "–" : fmtSeconds(v));
const ACTIVITY_COLUMNS = [
  [null, (e) => new Date(e.time * 1000).toLocaleTimeString()],
  ["dialect", (e) => e.dialect + (e.stream ? " (stream)" : "")],
  ["model", (e) => e.model || "–"],
  ["status", (e) => String(e.status)],
  ["num wait", (e) => secs(e.queue_wait)],
  ["num ttft", (e) => secs(e.ttft)],
  ["num tokens-in", (e) => num(e.prompt_tokens)],
  ["num tokens-out", (e) => num(e.completion_tokens)],
  ["num tps", (e) => num(e.tokens_per_second)],
  ["num rounds", (e) => num(e.search_rounds)],
  ["num", (e) => fmtSeconds(e.seconds)],
];

const SVG = "http://www.w3.org/2000/svg";
function renderChart() {
  const svg = $("chart");
  const W = 600, H = 140, pad = 16;
  const xs = S.samples;
  svg.textContent = "";
  const now = Date.now() / 1000, span = MAX_SAMPLES * POLL_MS / 1000;
  const x = (t) => pad + (W - 2 * pad) * (1 - (now - t) / span);
  const maxT = Math.max(1, ...xs.map((s) => s.tps));
  const maxQ = Math.max(2, ...xs.map((s) => Math.max(s.queued, s.inflight)));
  for (const f of [0, 0.5, 1]) {
    const line = document.createElementNS(SVG, "line");
    line.setAttribute("class", "grid");
    line.setAttribute("x1", pad); line.setAttribute("x2", W - pad);
    line.setAttribute("y1", H - pad - f * (H - 2 * pad)); line.setAttribute("y2", H - pad - f * (H - 2 * pad));
    svg.append(line);
  }
  const label = (text, lx, ly, anchor) => {
    const t = document.createElementNS(SVG, "text");
    t.setAttribute("x", lx); t.setAttribute("y", ly); t.setAttribute("text-anchor", anchor);
    t.textContent = text; svg.append(t);
  };
  label(maxT.toFixed(maxT < 10 ? 1 : 0) + " tok/s", pad, pad - 4, "start");
  label(maxQ + " requests", W - pad, pad - 4, "end");
  const series = (cls, f, max) => {
    if (xs.length < 2) return;
    const p = document.createElementNS(SVG, "polyline");
    p.setAttribute("class", cls);
    p.setAttribute("points", xs.map((s) => x(s.t).toFixed(1) + "," +
      (H - pad - (f(s) / max) * (H - 2 * pad)).toFixed(1)).join(" "));
    svg.append(p);
  };
  series("tps", (s) => s.tps, maxT);
  series("queue", (s) => s.queued, maxQ);
  series("inflight", (s) => s.inflight, maxQ);
  const last = xs[xs.length - 1] || { tps: 0, queued: 0, inflight: 0 };
  $("c-tps").textContent = last.tps.toFixed(1);
  $("c-queue").textContent = String(last.queued);
  $("c-inflight").textContent = String(last.inflight);
}

function render() {
  if (!S.authed) return;
  renderRole();
  renderModels();
  renderResident();
  renderActivity();
  renderChart();
  renderKeys();
}

// ------------------------------------------------------------------ keys
// The keys section: the admin API only (GET /admin/keys?revoked=1, GET /admin/usage,
// POST /admin/keys, POST /admin/keys/<name>, POST /admin/keys/<name>/revoke), every
// change a POST with a JSON body. Shown for an admin key (or API_KEY) with the key
// store on; a `use` key (403 admin_only) never sees it.
const utcDay = (offset) => new Date(Date.now() + offset * 86400000).toISOString().slice(0, 10);

// A poll's refresh and an action's may overlap: only the answers of the latest one
// asked are kept (an older answer, from before a change, never hides it). The usage
// is asked once the list answered: a `use` key asks one admin route, not two.
async function refreshKeys() {
  const k = S.keys;
  if (k.state === "off" || k.state === "forbidden") return;
  const ticket = ++k.asked;
  try {
    const list = await apiJson("/admin/keys?revoked=1", bounded());
    const usage = await apiJson("/admin/usage?since=" + utcDay(1 - USAGE_DAYS), bounded());
    if (ticket < k.kept) return;
    k.kept = ticket;
    k.state = "on";
    k.list = list.keys || [];
    k.usage = usage;
    k.listAt = Date.now();
    k.error = "";
  } catch (e) {
    if (e instanceof AuthError) throw e;
    if (ticket < k.kept) return;
    k.kept = ticket;
    if (e.code === "admin_only") k.state = "forbidden";
    else if (e.code === "keys_off") k.state = "off";
    else k.error = callError(e);
  } finally {
    k.at = Date.now();
  }
}

function callError(e) {
  if (e.name === "TimeoutError") return "no answer within " + Math.round(S.callMs / 1000) + " s";
  if (e instanceof TypeError) return "the proxy cannot be reached";
  return e.message + (e.status ? " (HTTP " + e.status + ")" : "");
}

// A state change: POST with a JSON body (the origin guard refuses a browser's body
// in any other type). Its error goes to `out` (the form's or the box's message).
async function keyCall(button, path, body, out) {
  if (button.getAttribute("aria-disabled") === "true") return null;
  button.setAttribute("aria-disabled", "true");
  out.textContent = "";
  try {
    return await apiJson(path, {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), ...bounded() });
  } catch (e) {
    if (!(e instanceof AuthError)) out.textContent = callError(e);
    return null;
  } finally {
    button.setAttribute("aria-disabled", "false");
  }
}

async function keysChanged(what) {
  announce(what);
  try { await refreshKeys(); } catch (e) { /* a 401: the key box is shown */ }
  render();
}

// A form's fields as the admin API takes them: models a list, a limit a number or
// null (empty: no limit), weight a number (empty: left out). An entry the browser
// cannot read as a number is an error here (its value would read as empty).
function keyFields(form, { clear }) {
  const out = {};
  const models = form.elements.models.value.split(",").map((m) => m.trim()).filter(Boolean);
  if (models.length || clear) out.models = models;
  for (const name of ["max_concurrent", "rpm", "tokens_per_day", "weight"]) {
    const input = form.elements[name];
    if (input.validity.badInput) throw new Error(name + ": not a number");
    const v = input.value.trim();
    if (v !== "") out[name] = Number(v);
    else if (clear && name !== "weight") out[name] = null;
  }
  return out;
}

async function createKey(ev) {
  ev.preventDefault();
  const form = $("key-new");
  const out = form.querySelector(".form-error");
  let body;
  try {
    body = { name: form.elements.namedItem("name").value.trim(), role: form.elements.role.value,
             ...keyFields(form, { clear: false }) };
  } catch (e) { out.textContent = e.message; return; }
  const made = await keyCall(form.querySelector("button[type=submit]"), "/admin/keys", body, out);
  if (!made) return;
  form.reset();
  showToken(made.key.name, made.token);
  keysChanged("key " + made.key.name + " made; its token is shown once");
}

function openEdit(key) {
  const form = $("key-edit");
  $("key-confirm").hidden = true;
  form.dataset.name = key.name;
  $("ke-name").textContent = key.name;
  form.elements.role.value = key.role;
  form.elements.models.value = key.models.join(",");
  for (const name of ["max_concurrent", "rpm", "tokens_per_day", "weight"]) {
    form.elements[name].value = key[name] == null ? "" : String(key[name]);
  }
  form.querySelector(".form-error").textContent = "";
  form.hidden = false;
  form.elements.models.focus();
}

async function saveEdit(ev) {
  ev.preventDefault();
  const form = $("key-edit");
  const out = form.querySelector(".form-error");
  let body;
  try {
    body = { role: form.elements.role.value, ...keyFields(form, { clear: true }) };
  } catch (e) { out.textContent = e.message; return; }
  const name = form.dataset.name;
  const done = await keyCall(form.querySelector("button[type=submit]"),
    "/admin/keys/" + encodeURIComponent(name), body, out);
  if (!done) return;
  form.hidden = true;
  await keysChanged("key " + name + " changed");
  focusKeyButton("Edit " + name);
}

function openRevoke(key) {
  const name = key.name;
  const box = $("key-confirm");
  $("key-edit").hidden = true;
  box.dataset.name = name;
  $("kc-text").textContent = "Revoke key " + name + "? Its token is refused within a second, "
    + "and a revoked key cannot be restored (a new key can take its name).";
  $("kc-yes").textContent = "Revoke " + name;
  box.querySelector(".form-error").textContent = "";
  box.hidden = false;
  $("kc-no").focus();
}

async function confirmRevoke() {
  const box = $("key-confirm");
  const name = box.dataset.name;
  const done = await keyCall($("kc-yes"), "/admin/keys/" + encodeURIComponent(name) + "/revoke",
    {}, box.querySelector(".form-error"));
  if (!done) return;
  box.hidden = true;
  keysChanged("key " + name + " revoked");
}

// The new key's token, in this box only (never stored, never in a URL), until the
// box is closed. It lives outside <main>: a first key made through an open door
// closes the door, and the key box that then replaces <main> leaves the token shown.
function showToken(name, token) {
  $("nt-name").textContent = name;
  const input = $("nt-token");
  input.value = token;
  $("nt-copied").textContent = "";
  $("new-token").hidden = false;
  input.focus();
  input.select();
}

function closeToken() {
  $("nt-token").value = "";
  $("nt-name").textContent = "";
  $("nt-copied").textContent = "";
  $("new-token").hidden = true;
  if (!$("main").hidden && !$("keys-body").hidden) $("key-new").elements.namedItem("name").focus();
}

// Back to a key's button (Edit / Revoke) when its form or box closes.
function focusKeyButton(label) {
  for (const b of $("keys").tBodies[0].querySelectorAll("button")) {
    if (b.getAttribute("aria-label") === label) { b.focus(); return; }
  }
}

async function copyToken() {
  const input = $("nt-token");
  let copied = false;
  try {
    await navigator.clipboard.writeText(input.value);      // a secure context: loopback, https
    copied = true;
  } catch (e) {
    input.focus();
    input.select();
    try { copied = document.execCommand("copy"); } catch (e2) { copied = false; }
  }
  $("nt-copied").textContent = copied ? "Copied." : "Selected: press Ctrl+C (⌘C) to copy it.";
  announce($("nt-copied").textContent);
}

function clearKeys() {
  for (const id of ["keys", "usage"]) {
    const t = $(id);
    t.tBodies[0].textContent = "";
    delete t.tBodies[0].dataset.key;
  }
  $("usage").tFoot.textContent = "";
  $("key-edit").hidden = true;
  $("key-confirm").hidden = true;
  $("keys-panel").hidden = true;
}

const int = (v) => (v == null ? "–" : Number(v).toLocaleString("en-US"));
const when = (t) => new Date(t * 1000).toLocaleString();

// Today's requests and tokens (prompt + completion) per key name, from the usage rows.
function usageToday() {
  const out = {};
  const today = utcDay(0);
  for (const r of (S.keys.usage && S.keys.usage.rows) || []) {
    if (r.day !== today) continue;
    const t = out[r.key] || (out[r.key] = { requests: 0, tokens: 0 });
    t.requests += r.requests;
    t.tokens += r.prompt_tokens + r.completion_tokens;
  }
  return out;
}

function renderKeys() {
  const k = S.keys;
  const shown = k.state === "on" || k.state === "off" || (k.state === "unknown" && k.error !== "");
  $("keys-panel").hidden = !shown;
  if (!shown) return;
  const msg = $("keys-msg");
  let text = "", kind = "note";
  if (k.state === "off") {
    text = "Keys are off: set KEYS_DB (SQLite) or KEYS_DATABASE_URL (PostgreSQL) to give each "
      + "person or tool a key of its own (docs/keys.md).";
  } else if (k.error) {
    kind = "error";
    text = "Keys: " + k.error + (k.list ? "; the list below is as of "
      + new Date(k.listAt).toLocaleTimeString() : "") + ". Trying again every "
      + KEYS_EVERY_MS / 1000 + " s.";
  } else if (!localStorage.getItem(KEY_STORE)) {
    text = "No key has been made yet, and API_KEY is not set: the door is open. The first key "
      + "closes it, and this console then asks for a key: make an admin key first and keep "
      + "its token.";
  }
  if (msg.textContent !== text) msg.textContent = text;
  msg.dataset.kind = kind;
  msg.hidden = !text;
  $("keys-body").hidden = !k.list;
  if (!k.list) return;
  renderKeyRows();
  renderUsage();
}

// The key table's cells (class, text), in the order of its header but the actions.
const KEY_COLUMNS = [
  ["name", (x) => x.name],
  ["role", (x) => x.role],
  ["models", (x) => x.models.join(", ")],
  ["num max-concurrent", (x) => int(x.max_concurrent)],
  ["num rpm", (x) => int(x.rpm)],
  ["num tokens-per-day", (x) => int(x.tokens_per_day)],
  ["num weight", (x) => String(x.weight)],
  ["created", (x) => when(x.created)],
  ["state", (x) => (x.revoked == null ? "active" : "revoked " + when(x.revoked))],
  ["num today", (x, t) => (t ? int(t.requests) + " req · " + int(t.tokens)
    + (x.tokens_per_day ? " / " + int(x.tokens_per_day) : "") + " tok" : "–")],
];

// Rows are kept per key (its name and when it was made) and their cells updated in
// place: a refresh never replaces a button under the pointer (a click whose press
// and release land on two different buttons is no click) nor the focused one.
function renderKeyRows() {
  const showRevoked = $("keys-revoked").checked;
  const keys = S.keys.list.filter((x) => showRevoked || x.revoked == null);
  const today = usageToday();
  const tbody = $("keys").tBodies[0];
  $("keys-empty").hidden = keys.length > 0;
  const old = new Map([...tbody.rows].map((tr) => [tr.dataset.id, tr]));
  keys.forEach((x, i) => {
    const id = x.name + "@" + x.created;
    let tr = old.get(id);
    old.delete(id);
    if (!tr) {
      tr = el("tr");
      tr.dataset.id = id;
      tr.dataset.name = x.name;
      for (const [cls] of KEY_COLUMNS) tr.append(el("td", cls));
      tr.append(el("td", "actions"));
    }
    KEY_COLUMNS.forEach(([, text], c) => {
      const v = text(x, today[x.name]);
      if (tr.cells[c].textContent !== v) tr.cells[c].textContent = v;
    });
    const actions = tr.cells[KEY_COLUMNS.length];
    if (x.revoked != null) {
      tr.dataset.revoked = "1";
      actions.textContent = "";
    } else if (!actions.firstChild) {
      actions.append(keyButton("edit", "Edit", x.name, openEdit),
        keyButton("revoke danger", "Revoke", x.name, openRevoke));
    }
    if (tbody.rows[i] !== tr) tbody.insertBefore(tr, tbody.rows[i] || null);
  });
  for (const tr of old.values()) tr.remove();
}

// A row's button ("Edit alice"), acting on the key as last listed.
function keyButton(cls, verb, name, action) {
  const b = el("button", cls, verb);
  b.type = "button";
  b.setAttribute("aria-label", verb + " " + name);
  b.addEventListener("click", () => {
    const x = S.keys.list && S.keys.list.find((k) => k.name === name && k.revoked == null);
    if (x) action(x);
  });
  return b;
}

// The usage rows of the last USAGE_DAYS days, summed per key and model.
const USAGE_COLUMNS = [
  ["num requests", (r) => int(r.requests)],
  ["num prompt", (r) => int(r.prompt_tokens)],
  ["num cached", (r) => int(r.cached_tokens)],
  ["num completion", (r) => int(r.completion_tokens)],
  ["num wait", (r) => secs(r.queue_wait_seconds)],
  ["num load", (r) => secs(r.load_seconds)],
];
const USAGE_FIELDS = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens",
  "queue_wait_seconds", "load_seconds"];

function renderUsage() {
  const u = S.keys.usage || { rows: [], totals: null, pending_rows: 0 };
  const sums = new Map();
  for (const r of u.rows || []) {
    const id = JSON.stringify([r.key, r.model]);
    const s = sums.get(id) || { key: r.key, model: r.model };
    for (const f of USAGE_FIELDS) s[f] = (s[f] || 0) + r[f];
    sums.set(id, s);
  }
  const rows = [...sums.values()].sort((a, b) => a.key.localeCompare(b.key) || a.model.localeCompare(b.model));
  const tbody = $("usage").tBodies[0];
  const sig = JSON.stringify([rows, u.totals]);
  let note = rows.length ? "" : "No model requests by a key in the last " + USAGE_DAYS + " days.";
  if (u.pending_rows) {
    note += (note ? " " : "") + u.pending_rows + " usage row(s) wait in this proxy worker's memory "
      + "for the key database.";
  }
  $("usage-msg").textContent = note;
  if (tbody.dataset.key === sig) return;
  tbody.dataset.key = sig;
  tbody.textContent = "";
  for (const r of rows) {
    const tr = el("tr");
    tr.dataset.key = r.key;
    tr.dataset.model = r.model;
    tr.append(el("td", "key-name", r.key), el("td", "model", r.model || "–"));
    for (const [cls, text] of USAGE_COLUMNS) tr.append(el("td", cls, text(r)));
    tbody.append(tr);
  }
  const foot = $("usage").tFoot;
  foot.textContent = "";
  if (rows.length && u.totals) {
    const tr = el("tr", "totals");
    tr.append(el("th", null, "total"), el("td"));
    for (const [cls, text] of USAGE_COLUMNS) tr.append(el("td", cls, text(u.totals)));
    foot.append(tr);
  }
}

// ------------------------------------------------------------------ wiring
$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const k = $("key").value.trim();
  if (!k) return;
  localStorage.setItem(KEY_STORE, k);
  $("key").value = "";
  $("key-msg").textContent = "";
  start();
});
$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEY_STORE);
  closeToken();
  needKey("");
});
$("key-new").addEventListener("submit", createKey);
$("key-edit").addEventListener("submit", saveEdit);
$("ke-cancel").addEventListener("click", () => {
  $("key-edit").hidden = true;
  focusKeyButton("Edit " + $("key-edit").dataset.name);
});
$("kc-yes").addEventListener("click", confirmRevoke);
$("kc-no").addEventListener("click", () => {
  $("key-confirm").hidden = true;
  focusKeyButton("Revoke " + $("key-confirm").dataset.name);
});
$("keys-revoked").addEventListener("change", renderKeys);
$("usage-refresh").addEventListener("click", () => keysChanged("usage refreshed"));
$("nt-copy").addEventListener("click", copyToken);
$("nt-done").addEventListener("click", closeToken);
start();
