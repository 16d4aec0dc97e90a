// hydra's dashboard: polls /api/state (the daemon's published snapshot) every second, draws
// it with plain DOM calls (textContent only: nothing from the server is parsed as HTML), and
// charts rates with uPlot. Actions POST to /api/* with the page's per-start token.
"use strict";

const TOKEN = document.querySelector('meta[name="hydra-token"]').content;
const POLL_MS = 1000;
const WINDOW_S = 180;           // the charts' span (since the page opened)
const LOG_MAX_CHARS = 200000;   // the log view keeps this much
const RATE_S = 5;               // rates are averages over this many seconds

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
  if (n === null || n === undefined || isNaN(n)) return "–";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(n >= 100 || i === 0 ? 0 : 1)} ${u[i]}`;
}

function fmtDur(s) {
  if (s === null || s === undefined || isNaN(s)) return "–";
  s = Math.max(0, s);
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function fmtTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

const GOOD = new Set(["READY", "serving", "ok", "alive"]);
const BUSY = new Set(["STARTING", "STOPPING", "loading", "unloading", "switching", "starting",
  "recovering", "pending", "noop"]);
const BAD = new Set(["FATAL", "BACKOFF", "UNHEALTHY", "failed", "fatal", "degraded", "port down",
  "rolled_back", "refused"]);

function badge(word) {
  const w = String(word ?? "–");
  const cls = GOOD.has(w) ? "b-ok" : BUSY.has(w) ? "b-warn" : BAD.has(w) ? "b-bad" : "b-idle";
  return el("span", { class: `badge ${cls}`, text: w, "data-state": w });
}

// -- actions ----------------------------------------------------------------------------------

let busy = false;

async function act(what, body, label) {
  const li = el("li", {}, el("b", { text: label }), " ", badge("pending"));
  const list = $("actions");
  if (list.firstElementChild && list.firstElementChild.classList.contains("muted")) list.innerHTML = "";
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
    reply = await r.json().catch(() => ({ error: `HTTP ${r.status}` }));
  } catch (e) {
    reply = { error: String(e) };
  }
  busy = false;
  const took = ((performance.now() - t0) / 1000).toFixed(1);
  const ok = code === 200 && (!reply.result || reply.result === "ok" || reply.result === "noop");
  const result = code === 200 ? (reply.result || "ok") : "failed";
  li.replaceChildren(el("b", { text: label }), " ", badge(result),
    el("span", { class: "muted", text: ` ${fmtTime(Date.now() / 1000)}, ${took} s` }));
  li.dataset.result = ok ? "ok" : "failed";
  const detail = describeReply(what, code, reply);
  if (detail) li.append(el("div", { class: ok ? "ph-text" : "err", text: detail }));
  poll();
}

function describeReply(what, code, reply) {
  if (reply.error) return (code ? `HTTP ${code}: ` : "") + reply.error;
  if (reply.phases) {
    const ph = Object.entries(reply.phases).map(([k, v]) => `${k} ${v.toFixed(1)} s`).join(" · ");
    return `${reply.from || "–"} → ${reply.to || "–"}: ${ph}` + (reply.notes && reply.notes.length ? ` (${reply.notes.join("; ")})` : "");
  }
  if (reply.message) return reply.message;
  const keys = Object.keys(reply);
  return keys.length ? JSON.stringify(reply).slice(0, 300) : "";
}

$("reload").addEventListener("click", () => act("reload", {}, "reload"));

// -- charts -----------------------------------------------------------------------------------

const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

class RateChart {
  constructor(node, unit) {
    this.node = node; this.unit = unit; this.names = []; this.plot = null;
    this.xs = []; this.ys = {}; this.prev = {};
  }
  // counters: {name: cumulative value or null}; t: seconds
  push(t, counters) {
    const names = Object.keys(counters).sort();
    if (names.join("\u0000") !== this.names.join("\u0000")) {
      for (const n of names) if (!this.ys[n]) this.ys[n] = this.xs.map(() => null);
      this.names = names;
      this.build();
    }
    for (const n of this.names) {
      // the rate over the last RATE_S seconds (one poll's difference is 0 or 1 request)
      const v = counters[n];
      let rate = null;
      if (v === null || v === undefined) {
        this.prev[n] = [];
      } else {
        const hist = (this.prev[n] || []).filter((h) => h.t >= t - RATE_S && h.v <= v);
        if (hist.length && t > hist[0].t) rate = (v - hist[0].v) / (t - hist[0].t);
        hist.push({ t, v });
        this.prev[n] = hist;
      }
      this.ys[n].push(rate);
    }
    this.xs.push(t);
    while (this.xs.length && this.xs[0] < t - WINDOW_S) {
      this.xs.shift();
      for (const n of this.names) this.ys[n].shift();
    }
    if (this.plot) this.plot.setData([this.xs, ...this.names.map((n) => this.ys[n])]);
  }
  build() {
    if (this.plot) this.plot.destroy();
    const width = Math.max(280, this.node.clientWidth || 500);
    const opts = {
      width, height: 150, legend: { show: true, live: false },
      cursor: { drag: { x: false, y: false } },
      scales: {
        // always the last WINDOW_S seconds: the axis reads as clock times from the start
        // from the first sample (at least a minute) to now, at most WINDOW_S
        x: { time: true, range: () => {
          const t = this.xs.length ? this.xs[this.xs.length - 1] : Date.now() / 1000;
          const first = this.xs.length ? this.xs[0] : t;
          return [Math.min(t - 60, Math.max(first, t - WINDOW_S)), t];
        } },
        y: { range: (u, lo, hi) => [0, Math.max(1, (hi || 0) * 1.15)] },
      },
      axes: [{ stroke: "#6b7280", grid: { stroke: "#eef1f4" }, space: 60,
          values: (u, v) => v.map((x) => new Date(x * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit", hour12: false })) },
        { stroke: "#6b7280", grid: { stroke: "#eef1f4" }, size: 46,
          values: (u, v) => v.map((x) => (x >= 10 ? x.toFixed(0) : x.toFixed(1))) }],
      series: [{}, ...this.names.map((n, i) => ({
        label: n, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false, points: { show: false },
        value: (u, v) => (v === null ? "–" : `${v.toFixed(2)} ${this.unit}`),
      }))],
    };
    this.plot = new uPlot(opts, [this.xs, ...this.names.map((n) => this.ys[n])], this.node);
  }
  resize() {
    if (this.plot) this.plot.setSize({ width: Math.max(280, this.node.clientWidth), height: 150 });
  }
}

const reqChart = new RateChart($("chart-requests"), "req/s");
const tokChart = new RateChart($("chart-tokens"), "tok/s");
window.addEventListener("resize", () => { reqChart.resize(); tokChart.resize(); });

// -- state ------------------------------------------------------------------------------------

let lastState = null;
let failures = 0;

async function poll() {
  try {
    const r = await fetch("/api/state", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    const st = await r.json();
    failures = 0;
    $("banner").classList.add("hidden");
    lastState = st;
    render(st);
    feedCharts(st);
  } catch (e) {
    failures++;
    if (failures >= 2) {
      $("banner").textContent = `hydra does not answer (${e.message}): it stopped, or restarted on another port.`;
      $("banner").classList.remove("hidden");
    }
  }
}

// The snapshot's JSON (docs/control.md, "The status schema"): ports, each with its lanes.
function ports(st) { return (st && st.snapshot && st.snapshot.ports) || []; }
function lanes(st) { return ports(st).flatMap((p) => p.lanes || []); }

function feedCharts(st) {
  const t = st.now;
  const reqs = {}, toks = {};
  let anyMetrics = false, heads = 0;
  for (const p of ports(st)) {
    if (!(p.lanes || []).length && p.router) reqs[p.name] = p.router.http.requests ?? null;
  }
  for (const e of lanes(st)) {
    const name = e.profile;
    reqs[name] = e.requests ?? null;
    const h = (st.heads || {})[name];
    if (h) {
      heads++;
      if (h.metrics) anyMetrics = true;
      toks[name] = h.metrics ? (h.predicted ?? null) : null;
    } else {
      toks[name] = null;
    }
  }
  reqChart.push(t, reqs);
  tokChart.push(t, toks);
  const note = $("tokens-note");
  if (heads && !anyMetrics) {
    note.textContent = "No head serves /metrics: start llama-server with --metrics (server_args: {metrics: true} in the profile) to chart tokens per second.";
    note.classList.remove("hidden");
  } else note.classList.add("hidden");
}

function render(st) {
  if (!st || !st.snapshot) return;
  const snap = st.snapshot;
  const rows = lanes(st);
  const up = st.now - snap.daemon.started;
  const word = summaryWord(snap);
  $("summary").replaceChildren(badge(word), ` pid ${snap.daemon.pid} · up ${fmtDur(up)} · ${snap.daemon.state_dir}`);
  const fresh = $("freshness");
  fresh.textContent = `data ${st.age_s < 1 ? "live" : `${st.age_s.toFixed(0)} s old`}`;
  fresh.classList.toggle("stale", st.age_s > 5);
  $("reload").disabled = busy;
  renderPorts(st);
  renderDevices(st, rows);
  renderProcesses(st, rows);
  renderSwitches(snap);
  updateLogChoices(rows);
}

function summaryWord(snap) {
  const ps = snap.ports || [];
  const rows = ps.flatMap((p) => (p.lanes || []).filter((l) => l.role === "active"));
  if (ps.some((p) => p.down)) return "port down";
  if (rows.some((r) => r.state === "failed")) return "degraded";
  return rows.some((r) => r.state === "serving") ? "serving" : "idle";
}

function renderPorts(st) {
  const box = $("ports");
  const out = [];
  for (const p of ports(st)) {
    const mine = p.lanes || [];
    const n = mine.filter((l) => l.role === "active").length;
    const head = el("div", { class: "port-head" },
      el("a", { href: p.url, text: `port ${p.port}` }),
      p.down ? badge("port down") : badge("alive"),
      el("span", { class: "muted", text: p.down || (n
        ? `${p.url}  ·  ${n} profile${n === 1 ? "" : "s"}, routed by the request's "model"`
        : `${p.url}  ·  no profile loaded (switch one in below)`) }));
    const tbody = el("tbody");
    for (const r of mine) tbody.append(profileRow(st, r));
    const table = el("table", { class: "grid" },
      el("thead", {}, el("tr", {}, ...["profile", "state", "mode", "model", "devices", "requests", "loads", "why / note", ""]
        .map((h) => el("th", { text: h })))), tbody);
    out.push(el("div", { class: "port", "data-port": p.port }, head, table,
      mine.length ? null : singleSwitch(st)));
  }
  patchChildren(box, out);
}

function profileRow(st, r) {
  const name = r.profile;
  const running = r.state === "serving";
  const standby = r.role === "standby";
  const button = el("button", {
    type: "button", "data-action": "switch", "data-profile": name, disabled: busy || (running && !standby) || r.phase === "loading",
    title: standby ? "Flip the port to this standby layout (it is loaded and warm)" : "Load this profile (profiles sharing its devices are stopped first)",
    text: running && !standby ? "serving" : "Switch to",
    onclick: () => act("switch", { profile: name }, `switch to ${name}`),
  });
  const note = r.switching ? `switching to ${r.switching}` : r.error || r.fatal || r.degraded ||
    (r.state !== "serving" ? r.held_reason || r.why : "") || "";
  const req = r.requests;
  return el("tr", { "data-profile": name },
    el("td", {}, el("b", { text: name }), r.default ? el("span", { class: "muted", text: " (default)" }) : null,
      standby ? el("span", { class: "muted", text: ` (standby of ${r.standby_of})` }) : null),
    el("td", {}, badge(r.state)),
    el("td", { text: r.mode || "–" }),
    el("td", { text: r.model || "–" }),
    el("td", { text: (r.devices || []).join(", ") || "–" }),
    el("td", { class: "num", "data-requests": req ?? "", text: req ?? "–" }),
    el("td", { class: "num", text: r.loads ?? "–" }),
    el("td", { class: "reason", text: note }),
    el("td", {}, button));
}

let singleChoice = null;
function singleSwitch(st) {
  const sel = el("select", { "aria-label": "profile to switch to" });
  for (const p of st.profiles || []) sel.append(el("option", { value: p, text: p, selected: p === singleChoice }));
  sel.addEventListener("change", () => { singleChoice = sel.value; });
  return el("div", { class: "port-head" }, el("span", { text: "Switch this port to" }), sel,
    el("button", { type: "button", "data-action": "switch", disabled: busy,
      onclick: () => act("switch", { profile: sel.value }, `switch to ${sel.value}`), text: "Switch" }));
}

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
    const cpuProcs = procs.filter((p) => p.gpu_bytes === null || p.gpu_bytes === undefined);
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
  for (const [k, v] of Object.entries(planned)) {
    if (!k.startsWith("remote:")) continue;
    out.push(el("div", { class: "dev" }, el("div", { class: "dev-name", text: `remote peer ${k.slice(7)}` }),
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
    el("i", { class: "plan" }), `planned by hydra ${plan ? fmtBytes(plan) : "–"}`);
  const per = procs.filter((p) => val(p)).map((p) => `${p.name} ${fmtBytes(val(p))}`).join(" · ");
  return el("div", { class: "dev" }, el("div", { class: "dev-name", text: title }), bar, legend,
    el("div", { class: "note", text: note + (per ? ` — ${per}` : "") }));
}

const SIGNALS = { 1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM" };
function lastExit(x) {
  if (x === null || x === undefined) return "–";
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
        el("td", { text: r.profile || "–" }),
        el("td", { text: p.role }),
        el("td", { text: p.device || "–" }),
        el("td", {}, badge(p.state)),
        el("td", { class: "num", "data-pid": p.pid ?? "", text: p.pid ?? "–" }),
        el("td", { class: "num", text: fmtDur(up) }),
        el("td", { class: "num", "data-restarts": p.restarts, text: p.restarts }),
        el("td", { text: lastExit(p.last_exit) }),
        el("td", { class: "reason", text: [p.reason, p.warning].filter(Boolean).join(" · ") }),
        el("td", { class: "num", text: p.gpu_bytes ? `${fmtBytes(p.gpu_bytes)} GPU` : fmtBytes(p.rss_bytes) }),
        el("td", {},
          el("button", { type: "button", "data-action": "log", onclick: () => chooseLog(p.name), text: "Log" }), " ",
          el("button", { type: "button", "data-action": "restart", disabled: busy || !p.managed,
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

function renderSwitches(snap) {
  // every lane's last changes (with times), and a port's whose first switch failed; newest last
  const all = [...(snap.switches || [])];
  for (const p of snap.ports || []) if (!(p.lanes || []).length) all.push(...(p.switches || []));
  all.sort((a, b) => (a.at || 0) - (b.at || 0));
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
    return el("div", { class: "sw" },
      el("div", {}, el("b", { text: `${s.from || "–"} → ${s.to || "–"}` }), " ", badge(s.result),
        el("span", { class: "muted", text: ` ${Number(s.total_s || 0).toFixed(1)} s${s.at ? ` · ${fmtTime(s.at)}` : ""}` }),
        s.cut ? el("span", { class: "muted", text: ` · ${s.cut} request${s.cut === 1 ? "" : "s"} cut` }) : null),
      bar, text,
      s.error ? el("div", { class: "err", text: `${s.failed_phase ? s.failed_phase + ": " : ""}${s.error}` }) : null);
  });
  patchChildren(box, out);
}

// -- logs -------------------------------------------------------------------------------------

const logState = { name: null, cursor: null, pid: null, gone: false, timer: null };

let logNames = [];
function updateLogChoices(rows) {
  const names = rows.flatMap((r) => (r.processes || []).map((p) => p.name));
  logNames = names;
  const sel = $("log-select");
  const have = [...sel.options].map((o) => o.value);
  if (names.join() !== have.join()) {
    sel.replaceChildren(...names.map((n) => el("option", { value: n, text: n })));
    if (logState.name && names.includes(logState.name)) sel.value = logState.name;
  }
  if (!logState.name && names.length) chooseLog(names[0]);
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

poll();
setInterval(poll, POLL_MS);
