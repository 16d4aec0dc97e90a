// hydra's dashboard: polls /api/state (the daemon's published snapshot) every second, draws
// it with plain DOM calls (textContent only: nothing from the server is parsed as HTML), and
// charts hydra's own per-lane counts (tokens/s, in flight, queued, requests) with uPlot: the
// daemon's last 15 minutes (/api/history) when the page opens, then one point per poll.
// Actions POST to /api/* with the page's per-start token; their replies are shown as sentences.
"use strict";

const TOKEN = document.querySelector('meta[name="hydra-token"]').content;
const POLL_MS = 1000;
const KEEP_S = 900;             // the charts keep what the daemon keeps: 15 minutes
const LOG_MAX_CHARS = 200000;   // the log view keeps this much
const DASH = "\u2014";          // a figure this hydra does not publish (an older version)

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) {
      // one listener per node that calls the latest handler (patchNode swaps _handlers)
      e._handlers = { ...(e._handlers || {}), [k.slice(2)]: v };
      e._key = (e._key || "") + k;
      e.addEventListener(k.slice(2), (ev) => e._handlers[k.slice(2)](ev));
    }
    else e.setAttribute(k, v === true ? "" : v);
  }
  for (const k of kids) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
  return e;
}

// Put `fresh` children into `box`, changing only what differs: a row re-rendered every second
// keeps its nodes (a click that spans a poll still lands on the same button).
function patchChildren(box, fresh) {
  const old = [...box.childNodes];
  fresh.forEach((n, i) => {
    const o = old[i];
    if (!o) box.append(n);
    else if (!patchNode(o, n)) box.replaceChild(n, o);
  });
  for (let i = fresh.length; i < old.length; i++) old[i].remove();
}

function patchNode(o, n) {
  if (o.nodeType !== n.nodeType || o.nodeName !== n.nodeName) return false;
  if (o.nodeType === Node.TEXT_NODE) {
    if (o.nodeValue !== n.nodeValue) o.nodeValue = n.nodeValue;
    return true;
  }
  if (o.nodeType !== Node.ELEMENT_NODE) return false;
  if (n._handlers || o._handlers) {  // listeners cannot be compared: swap them
    if (o._key !== n._key) return false;
    o._handlers = n._handlers;
  }
  // (style goes through CSSOM: the page's CSP forbids setting a style attribute)
  for (const a of [...o.attributes]) if (a.name !== "style" && !n.hasAttribute(a.name)) o.removeAttribute(a.name);
  for (const a of [...n.attributes]) if (a.name !== "style" && o.getAttribute(a.name) !== a.value) o.setAttribute(a.name, a.value);
  if (o.style.cssText !== n.style.cssText) o.style.cssText = n.style.cssText;
  if ("disabled" in o && o.disabled !== n.disabled) o.disabled = n.disabled;
  patchChildren(o, [...n.childNodes]);
  return true;
}

function fmtBytes(n) {
  if (n === null || n === undefined || isNaN(n)) return DASH;
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${u[i]}`;
}

function fmtDur(s) {
  if (s === null || s === undefined || isNaN(s)) return DASH;
  s = Math.max(0, s);
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function fmtTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function fmtNum(n, digits = 0) {
  if (n === null || n === undefined || typeof n !== "number" || isNaN(n)) return DASH;
  return n.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}

function fmtSecs(s) {  // a latency: 312 ms, 1.4 s
  if (s === null || s === undefined || isNaN(s)) return DASH;
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(s < 20 ? 1 : 0)} s`;
}

function plural(n, one, many) { return `${n} ${n === 1 ? one : (many || `${one}s`)}`; }

function sentence(text) {
  const t = String(text || "").trim();
  return !t || /[.!?]$/.test(t) ? t : `${t}.`;
}

const GOOD = new Set(["READY", "serving", "ok", "alive", "warm"]);
const BUSY = new Set(["STARTING", "STOPPING", "loading", "unloading", "switching", "starting",
  "recovering", "pending", "noop", "draining", "client gone"]);
const BAD = new Set(["FATAL", "BACKOFF", "UNHEALTHY", "failed", "fatal", "degraded", "port down",
  "rolled_back", "refused", "cut", "error", "hydra stopped"]);
const RUN = new Set(["running"]);
const ANSWERING = new Set(["serving", "degraded"]);  // serve/states.py
const NOT_LOADED = new Set(["stopped", "failed"]);
const MOVING = new Set(["loading", "switching", "unloading"]);

function badge(word, attrs) {
  const w = String(word ?? DASH);
  const cls = GOOD.has(w) ? "b-ok" : BUSY.has(w) ? "b-warn" : BAD.has(w) ? "b-bad" : RUN.has(w) ? "b-run" : "b-idle";
  return el("span", { class: `badge ${cls}`, text: w, "data-state": w, ...(attrs || {}) });
}

// -- state ------------------------------------------------------------------------------------

let lastState = null;
let failures = 0;
let dead = null;       // why the data is no longer live (hydra stopped or gone); null: it is
let busy = false;      // an action from this page runs: the other buttons wait for it
let firstPid = null;   // the hydra this page was served by (its token is that one's)
let deadSince = null;

function off() { return busy || !!dead; }

async function poll() {
  let st;
  try {
    const r = await fetch("/api/state", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    st = await r.json();
  } catch (e) {
    failures++;
    if (failures >= 2) {
      if (!dead) deadSince = Date.now() / 1000;
      dead = `not answering since ${fmtTime(deadSince)}`;
      setBanner(`hydra does not answer (${e.message}): it stopped, or restarted on another port. The page shows its last data, greyed.`);
      render(lastState);
    }
    return;
  }
  // drawn outside the try: a bug in drawing is the console's, not "hydra does not answer"
  failures = 0;
  lastState = st;
  const snap = st.snapshot;
  dead = null;
  if (snap) {
    if (firstPid === null) firstPid = snap.daemon.pid;
    if (snap.daemon.stopped) dead = snap.daemon.stopped;
    else if (snap.daemon.pid !== firstPid) dead = `another hydra (pid ${snap.daemon.pid}) answers here now`;
  }
  setBanner(!dead ? null : snap.daemon.stopped ? `hydra stopped: ${dead}`
    : `${dead}: reload the page (its buttons carry the old one's token)`);
  if (!dead) feedCharts(st);
  render(st);
}

function setBanner(text) {
  $("banner").textContent = text ? sentence(text) : "";
  $("banner").classList.toggle("hidden", !text);
}

// The snapshot's JSON (docs/control.md, "The status schema"): ports, each with its lanes.
function ports(st) { return (st && st.snapshot && st.snapshot.ports) || []; }
function lanes(st) { return ports(st).flatMap((p) => p.lanes || []); }

// One block per port number (a port is one external address; its lanes — the profiles it
// routes to, and a standby — belong to that one block), active lanes first.
function portGroups(st) {
  const by = new Map();
  for (const p of ports(st)) {
    let g = by.get(p.port);
    if (!g) { g = { ...p, lanes: [] }; by.set(p.port, g); }
    for (const l of p.lanes || []) {
      if (!g.lanes.some((x) => x.name === l.name && x.profile === l.profile)) g.lanes.push({ ...l, portName: p.name });
    }
  }
  for (const g of by.values()) g.lanes.sort((a, b) => (a.role === "standby") - (b.role === "standby"));
  return [...by.values()];
}

function render(st) {
  document.body.classList.toggle("dead", !!dead);
  if (!st) return;
  if (!st.snapshot) {
    $("summary").replaceChildren(badge("starting"), " hydra has not published its state yet");
    return;
  }
  const snap = st.snapshot;
  const rows = lanes(st);
  renderHeader(st);
  renderPorts(st);
  renderLoadNote(st);
  renderRequests(st);
  renderDevices(st, rows);
  renderProcesses(st, rows);
  renderSwitches(snap);
  updateLogChoices(rows);
}

function renderHeader(st) {
  const snap = st.snapshot;
  const [word, detail] = dead ? ["hydra stopped", dead] : headline(snap);
  const up = st.now - snap.daemon.started;
  $("summary").replaceChildren(badge(word, { id: "state-word" }),
    el("span", { class: "detail", id: "state-detail", text: ` ${detail}` }),
    el("span", { class: "muted", text: ` · pid ${snap.daemon.pid} · ${dead ? "ran" : "up"} ${fmtDur(up)} · ${snap.daemon.state_dir}` }));
  const fresh = $("freshness");
  fresh.textContent = dead ? `data from ${fmtTime(st.now)}, not live` : `data ${st.age_s < 1 ? "live" : `${st.age_s.toFixed(0)} s old`}`;
  fresh.classList.toggle("stale", !!dead || st.age_s > 5);
  $("reload").disabled = off();
  const loaded = lanes(st).some((l) => !NOT_LOADED.has(l.state));
  $("unload-all").disabled = off() || !loaded;
}

function sum(xs, key) { return xs.reduce((a, l) => a + (Number(l[key]) || 0), 0); }
function has(xs, key) { return xs.some((l) => typeof l[key] === "number"); }

// What the whole hydra is doing, in one word and a line: the most pressing thing first.
function headline(snap) {
  const ps = snap.ports || [];
  const all = ps.flatMap((p) => p.lanes || []);
  const act = all.filter((l) => l.role !== "standby");
  const names = (xs) => [...new Set(xs.map((l) => l.profile))].join(", ");
  const down = ps.filter((p) => p.down);
  if (down.length) return ["port down", down.map((p) => `port ${p.port}: ${p.down}`).join("; ")];
  const load = loadLine(all, ps);
  const draining = all.filter((l) => (l.state === "unloading" || l.state === "switching" || l.switching) && (l.inflight || 0) + (l.queued || 0) > 0);
  if (draining.length) {
    return ["draining", draining.map((l) => `${l.profile} finishes ${plural(l.inflight || 0, "request")} in flight` +
      (l.switching ? ` before the switch to ${l.switching}` : l.state === "unloading" ? " before it stops" : "")).join("; ")];
  }
  const switching = all.filter((l) => l.state === "switching" || l.switching);
  if (switching.length) return ["switching", switching.map((l) => (l.switching ? `${l.profile} → ${l.switching}` : l.profile)).join("; ")];
  const unloading = all.filter((l) => l.state === "unloading");
  if (unloading.length) return ["unloading", `${names(unloading)} stops`];
  const loading = act.filter((l) => l.state === "loading");
  if (loading.length) return ["loading", `${names(loading)}: its requests wait until it serves · ${load}`];
  const rec = all.filter((l) => l.state === "recovering");
  if (rec.length) return ["recovering", `${names(rec)}: a process restarts; requests wait · ${load}`];
  const failed = act.filter((l) => l.state === "failed"), degraded = act.filter((l) => l.state === "degraded");
  const serving = act.filter((l) => ANSWERING.has(l.state));
  if (failed.length || degraded.length) {
    const why = [failed.length ? `${names(failed)} failed` : "", degraded.length ? `${names(degraded)} degraded` : ""].filter(Boolean).join(", ");
    return [serving.length ? "degraded" : "failed", `${why} · ${load}`];
  }
  if (serving.length) return ["serving", `${names(serving)} · ${load}`];
  return ["idle", act.length ? "no profile loaded (a request for one loads it)" : "no profile on any port"];
}

function loadLine(all, ps) {
  const act = all.filter((l) => l.role !== "standby");
  const inflight = sum(all, "inflight"), queued = sum(all, "queued");
  const parts = [inflight || queued ? `${inflight} in flight` : "no request in flight"];
  if (queued) parts.push(`${queued} queued`);
  if (has(all, "tokens_per_s")) parts.push(`${fmtNum(sum(all, "tokens_per_s"), 1)} tok/s`);
  const cut = has(act, "cut") ? sum(all, "cut") : ps.reduce((a, p) => a + ((p.router && p.router.http && p.router.http.cut) || 0), 0);
  if (cut) parts.push(`${cut} cut since start`);
  return parts.join(" · ");
}

// -- actions ----------------------------------------------------------------------------------

async function act(what, body, label) {
  const li = el("li", {}, el("b", { text: label }), " ", badge("pending"));
  const list = $("actions");
  if (list.firstElementChild && list.firstElementChild.classList.contains("muted")) list.replaceChildren();
  list.prepend(li);
  busy = true;
  render(lastState);
  const t0 = performance.now();
  let code = 0, reply = {};
  try {
    const r = await fetch(`/api/${what}`, {
      method: "POST", headers: { "Content-Type": "application/json", "X-Hydra-Token": TOKEN },
      body: JSON.stringify(body), credentials: "same-origin",
    });
    code = r.status;
    reply = await r.json().catch(() => ({ error: `hydra answered HTTP ${r.status} with no reply` }));
  } catch (e) {
    reply = { error: `the request did not reach hydra (${e.message})` };
  }
  busy = false;
  const took = ((performance.now() - t0) / 1000).toFixed(1);
  const ok = code === 200 && (!reply.result || ["ok", "noop"].includes(reply.result));
  const result = code === 200 ? (reply.result || "ok") : code === 409 ? "refused" : "failed";
  li.replaceChildren(el("b", { text: label }), " ", badge(result),
    el("span", { class: "muted", text: ` ${fmtTime(Date.now() / 1000)}, ${took} s` }));
  li.dataset.result = ok ? "ok" : "failed";
  const detail = describeReply(what, body, code, reply);
  if (detail) li.append(el("div", { class: ok ? "said" : "err", text: detail }));
  poll();
}

// The reply as sentences: hydra's own `message` (every action reply has one), else sentences
// made here from its result and error (an older hydra) — never the raw JSON.
function describeReply(what, body, code, reply) {
  if (reply.message) return String(reply.message);
  const say = [];
  const target = body.profile || body.engine || (body.all ? "every profile" : "");
  const res = reply.result;
  if (reply.error && !res) return sentence(code && code !== 200 ? `${reply.error} (HTTP ${code})` : reply.error);
  const phases = Object.entries(reply.phases || {}).map(([k, v]) => `${k} ${Number(v).toFixed(1)} s`).join(", ");
  const took = reply.total_s !== undefined ? ` in ${Number(reply.total_s).toFixed(1)} s` : "";
  if (what === "switch") {
    if (res === "noop") say.push(`${reply.to || target} already serves`);
    else if (res === "ok") say.push(`${reply.to || target} serves${reply.from ? ` instead of ${reply.from}` : ""}${took}${phases ? ` (${phases})` : ""}`);
    else say.push(`The switch to ${reply.to || target} ${res === "rolled_back" ? "was rolled back" : "failed"}${reply.failed_phase ? ` in ${reply.failed_phase}` : ""}: ${reply.error || "hydra.log says why"}`);
    if (res === "rolled_back" && reply.from) say.push(`${reply.from} serves again`);
  } else if (what === "restart") {
    say.push(res === "ok" || !res ? `Restarted ${reply.engine || target}: ready again in ${Number(reply.seconds ?? reply.total_s ?? 0).toFixed(1)} s`
      : `Restarting ${reply.engine || target} failed: ${reply.error || res}`);
  } else if (what === "reload") {
    const done = Object.entries(reply.reloaded || {});
    if (res === "noop") say.push(`Nothing to reload: ${reply.reason || "the profiles are unchanged"}`);
    else if (done.length) say.push(`Reloaded ${done.map(([k, v]) => `${k}: ${v}`).join("; ")}`);
    if (reply.error) say.push(reply.error);
  } else if (what === "load") {
    say.push(res === "ok" || !res ? `${target} is loaded${took}` : `Loading ${target} failed: ${reply.error || res}`);
  } else if (what === "unload") {
    say.push(res === "ok" || !res ? `Unloaded ${target}${took}` : `Unloading ${target} failed: ${reply.error || res}`);
  } else {
    say.push(reply.error || `Done (${res || "ok"})`);
  }
  for (const n of reply.notes || []) say.push(n);
  if (reply.cut) say.push(`${plural(reply.cut, "request was", "requests were")} cut`);
  return say.map(sentence).join(" ");
}

$("reload").addEventListener("click", () => act("reload", {}, "reload"));
$("unload-all").addEventListener("click", () => act("unload", { all: true }, "unload all"));

// -- load: charts of hydra's own counts --------------------------------------------------------

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];
const laneColor = {};
function colorFor(key) {
  if (!laneColor[key]) laneColor[key] = COLORS[Object.keys(laneColor).length % COLORS.length];
  return laneColor[key];
}

// The page's copy of the daemon's per-second history (/api/history), then one point per poll:
// xs (wall times) and, per lane key (port-N/PROFILE, as the daemon names it), one array per
// metric, all as long as xs (null where the lane had no value).
const METRICS = ["tokens_per_s", "inflight", "queued", "requests"];
const hist = { xs: [], lanes: new Map() };
const lastCount = {};  // lane key -> {t, v}: its finished-requests counter at the last poll

function histPush(t, values) {
  if (hist.xs.length && t <= hist.xs[hist.xs.length - 1]) return;
  for (const key of Object.keys(values)) {
    if (!hist.lanes.has(key)) hist.lanes.set(key, Object.fromEntries(METRICS.map((m) => [m, hist.xs.map(() => null)])));
  }
  hist.xs.push(t);
  for (const [key, s] of hist.lanes) for (const m of METRICS) s[m].push(values[key] ? values[key][m] ?? null : null);
  let drop = 0;
  while (drop < hist.xs.length && hist.xs[drop] < t - KEEP_S) drop++;
  if (drop) {
    hist.xs.splice(0, drop);
    for (const s of hist.lanes.values()) for (const m of METRICS) s[m].splice(0, drop);
  }
}

async function loadHistory() {
  try {
    const r = await fetch("/api/history", { cache: "no-store" });
    if (!r.ok) return;
    const h = await r.json();
    const step = h.step_s || 1;
    const series = Object.entries(h.series || {});
    const len = (s) => Math.max(0, ...METRICS.map((m) => (s[m] || []).length));
    const n = Math.max(0, ...series.map(([, s]) => len(s)));
    for (let i = 0; i < n; i++) {
      const values = {};
      for (const [key, s] of series) {
        const row = {};
        for (const m of METRICS) {
          const a = s[m] || [];
          const v = a[i - (n - a.length)];
          row[m] = v === undefined || v === null ? null : m === "requests" ? v / step : v;
        }
        values[key] = row;
      }
      histPush(h.end - (n - 1 - i) * step, values);
    }
  } catch (e) {
    // no history (an older hydra): the charts start with the page
  }
}

function feedCharts(st) {
  const t = st.now;
  const values = {};
  for (const p of ports(st)) {
    for (const l of p.lanes || []) {
      const key = `${p.name}/${l.profile}`;
      const num = (v) => (typeof v === "number" ? v : null);
      let rate = null;
      const prev = lastCount[key];
      if (typeof l.requests === "number") {
        if (prev && t > prev.t && l.requests >= prev.v) rate = (l.requests - prev.v) / (t - prev.t);
        lastCount[key] = { t, v: l.requests };
      }
      values[key] = { tokens_per_s: num(l.tokens_per_s), inflight: num(l.inflight), queued: num(l.queued), requests: rate };
    }
  }
  histPush(t, values);
  drawCharts();
}

class Chart {
  constructor(node, unit) { this.node = node; this.unit = unit; this.plot = null; this.key = null; }
  draw(series) {
    const key = series.map((s) => `${s.label}${s.dash ? "~" : ""}`).join("\u0000");
    const data = [hist.xs, ...series.map((s) => s.values)];
    if (key !== this.key || !this.plot) {
      this.key = key;
      if (this.plot) this.plot.destroy();
      this.plot = new uPlot(this.options(series), data, this.node);
    } else {
      this.plot.setData(data);
    }
  }
  options(series) {
    return {
      width: this.width(), height: 150, legend: { show: true, live: false },
      cursor: { drag: { x: false, y: false } },
      scales: {
        // the chosen span up to the last point (at least a minute; at most what there is)
        x: { time: true, range: () => {
          const t = hist.xs.length ? hist.xs[hist.xs.length - 1] : Date.now() / 1000;
          const first = hist.xs.length ? hist.xs[0] : t;
          return [Math.min(t - 60, Math.max(first, t - spanS())), t];
        } },
        y: { range: (u, lo, hi) => [0, Math.max(1, (hi || 0) * 1.15)] },
      },
      axes: [{ stroke: "#6b7280", grid: { stroke: "#eef1f4" }, space: 70,
          values: (u, v) => v.map((x) => new Date(x * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false })) },
        { stroke: "#6b7280", grid: { stroke: "#eef1f4" }, size: 46,
          values: (u, v) => v.map((x) => (x >= 10 || Number.isInteger(x) ? x.toFixed(0) : x.toFixed(1))) }],
      series: [{}, ...series.map((s) => ({
        label: s.label, stroke: s.color, width: s.dash ? 1.5 : 2, dash: s.dash ? [5, 4] : undefined,
        spanGaps: false, points: { show: false },
        value: (u, v) => (v === null ? DASH : `${v.toFixed(2)} ${this.unit}`),
      }))],
    };
  }
  width() { return Math.max(260, this.node.clientWidth || 400); }
  resize() { if (this.plot) this.plot.setSize({ width: this.width(), height: 150 }); }
}

const charts = {
  tokens: new Chart($("chart-tokens"), "tok/s"),
  inflight: new Chart($("chart-inflight"), ""),
  requests: new Chart($("chart-requests"), "req/s"),
};
window.addEventListener("resize", () => Object.values(charts).forEach((c) => c.resize()));
function spanS() { return Number($("span").value) || 300; }
$("span").addEventListener("change", () => Object.values(charts).forEach((c) => c.plot && c.plot.redraw()));

function laneLabel(key) {
  // port-8080/demo -> demo (the port only when there are several)
  const portsSeen = new Set([...hist.lanes.keys()].map((k) => k.split("/")[0]));
  return portsSeen.size > 1 ? key.replace(/^port-/, "") : key.split("/").slice(1).join("/");
}

function drawCharts() {
  const keys = [...hist.lanes.keys()].filter((k) => METRICS.some((m) => hist.lanes.get(k)[m].some((v) => v !== null))).sort();
  const of = (m, dash, suffix) => keys.map((k) => ({ label: laneLabel(k) + (suffix || ""), color: colorFor(k), dash, values: hist.lanes.get(k)[m] }));
  charts.tokens.draw(of("tokens_per_s"));
  charts.inflight.draw([...of("inflight"), ...of("queued", true, " queued")]);
  charts.requests.draw(of("requests"));
}

function renderLoadNote(st) {
  const all = lanes(st);
  const note = $("load-note");
  if (all.length && !has(all, "tokens_per_s")) {
    note.textContent = "This hydra does not publish tokens/s, in-flight or queued counts (an older version): those charts stay empty.";
    note.classList.remove("hidden");
  } else note.classList.add("hidden");
}

// -- ports and profiles -----------------------------------------------------------------------

function renderPorts(st) {
  const out = [];
  for (const p of portGroups(st)) {
    const mine = p.lanes;
    const act = mine.filter((l) => l.role !== "standby");
    const sb = mine.filter((l) => l.role === "standby");
    const http = (p.router && p.router.http) || {};
    let what = act.length > 1 ? `${act.length} profiles, routed by the request's "model"`
      : act.length ? `${act[0].profile}` : "no profile loaded (switch one in below)";
    if (sb.length) what += `, standby ${sb.map((l) => l.profile).join(", ")}`;
    // (a ggml-RPC port that lends a device serves no HTTP: no request count)
    const counts = p.router && !String(p.url).startsWith("ggml-rpc") ? ` · ${plural(http.requests || 0, "request")}${http.cut ? ` · ${http.cut} cut` : ""}` : "";
    // a host that lends its device: the head holding the rpc-server behind this router;
    // a head: the remote peers its active profiles run on (which endpoint: a spare?)
    const lent = holderText(st, p.router);
    const remote = remotePeers(act).map((x) => ` · remote peer ${peerAt(x)}: ${x.state}`).join("");
    const head = el("div", { class: "port-head" },
      el("a", { href: p.url, text: `port ${p.port}` }),
      p.down ? badge("port down") : badge("alive"),
      el("span", { class: "muted", text: p.down || `${p.url}${p.tls ? " (TLS only)" : ""} · ${what}${counts}${lent}${remote}` }));
    const tbody = el("tbody");
    for (const r of mine) tbody.append(laneRow(st, r));
    const table = el("table", { class: "grid lanes" },
      el("thead", {}, el("tr", {}, ...[["profile"], ["role"], ["state"], ["layout"], ["in flight", "num"], ["queued", "num"],
        ["tok/s", "num"], ["generated", "num"], ["requests", "num"], ["cut", "num"], ["loads", "num"], ["why / note"], [""]]
        .map(([h, cls]) => el("th", { class: cls, text: h })))), tbody);
    out.push(el("div", { class: "port", "data-port": p.port }, head, mine.length ? table : null,
      mine.length ? null : singleSwitch(st)));
  }
  patchChildren($("ports"), out);
}

// The head holding this host's lent rpc-server: its address, the build its hydra announced,
// since when (this page's clock) and for how long, the bytes each way through the router, and
// how many other heads' connections the router refused (one head at a time).
function holderText(st, r) {
  const h = r && r.rpc_holder;
  if (!h) return "";
  const since = st.now ? `since ${fmtTime(st.now - h.held_s)} (${fmtDur(h.held_s)})` : `for ${fmtDur(h.held_s)}`;
  const kept = (r.refused && r.refused.rpc_held) || 0;
  return ` · lent to ${h.addr} (build ${h.build || "not announced"}) ${since}, ` +
    `${fmtMiB(h.bytes_up)} sent to its rpc-server, ${fmtMiB(h.bytes_down)} back` +
    (kept ? ` · ${plural(kept, "other head's connection", "other heads' connections")} refused (one head at a time)` : "");
}

function fmtMiB(n) {
  return `${((n || 0) / 1048576).toFixed(1)} MiB`;
}

// A remote peer of a head (a process hydra only probes): its device, the endpoint it serves
// on, whether that is a spare (and which is the primary), TLS (its device's tls:).
function peerAt(x) {
  const at = `${x.host}:${x.port}`;
  const eps = x.endpoints || [];
  const where = !eps.length ? `${x.device} at ${at}` : eps[0] === at
    ? `${x.device} at ${at} (primary; spares ${eps.slice(1).join(", ")})`
    : `${x.device} on spare ${at} (primary ${eps[0]})`;
  return where + (x.tls ? ", over TLS" : "");
}

function remotePeers(lanes) {
  return lanes.flatMap((l) => (l.processes || []).filter((x) => !x.managed && x.role === "peer"));
}

function button(action, text, title, disabled, onclick, profile) {
  return el("button", { type: "button", "data-action": action, "data-profile": profile, title, disabled, text, onclick });
}

function laneRow(st, r) {
  const name = r.profile;
  const standby = r.role === "standby";
  const loaded = !NOT_LOADED.has(r.state);
  const moving = MOVING.has(r.state) || !!r.switching;
  const buttons = [];
  const unload = () => button("unload", "Unload", `Stop ${name} once its requests finish (a request for it loads it again)`,
    off() || moving || !loaded, () => act("unload", { profile: name }, `unload ${name}`), name);
  if (standby) {
    buttons.push(button("switch", "Switch to", `Make ${name} serve this port now: it is loaded and warm, so the flip is instant and ${r.standby_of} stands by`,
      off() || r.state !== "serving", () => act("switch", { profile: name }, `switch to ${name}`), name));
    buttons.push(unload());
  } else if (loaded) {
    buttons.push(unload());
  } else {
    buttons.push(button("load", "Load", `Load ${name} beside what serves (what does not fit beside it is stopped first)`,
      off() || moving, () => act("load", { profile: name }, `load ${name}`), name));
    buttons.push(button("switch", "Switch to", `Make ${name} serve, stopping the profiles that share its devices`,
      off() || moving, () => act("switch", { profile: name }, `switch to ${name}`), name));
  }
  const restarting = (r.processes || []).filter((x) => x.state !== "READY").map((x) => `${x.name}: ${[x.reason || x.state, remoteLoad(x.remote_load)].filter(Boolean).join("; ")}`);
  const note = r.switching ? `switching to ${r.switching}` : r.error || r.fatal || r.degraded ||
    (standby && r.state === "serving" ? `loaded and warm: a switch to it is instant${r.flips ? ` (${plural(r.flips, "flip")} so far)` : ""}` : "") ||
    (r.state === "recovering" ? restarting.join("; ") : "") ||
    (r.state !== "serving" ? r.held_reason || r.why : "") || "";
  const num = (key, v, text) => el("td", { class: "num", [`data-${key}`]: v ?? "", text: text ?? fmtNum(v) });
  return el("tr", { "data-profile": name, "data-role": r.role, class: standby ? "standby" : null },
    el("td", {}, el("b", { text: name }), r.default && !standby ? el("span", { class: "muted", text: " (default)" }) : null),
    el("td", {}, el("span", { class: `role role-${r.role}`, text: standby ? `standby of ${r.standby_of}` : "active", "data-lane-role": r.role })),
    // a standby answers no request until a switch flips it: "warm", not "serving"
    el("td", {}, badge(standby && r.state === "serving" ? "warm" : r.state)),
    el("td", { class: "layout" }, `${r.mode || DASH} · ${r.model || DASH}`, el("div", { class: "muted", text: (r.devices || []).join(", ") || DASH })),
    num("inflight", r.inflight),
    num("queued", r.queued),
    num("tps", r.tokens_per_s, fmtNum(r.tokens_per_s, 1)),
    num("generated", r.generated_tokens),
    num("requests", r.requests, r.requests ?? DASH),
    num("cut", r.cut),
    num("loads", r.loads),
    el("td", { class: "reason", text: note }),
    el("td", { class: "buttons" }, ...buttons));
}

let singleChoice = null;
function singleSwitch(st) {
  const sel = el("select", { "aria-label": "profile to load" });
  for (const p of st.profiles || []) sel.append(el("option", { value: p, text: p, selected: p === singleChoice }));
  sel.addEventListener("change", () => { singleChoice = sel.value; });
  return el("div", { class: "port-head" }, el("span", { text: "Load on this port" }), sel,
    button("load", "Load", "Load this profile", off(), () => act("load", { profile: sel.value }, `load ${sel.value}`)),
    button("switch", "Switch", "Make this profile serve this port", off(), () => act("switch", { profile: sel.value }, `switch to ${sel.value}`)));
}

// -- requests ---------------------------------------------------------------------------------

const ENDED = { client_gone: "client gone" };
const SHOWN_REQUESTS = 200;

function renderRequests(st) {
  const snap = st.snapshot;
  const info = $("requests-info");
  const tb = document.querySelector("#requests tbody");
  if (!Array.isArray(snap.requests)) {
    info.textContent = "";
    patchChildren(tb, [el("tr", {}, el("td", { colspan: 14, class: "muted", text: "This hydra does not record requests (an older version)." }))]);
    return;
  }
  const all = snap.requests;
  const n = (e) => all.filter((r) => r.ended === e).length;
  info.textContent = `the last ${all.length}, newest first · ${n("running")} running · ${n("cut")} cut · ${n("refused")} refused · ${n("client_gone")} client gone · ${n("error")} error`;
  const out = [];
  for (let i = all.length - 1; i >= 0 && out.length < SHOWN_REQUESTS; i--) {
    const r = all[i];
    const running = r.ended === "running";
    out.push(el("tr", { "data-request": r.id, "data-ended": r.ended, class: running ? "running" : null },
      el("td", { class: "num", text: fmtTime(r.at) }),
      el("td", { class: "num", text: r.port }),
      el("td", {}, r.profile ? el("b", { text: r.profile }) : el("span", { class: "muted", text: r.model ? `(${r.model})` : DASH })),
      el("td", { class: "num muted", text: r.client }),
      el("td", { text: `${r.method} ${r.path}${r.stream ? " · stream" : ""}` }),
      el("td", { class: "num", text: r.status || DASH }),
      el("td", { class: "num", "data-ttft": r.ttft_s ?? "", text: fmtSecs(r.ttft_s) }),
      el("td", { class: "num", text: fmtNum(r.prompt_tokens) }),
      el("td", { class: "num", text: fmtNum(r.cached_tokens) }),
      el("td", { class: "num", "data-generated": r.generated_tokens ?? "", text: fmtNum(r.generated_tokens) }),
      el("td", { class: "num", text: fmtNum(r.prefill_tps, 1) }),
      el("td", { class: "num", text: fmtNum(r.decode_tps, 1) }),
      el("td", { class: "num", text: fmtDur(r.duration_s) }),
      el("td", {}, badge(ENDED[r.ended] || r.ended))));
  }
  if (!out.length) out.push(el("tr", {}, el("td", { colspan: 14, class: "muted", text: "No request yet." })));
  patchChildren(tb, out);
}

// -- devices and processes ----------------------------------------------------------------------

function renderDevices(st, rows) {
  const d = st.devices || {};
  const box = $("devices");
  const out = [];
  const procs = rows.flatMap((r) => (r.processes || []).map((p) => ({ ...p, profile: r.profile })));
  const planned = {};
  for (const r of rows) {
    if (!["serving", "loading"].includes(r.phase)) continue;
    for (const [k, v] of Object.entries(r.needs_mib || {})) planned[k] = (planned[k] || 0) + v * 1048576;
  }
  const h = d.host;
  if (h) {
    // this host's: a remote peer (not managed) runs on another host's memory
    const cpuProcs = procs.filter((p) => p.managed !== false && (p.gpu_bytes === null || p.gpu_bytes === undefined));
    const rss = cpuProcs.reduce((a, p) => a + (p.rss_bytes || 0), 0);
    const devs = [...new Set(cpuProcs.map((p) => p.device))].join(", ");
    out.push(memBlock(`host memory${devs ? ` (CPU devices: ${devs})` : ""}`, h.total, h.used, rss,
      planned.host, `${h.cores || "?"} cores · used = MemTotal − MemAvailable, the whole machine`, cpuProcs, (p) => p.rss_bytes, "RSS"));
  }
  const gpus = d.gpus || [];
  for (const g of gpus) {
    // a process's GPU memory is NVML's per-process total (all its GPUs): attributed to this GPU
    // by the process's device name (gpuN / cudaN), or to the only GPU there is
    const gp = procs.filter((p) => p.gpu_bytes && (gpus.length === 1 || p.device === `gpu${g.index}` || p.device === `cuda${g.index}`));
    const mine = gp.reduce((a, p) => a + (p.gpu_bytes || 0), 0);
    const plan = planned[`cuda${g.index}`];
    out.push(memBlock(`GPU ${g.index} · ${g.model}`, g.total, g.used, mine, plan, `${d.source || "NVML"}: used by every process on it`, gp, (p) => p.gpu_bytes, "GPU"));
  }
  const remotes = remotePeers(rows);
  for (const [k, v] of Object.entries(planned)) {
    if (!k.startsWith("remote:")) continue;
    const x = remotes.find((p) => `${p.host}:${p.port}` === k.slice(7));
    out.push(el("div", { class: "dev" }, el("div", { class: "dev-name", text: `remote peer ${x ? peerAt(x) : k.slice(7)}` }),
      el("div", { class: "legend", text: `planned by hydra ${fmtBytes(v)} · its memory is not visible from this host` })));
  }
  if (!d.gpus || !d.gpus.length) {
    out.push(el("p", { class: "note", text: `No GPU here (inventory: ${d.source || "?"}): hydra's processes run on the CPU; their memory is host memory (RSS).` }));
  }
  patchChildren(box, out);
}

function memBlock(title, total, used, hydra, plan, note, procs, val, what) {
  const pct = (x) => `${Math.min(100, Math.max(0, (100 * x) / (total || 1))).toFixed(2)}%`;
  const bar = el("div", { class: "bar" },
    el("span", { class: "used", style: null }),
    el("span", { class: "hydra" }));
  bar.children[0].style.left = "0"; bar.children[0].style.width = pct(used);
  bar.children[1].style.left = "0"; bar.children[1].style.width = pct(hydra);
  if (plan) { const m = el("span", { class: "plan" }); m.style.left = pct(plan); bar.append(m); }
  const legend = el("div", { class: "legend" },
    `${fmtBytes(used)} used of ${fmtBytes(total)}`,
    el("i", { class: "hydra" }), `hydra's processes ${fmtBytes(hydra)} (${what})`,
    el("i", { class: "plan" }), `planned by hydra ${plan ? fmtBytes(plan) : DASH}`);
  const per = procs.filter((p) => val(p)).map((p) => `${p.name} ${fmtBytes(val(p))}`).join(" · ");
  return el("div", { class: "dev" }, el("div", { class: "dev-name", text: title }), bar, legend,
    el("div", { class: "note", text: note + (per ? ` — ${per}` : "") }));
}

const SIGNALS = { 1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM" };
function lastExit(x) {
  if (x === null || x === undefined) return DASH;
  if (typeof x === "number") return x < 0 ? `killed by ${SIGNALS[-x] || `signal ${-x}`}` : `exit code ${x}`;
  if (typeof x !== "object") return String(x);
  const parts = [];
  if (x.code !== undefined && x.code !== null) parts.push(`code ${x.code}`);
  if (x.signal) parts.push(`signal ${x.signal}`);
  if (x.at) parts.push(fmtTime(x.at));
  if (x.reason) parts.push(x.reason);
  return parts.join(", ") || JSON.stringify(x);
}

function renderProcesses(st, rows) {
  const tb = document.querySelector("#processes tbody");
  const out = [];
  for (const r of rows) {
    for (const p of r.processes || []) {
      const up = p.started && p.state !== "STOPPED" ? st.now - p.started : null;
      out.push(el("tr", { "data-process": p.name },
        el("td", {}, el("b", { text: p.name })),
        el("td", { text: r.profile || DASH }),
        el("td", { text: p.role }),
        el("td", { text: p.managed ? p.device || DASH : peerAt(p) }),
        el("td", {}, badge(p.state)),
        el("td", { class: "num", "data-pid": p.pid ?? "", text: p.pid ?? DASH }),
        el("td", { class: "num", text: fmtDur(up) }),
        el("td", { class: "num", "data-restarts": p.restarts, text: p.restarts }),
        el("td", { text: lastExit(p.last_exit) }),
        el("td", { class: "reason", text: [p.reason, remoteLoad(p.remote_load), p.warning].filter(Boolean).join(" · ") }),
        el("td", { class: "num", text: p.gpu_bytes ? `${fmtBytes(p.gpu_bytes)} GPU` : fmtBytes(p.rss_bytes) }),
        el("td", {},
          el("button", { type: "button", "data-action": "log", onclick: () => chooseLog(p.name), text: "Log" }), " ",
          el("button", { type: "button", "data-action": "restart", disabled: off() || !p.managed,
            title: p.managed ? "A planned restart of this process" : "not managed by this hydra",
            onclick: () => act("restart", { engine: p.name }, `restart ${p.name}`), text: "Restart" }))));
    }
  }
  if (!out.length) out.push(el("tr", {}, el("td", { colspan: 12, class: "muted", text: "No process runs." })));
  patchChildren(tb, out);
}


const PHASE_COLORS = ["#60a5fa", "#f59e0b", "#34d399", "#a78bfa", "#f472b6", "#22d3ee", "#fb923c", "#94a3b8"];
const phaseColor = {};
function colorOf(name) {
  if (!phaseColor[name]) phaseColor[name] = PHASE_COLORS[Object.keys(phaseColor).length % PHASE_COLORS.length];
  return phaseColor[name];
}

// Every change once: the snapshot lists each lane's changes under the lane and all of them
// merged at the top (and a port's that left it without a lane under the port). A change is
// the same one wherever it is listed: same seq, time, source and target.
function switchesOf(snap) {
  const seen = new Set(), all = [];
  const add = (s) => {
    const key = [s.seq, s.at, s.from, s.to, s.result].join("\u0000");
    if (seen.has(key)) return;
    seen.add(key);
    all.push(s);
  };
  for (const p of snap.ports || []) {
    for (const l of p.lanes || []) (l.switches || []).forEach(add);
    (p.switches || []).forEach(add);
  }
  (snap.switches || []).forEach(add);
  return all.sort((a, b) => (a.at || 0) - (b.at || 0));
}

function renderSwitches(snap) {
  const all = switchesOf(snap);
  const box = $("switches");
  if (!all.length) { box.replaceChildren(el("p", { class: "muted", text: "No switch yet." })); return; }
  const out = all.slice(-8).reverse().map((s) => {
    const phases = Object.entries(s.phases || {});
    const total = phases.reduce((a, [, v]) => a + v, 0) || 1;
    const bar = el("div", { class: "phases" });
    for (const [k, v] of phases) {
      const seg = el("span", { title: `${k} ${v.toFixed(2)} s` });
      seg.style.width = `${(100 * v) / total}%`;
      seg.style.background = colorOf(k);
      bar.append(seg);
    }
    const text = el("div", { class: "ph-text" });
    for (const [k, v] of phases) {
      const dot = el("i", { class: "dot" });
      dot.style.cssText = `display:inline-block;width:8px;height:8px;border-radius:2px;margin:0 4px 0 8px;background:${colorOf(k)}`;
      text.append(dot, `${k} ${v.toFixed(2)} s`);
    }
    return el("div", { class: "sw", "data-switch": `${s.seq}@${s.at}` },
      el("div", {}, el("b", { text: `${s.from || DASH} → ${s.to || DASH}` }), " ", badge(s.result),
        el("span", { class: "muted", text: ` ${Number(s.total_s || 0).toFixed(1)} s${s.at ? ` · ${fmtTime(s.at)}` : ""}` }),
        s.cut ? el("span", { class: "muted", text: ` · ${s.cut} request${s.cut === 1 ? "" : "s"} cut` }) : null),
      bar, text,
      (s.notes || []).length ? el("div", { class: "ph-text", text: s.notes.map(sentence).join(" ") }) : null,
      s.error ? el("div", { class: "err", text: `${s.failed_phase ? s.failed_phase + ": " : ""}${s.error}` }) : null);
  });
  patchChildren(box, out);
}

// -- logs -------------------------------------------------------------------------------------


const logState = { name: null, cursor: null, pid: null, gone: false, timer: null };

// A head loading onto remote peers: what it has sent of their weights, as the peer hosts'
// routers count it (the same words as `hydra status`; sent_bytes null: unknown).
function remoteLoad(rl) {
  if (!rl || !rl.remote_bytes) return "";
  const total = (rl.remote_bytes / 1048576).toFixed(0);
  if (rl.sent_bytes == null) return `sent ? of ${total} MiB to remote peers (progress unknown)`;
  const pct = Math.round((100 * rl.sent_bytes) / rl.remote_bytes);
  return `sent ${(rl.sent_bytes / 1048576).toFixed(0)} of ${total} MiB to remote peers (${pct}%)`;
}

// hydra's own log (logs/hydra.log: every state change with its reason), then each process's
const HYDRA_LOG = "hydra";
let logNames = [];
function updateLogChoices(rows) {
  const names = [HYDRA_LOG, ...rows.flatMap((r) => (r.processes || []).map((p) => p.name))];
  logNames = names;
  const sel = $("log-select");
  const have = [...sel.options].map((o) => o.value);
  if (names.join() !== have.join()) {
    sel.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
    if (logState.name && names.includes(logState.name)) sel.value = logState.name;
  }
  if (!logState.name) chooseLog(HYDRA_LOG);
}

$("log-select").addEventListener("change", (e) => chooseLog(e.target.value));

function chooseLog(name) {
  if (logState.name === name) return;
  logState.name = name; logState.cursor = null; logState.pid = null; logState.gone = false;
  $("log-select").value = name;
  $("log").replaceChildren();
  pollLog();
}

function appendLog(text, cls) {
  const pre = $("log");
  const stick = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 20;
  pre.append(cls ? el("span", { class: cls, text }) : document.createTextNode(text));
  while (pre.textContent.length > LOG_MAX_CHARS && pre.firstChild) pre.firstChild.remove();
  if ($("log-follow").checked && stick) pre.scrollTop = pre.scrollHeight;
}

async function pollLog() {
  clearTimeout(logState.timer);
  const name = logState.name;
  if (name && !logNames.includes(name)) {
    markGone(name);
  } else if (name) {
    try {
      const q = new URLSearchParams({ name });
      if (logState.cursor) q.set("cursor", logState.cursor);
      const r = await fetch(`/api/log?${q}`, { cache: "no-store" });
      const d = await r.json();
      if (name !== logState.name) {
        // another process was chosen meanwhile
      } else if (d.gone) {
        markGone(name);
      } else if (r.ok) {
        showLog(name, d);
      } else {
        $("log-info").textContent = d.error || `HTTP ${r.status}`;
      }
    } catch (e) {
      $("log-info").textContent = `log: ${e.message}`;
    }
  }
  logState.timer = setTimeout(pollLog, POLL_MS);
}

function markGone(name) {
  // its profile stopped: the log stays as it was, with a line that says so
  if (!logState.gone) appendLog(`\n──── ${name} is not running (its profile stopped) ────\n`, "mark");
  logState.gone = true;
  $("log-info").textContent = `${name} is not running`;
  $("log-info").dataset.pid = "";
}

function showLog(name, d) {
  // markers: the process went away, came back under a new pid, or its file was renewed
  // (the file and the pid are read a moment apart: a new file may show up before its pid)
  const was = logState.pid;
  const newPid = d.pid && was && d.pid !== was;
  if (d.restarted) {
    appendLog(`\n──── ${name}: a new run${d.pid && d.pid !== was ? `, pid ${d.pid}` : ""} ────\n`, "mark");
    logState.newFile = true;
  } else if (newPid && !logState.newFile) {
    appendLog(`\n──── ${name} restarted: now pid ${d.pid} ────\n`, "mark");
  } else if (!d.pid && was && !logState.gone) {
    appendLog(`\n──── ${name} is not running (was pid ${was}) ────\n`, "mark");
    logState.gone = true;
  }
  if (d.pid && d.pid !== was) {
    if (newPid && logState.newFile && !d.restarted) appendLog(`──── (that run is pid ${d.pid}) ────\n`, "mark");
    logState.pid = d.pid; logState.gone = false; logState.newFile = false;
  }
  if (d.skipped) appendLog("\n[… skipped …]\n", "mark");
  if (d.text) appendLog(d.text);
  if (d.cursor) logState.cursor = d.cursor;
  $("log-info").textContent = `${d.path}${d.pid ? ` · following pid ${d.pid}` : ""}`;
  $("log-info").dataset.pid = d.pid ?? "";
}

loadHistory().finally(() => {
  poll();
  setInterval(poll, POLL_MS);
});
