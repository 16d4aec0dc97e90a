// hydra bench --plot: two uPlot charts (tokens/s and TTFT p50 against concurrency, one series
// per leg) and a table, from the points the page was written with (const P).
"use strict";
const levels = [...new Set(P.map(p => p.concurrency))].sort((a, b) => a - b);
const legs = [...new Set(P.map(p => p.leg))];
const colors = {router: "#2563eb", direct: "#dc2626"};
function chart(node, key, unit) {
  const series = legs.map(l => levels.map(c => {
    const p = P.find(q => q.leg === l && q.concurrency === c); return p ? p[key] : null; }));
  new uPlot({width: 460, height: 280, legend: {show: true, live: false},
    scales: {x: {time: false, distr: levels.length > 1 ? 3 : 1, log: 2},
              y: {range: (u, lo, hi) => [0, Math.max(1, (hi || 0) * 1.15)]}},
    axes: [{label: "concurrency", values: (u, v) => v.map(x => levels.includes(x) ? x : "")},
           {label: unit, size: 56}],
    series: [{label: "concurrency"}, ...legs.map(l => ({label: l, stroke: colors[l] || "#16a34a",
      width: 2, points: {size: 7}, value: (u, v) => v == null ? "-" : v.toFixed(1) + " " + unit}))],
  }, [levels, ...series], document.getElementById(node));
}
chart("tps", "throughput_tps", "tokens/s");
chart("ttft", "ttft_p50_ms", "ms");
const t = document.getElementById("table");
const head = ["leg", "concurrency", "ok", "tokens/s", "TTFT p50 ms", "TTFT p95 ms", "decode p50 t/s"];
t.insertRow().append(...head.map(h => { const th = document.createElement("th"); th.textContent = h; return th; }));
const f = v => v == null ? "-" : (typeof v === "number" ? v.toFixed(1) : v);
for (const p of P) {
  const r = t.insertRow();
  for (const v of [p.leg, p.concurrency, p.ok + "/" + p.requests, f(p.throughput_tps), f(p.ttft_p50_ms),
                   f(p.ttft_p95_ms), f(p.decode_p50_tps)]) r.insertCell().textContent = v;
}
