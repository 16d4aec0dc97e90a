"""Prometheus metrics for hydra, served on a loopback port of its own (never the external port:
that port's HTTP belongs to llama-server).

Three sources, one registry:
  - the daemon's status `snapshot()` (the dict `GET /status` serves; shape in docs/control.md):
    read at every scrape by `SnapshotCollector`, so nothing is stored twice and nothing drifts:
    engine and process states, restarts, last exit codes, router counters, switches;
  - per-request records from the router's `on_request` callback (`observe_request`): HTTP
    requests by status, outcome and duration, in prometheus_client's own Counter/Histogram;
  - every READY head's own llama-server `/metrics` (it must run with `--metrics`), scraped at
    scrape time and relabelled with `engine` and `profile` (`HeadCollector`).
The exposition is prometheus_client's; nothing here formats the text protocol by hand.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import requests
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from hydra_supervisor import __version__
from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.router.conn import is_loopback
from hydra_supervisor.serve import states

log = logging.getLogger("hydra.metrics")

Snapshot = Mapping[str, Any]
SnapshotFn = Callable[[], Snapshot]

# Every state a process or an engine can be in: each gets a series (1 for the current one, 0
# for the rest), so a dashboard can alert on `hydra_process_state{state="FATAL"} == 1` before
# it has ever happened. A state not listed here still gets its series when it shows up.
PROCESS_STATES = ("STOPPED", "STARTING", "READY", "UNHEALTHY", "STOPPING", "BACKOFF", "FATAL")
# A lane's state (serve/states.py: one vocabulary for status, /v1/models, metrics, notify and
# wire INFO), or the port's own words: "idle" (no profile loaded) and "port down" (its router
# is not accepting connections: every client is refused).
ENGINE_STATES = states.WORDS
SWITCH_RESULTS = ("ok", "rolled_back", "failed", "noop")
REQUEST_OUTCOMES = ("ok", "cut", "held_timeout", "error")
# Request durations: a health check (ms) to a long generation (minutes).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                    600)
# llama-server's endpoints, so a path label cannot grow without bound (ids, query strings).
KNOWN_PATHS = frozenset({
    "/", "/health", "/v1/health", "/metrics", "/props", "/slots", "/models", "/v1/models",
    "/completion", "/completions", "/v1/completions", "/chat/completions",
    "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/infill",
    "/embedding", "/embeddings", "/v1/embeddings", "/rerank", "/reranking", "/v1/rerank",
    "/v1/reranking", "/tokenize", "/detokenize", "/apply-template", "/lora-adapters",
    "/v1/responses", "/api/tags", "/api/show", "/api/chat",
})
_SLOT_PATH = re.compile(r"^/slots/\d+$")
_STATUS_CLASS = re.compile(r"^[1-5]xx$")


def endpoint_label(path: str) -> str:
    """The request path as a bounded label: known endpoints as they are, `/slots/{id}`, or
    `other`."""
    path = path.split("?", 1)[0] or "/"
    if path in KNOWN_PATHS:
        return path
    if _SLOT_PATH.match(path):
        return "/slots/{id}"
    return "other"


def status_class(status: Any) -> str:
    try:
        code = int(status)
    except (TypeError, ValueError):
        return "none"
    return f"{code // 100}xx" if 100 <= code <= 599 else "none"


# ---------------------------------------------------------------------------------------------
# From the snapshot


def _engine_labels(engine: Mapping[str, Any]) -> tuple[str, str]:
    return str(engine.get("name", "")), str(engine.get("profile") or "")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class SnapshotCollector(Collector):
    """hydra's own state, read from `snapshot()` at every scrape."""

    def __init__(self, snapshot: SnapshotFn) -> None:
        self._snapshot = snapshot
        self._tallies: dict[Any, _SwitchTally] = {}
        self._lock = threading.Lock()  # concurrent scrapes

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        engines = list(snap.get("engines") or [])
        info = InfoMetricFamily("hydra", "hydra itself", labels=["version"])
        info.add_metric([__version__], {"pid": str(snap.get("pid", ""))})
        yield info
        started = _num(snap.get("started"))
        if started is not None:
            yield GaugeMetricFamily("hydra_start_time_seconds",
                                    "When this hydra started (unix time)", value=started)
        yield from self._engines(engines)
        yield from self._processes(engines)
        yield from self._routers(engines)
        yield from self._switches(engines)
        yield from self._profiles(engines)

    # -- several profiles per port (fleet.py)
    @staticmethod
    def _profiles(engines: list[Mapping[str, Any]]) -> Iterator[Metric]:
        el = ["engine", "profile"]
        loads = CounterMetricFamily("hydra_profile_loads",
                                    "Loads of a profile (at start, on request, by switch)",
                                    labels=el)
        unloads = CounterMetricFamily("hydra_profile_unloads",
                                      "Unloads of a profile (ttl, room for another, switch)",
                                      labels=el)
        gauges = {key: GaugeMetricFamily(f"hydra_profile_{key}", doc, labels=el)
                  for key, doc in (("held", "Requests held for the profile (loading, room)"),
                                   ("inflight", "The profile's requests sent upstream"),
                                   ("waiting", "Requests queued for a concurrency slot"))}
        any_fleet = False
        for e in engines:
            fl = e.get("fleet")
            if not isinstance(fl, Mapping):
                continue
            any_fleet = True
            lv = list(_engine_labels(e))
            loads.add_metric(lv, float(fl.get("loads") or 0))
            unloads.add_metric(lv, float(fl.get("unloads") or 0))
            for key, fam in gauges.items():
                fam.add_metric(lv, float(fl.get(key) or 0))
        if any_fleet:
            yield loads
            yield unloads
            yield from gauges.values()

    # -- engines
    @staticmethod
    def _engines(engines: list[Mapping[str, Any]]) -> Iterator[Metric]:
        info = InfoMetricFamily("hydra_engine", "An engine: one external port, one layout",
                                labels=["engine", "profile"])
        state = GaugeMetricFamily("hydra_engine_state", "1 for the engine's current state",
                                  labels=["engine", "profile", "state"])
        for e in engines:
            name, profile = _engine_labels(e)
            info.add_metric([name, profile], {
                "mode": str(e.get("mode") or ""), "model": str(e.get("model") or ""),
                "url": str(e.get("url") or ""),
                # a port's standby layout (serve/standby.py) beside its active one
                "role": "standby" if e.get("standby") else "active",
            })
            current = str(e.get("state") or "")
            for s in dict.fromkeys([*ENGINE_STATES, current]):
                if s:
                    state.add_metric([name, profile, s], 1.0 if s == current else 0.0)
        yield info
        yield state

    # -- processes
    @staticmethod
    def _processes(engines: list[Mapping[str, Any]]) -> Iterator[Metric]:
        labels = ["engine", "profile", "process", "role", "device"]
        state = GaugeMetricFamily("hydra_process_state", "1 for the process's current state",
                                  labels=[*labels, "state"])
        up = GaugeMetricFamily("hydra_process_up", "1 while the process is READY",
                               labels=labels)
        restarts = CounterMetricFamily("hydra_process_restarts",
                                       "Restarts of this process since hydra started",
                                       labels=labels)
        last_exit = GaugeMetricFamily("hydra_process_last_exit_code",
                                      "Exit status of the process's last run (negative: killed "
                                      "by that signal); absent until it has exited once",
                                      labels=labels)
        started = GaugeMetricFamily("hydra_process_start_time_seconds",
                                    "When the running process started (unix time)",
                                    labels=labels)
        for e in engines:
            name, profile = _engine_labels(e)
            for p in e.get("processes") or []:
                lv = [name, profile, str(p.get("name", "")), str(p.get("role", "")),
                      str(p.get("device") or "")]
                current = str(p.get("state") or "")
                for s in dict.fromkeys([*PROCESS_STATES, current]):
                    if s:
                        state.add_metric([*lv, s], 1.0 if s == current else 0.0)
                up.add_metric(lv, 1.0 if current == "READY" else 0.0)
                restarts.add_metric(lv, _num(p.get("restarts")) or 0.0)
                code = _num(p.get("last_exit"))
                if code is not None:
                    last_exit.add_metric(lv, code)
                t0 = _num(p.get("started"))
                if t0 is not None:
                    started.add_metric(lv, t0)
        yield from (state, up, restarts, last_exit, started)

    # -- routers
    @staticmethod
    def _routers(engines: list[Mapping[str, Any]]) -> Iterator[Metric]:
        el = ["engine", "profile"]
        conns = CounterMetricFamily(
            "hydra_router_connections",
            "Connections the router accepted, by protocol (first bytes) and outcome",
            labels=[*el, "protocol", "outcome"])
        refused = CounterMetricFamily(
            "hydra_router_connections_refused",
            "Connections closed before a relay, by reason", labels=[*el, "reason"])
        accepted = CounterMetricFamily("hydra_router_connections_accepted",
                                       "Connections accepted on the external port", labels=el)
        gauges = {
            key: GaugeMetricFamily(f"hydra_router_{key}", doc, labels=el)
            for key, doc in (
                ("open", "Connections being relayed now"),
                ("held", "HTTP requests parked while the engine switches or restarts"),
                ("inflight", "HTTP requests sent upstream whose response has not completed"),
                ("pending", "Accepted connections waiting for their first bytes or a slot"),
                ("open_peak", "Most connections relayed at once since the start"),
                ("pooled", "Idle upstream connections kept for reuse"),
            )
        }
        byte_count = CounterMetricFamily("hydra_router_bytes",
                                         "Bytes relayed (up: client to engine, down: back)",
                                         labels=[*el, "direction"])
        http = CounterMetricFamily("hydra_router_http_responses",
                                   "HTTP responses by status class, as the router counts them",
                                   labels=[*el, "status_class"])
        http_total = CounterMetricFamily("hydra_router_http_requests",
                                         "HTTP requests the router finished", labels=el)
        events = CounterMetricFamily("hydra_router_events",
                                     "Trouble the router survived (e.g. EMFILE waited out)",
                                     labels=[*el, "event"])
        alive = GaugeMetricFamily("hydra_router_alive",
                                  "1 while the router's acceptor thread runs (0: the port "
                                  "refuses every connection)", labels=el)
        recoveries = CounterMetricFamily(
            "hydra_router_recoveries",
            "Times hydra stopped and started the router again because its acceptor was not "
            "running (the router's own acceptor restarts: hydra_router_events_total"
            "{event=\"acceptor_restart\"})", labels=el)
        recovery_failures = CounterMetricFamily(
            "hydra_router_recovery_failures",
            "Router restarts by hydra that did not bring the port back", labels=el)
        fd_gauge = GaugeMetricFamily("hydra_router_fds",
                                     "File descriptors: the limit, the router's budget, in use "
                                     "by relays", labels=[*el, "kind"])
        cut = CounterMetricFamily("hydra_router_http_cut",
                                  "HTTP requests cut mid-response (upstream died, or a switch)",
                                  labels=el)
        retried = CounterMetricFamily("hydra_router_http_retried",
                                      "HTTP requests retried after the upstream refused them",
                                      labels=el)
        for e in engines:
            st = e.get("router")
            if not isinstance(st, Mapping):
                continue  # router: false (llama-server on the external port itself)
            lv = list(_engine_labels(e))
            total = _num(st.get("accepted", st.get("total")))
            if total is not None:
                accepted.add_metric(lv, total)
            for kind, value in (st.get("by_kind") or {}).items():
                if isinstance(value, Mapping):  # {outcome: n} when the router splits them
                    for outcome, n in value.items():
                        conns.add_metric([*lv, str(kind), str(outcome)], _num(n) or 0.0)
                else:
                    conns.add_metric([*lv, str(kind), "relayed"], _num(value) or 0.0)
            for reason, n in _refusals(st).items():
                refused.add_metric([*lv, reason], n)
            for key, fam in gauges.items():
                v = _num(st.get(key))
                if v is not None:
                    fam.add_metric(lv, v)
            for direction in ("up", "down"):
                v = _num(st.get(f"bytes_{direction}"))
                if v is not None:
                    byte_count.add_metric([*lv, direction], v)
            h = st.get("http")
            if isinstance(h, Mapping):
                # {"requests": n, "1xx": n, ..., "5xx": n, "cut": n, "retried": n}
                for cls, n in h.items():
                    if _STATUS_CLASS.match(str(cls)):
                        http.add_metric([*lv, str(cls)], _num(n) or 0.0)
                for counter, key in ((http_total, "requests"), (cut, "cut"),
                                     (retried, "retried")):
                    v = _num(h.get(key))
                    if v is not None:
                        counter.add_metric(lv, v)
            ev = st.get("events")
            if isinstance(ev, Mapping):
                for what, n in ev.items():
                    events.add_metric([*lv, str(what)], _num(n) or 0.0)
            if isinstance(st.get("alive"), bool):
                alive.add_metric(lv, 1.0 if st["alive"] else 0.0)
            for counter, key in ((recoveries, "recoveries"),
                                 (recovery_failures, "recovery_failures")):
                v = _num(st.get(key))
                if v is not None:
                    counter.add_metric(lv, v)
            fds = st.get("fds")
            if isinstance(fds, Mapping):
                for what, n in fds.items():
                    v = _num(n)
                    if v is not None:
                        fd_gauge.add_metric([*lv, str(what)], v)
        yield from (accepted, conns, refused, *gauges.values(), byte_count, http_total, http,
                    cut, retried, events, alive, recoveries, recovery_failures, fd_gauge)

    # -- switches
    def _switches(self, engines: list[Mapping[str, Any]]) -> Iterator[Metric]:
        count = CounterMetricFamily("hydra_switches", "Layout switches by result",
                                    labels=["engine", "result"])
        phases = SummaryMetricFamily("hydra_switch_phase_seconds",
                                     "Time spent in each switch phase (phase=total: whole "
                                     "switch)", labels=["engine", "phase"])
        last = GaugeMetricFamily("hydra_switch_last_phase_seconds",
                                 "The last switch's time per phase", labels=["engine", "phase"])
        for e in engines:
            name = str(e.get("name", ""))
            switches = [s for s in e.get("switches") or [] if isinstance(s, Mapping)]
            # Keyed by the external port: it stays put across switches, the name may not.
            with self._lock:
                tally = self._tallies.setdefault(e.get("port", name), _SwitchTally())
                tally.update(switches)
                results = dict(tally.results)
                sums = {k: (tally.phase_count[k], v) for k, v in tally.phase_sum.items()}
            for r in dict.fromkeys([*SWITCH_RESULTS, *results]):
                count.add_metric([name, r], float(results.get(r, 0)))
            for phase, (n, total) in sums.items():
                phases.add_metric([name, phase], count_value=n, sum_value=total)
            if switches:
                for phase, secs in _phases(switches[-1]).items():
                    last.add_metric([name, phase], secs)
        yield from (count, phases, last)


class _SwitchTally:
    """Cumulative switch counts from a snapshot that keeps only the last N switch reports (the
    Engine's deque). The engine numbers its reports (``seq``: 1, 2, …), so each scrape adds
    those numbered after the last one it counted and the counters never go down. (More than N
    switches between two scrapes: the oldest are not counted.)"""

    def __init__(self) -> None:
        self.last_seq = 0
        self.results: Tally[str] = Tally()
        self.phase_count: Tally[str] = Tally()
        self.phase_sum: dict[str, float] = {}

    def update(self, switches: Sequence[Mapping[str, Any]]) -> None:
        seqs = [s["seq"] for s in switches if isinstance(s.get("seq"), int)]
        for s in switches:
            if isinstance(s.get("seq"), int) and s["seq"] > self.last_seq:
                self._count(s)
        self.last_seq = max([self.last_seq, *seqs])

    def _count(self, s: Mapping[str, Any]) -> None:
        self.results[str(s.get("result"))] += 1
        for phase, secs in _phases(s).items():
            self.phase_count[phase] += 1
            self.phase_sum[phase] = self.phase_sum.get(phase, 0.0) + secs


def _phases(switch: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, raw in (switch.get("phases") or {}).items():
        v = _num(raw)
        if v is not None:
            out[str(k)] = v
    total = _num(switch.get("total_s"))
    if total is not None:
        out["total"] = total
    return out


# The router's flat refusal counters (today) or a {reason: n} mapping (`refused` by reason).
_FLAT_REFUSALS = {"refused": "queue_full", "rejected": "unrecognised", "denied": "not_allowed",
                  "timeouts": "timeout", "upstream_errors": "upstream_error"}


def _refusals(st: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    refused = st.get("refused")
    if isinstance(refused, Mapping):
        out.update({str(k): v for k, n in refused.items() if (v := _num(n)) is not None})
    for key, reason in _FLAT_REFUSALS.items():
        if key == "refused" and isinstance(refused, Mapping):
            continue
        v = _num(st.get(key))
        if v is not None:
            out[reason] = out.get(reason, 0.0) + v
    return out


# ---------------------------------------------------------------------------------------------
# Heads' own llama-server /metrics


@dataclass(frozen=True)
class Head:
    """One llama-server to scrape: where, and the labels its series get."""

    engine: str
    profile: str
    url: str  # base URL, e.g. http://127.0.0.1:30200 (its internal port, not the router's)
    api_key: str | None = None  # llama-server's /metrics is behind --api-key when one is set


HeadsFn = Callable[[], Iterable[Head]]


def heads_from_snapshot(snap: Snapshot) -> list[Head]:
    """Every READY head process in the snapshot, at its own (internal) host:port."""
    out = []
    for e in snap.get("engines") or []:
        name, profile = _engine_labels(e)
        for p in e.get("processes") or []:
            if p.get("role") == "head" and p.get("state") == "READY" and p.get("port"):
                host = client_host(str(p.get("host") or "127.0.0.1"))
                host = f"[{host}]" if ":" in host else host
                out.append(Head(name, profile, f"http://{host}:{p['port']}"))
    return out


class HeadCollector(Collector):
    """Scrapes each head's /metrics at scrape time (in parallel, each bounded by `timeout`)
    and re-emits the series with `engine` and `profile` labels. A head that does not answer
    (loading, busy past the timeout, no --metrics) shows as hydra_head_scrape_up 0."""

    def __init__(self, heads: HeadsFn, timeout: float = 3.0) -> None:
        self._heads = heads
        self._timeout = timeout

    def _fetch(self, head: Head) -> tuple[str | None, float, str]:
        t0 = time.monotonic()
        headers = {"Authorization": f"Bearer {head.api_key}"} if head.api_key else {}
        try:
            r = requests.get(f"{head.url}/metrics", timeout=self._timeout, headers=headers)
        except requests.RequestException as exc:
            return None, time.monotonic() - t0, type(exc).__name__
        if r.status_code != 200:
            return None, time.monotonic() - t0, f"HTTP {r.status_code}"
        return r.text, time.monotonic() - t0, ""

    def collect(self) -> Iterator[Metric]:
        heads = list(self._heads())
        up = GaugeMetricFamily("hydra_head_scrape_up",
                               "1 when the head's llama-server /metrics answered this scrape "
                               "(it needs --metrics)", labels=["engine", "profile"])
        took = GaugeMetricFamily("hydra_head_scrape_duration_seconds",
                                 "How long the head's /metrics took", labels=["engine", "profile"])
        merged: dict[str, Metric] = {}
        if heads:
            with ThreadPoolExecutor(max_workers=min(8, len(heads)),
                                    thread_name_prefix="hydra-metrics") as pool:
                results = list(pool.map(self._fetch, heads))
        else:
            results = []
        for head, (text, secs, why) in zip(heads, results, strict=True):
            ok = text is not None
            if ok:
                try:
                    relabel(text or "", {"engine": head.engine, "profile": head.profile},
                            merged)
                except ValueError as exc:  # the parser's error for malformed exposition
                    ok, why = False, f"unparsable: {exc}"
            if not ok:
                log.debug("scrape of %s/metrics failed: %s", head.url, why)
            up.add_metric([head.engine, head.profile], 1.0 if ok else 0.0)
            took.add_metric([head.engine, head.profile], secs)
        yield up
        yield took
        yield from merged.values()


_COUNTER_WITHOUT_TOTAL = re.compile(r"^(# TYPE (?![^ ]*_total )[^ ]+ )counter$", re.MULTILINE)


def relabel(text: str, extra: Mapping[str, str], into: dict[str, Metric]) -> None:
    """Parse one exposition and add its samples, with `extra` labels, to `into` (families
    merged by name across heads). A label the source already has is kept as exported_<name>,
    as Prometheus does. A 'counter' whose sample lacks the _total suffix (llama-server's
    n_tokens_max, a high-water mark) is re-typed as a gauge, so the output stays valid."""
    # The parser would rename such a counter's samples to NAME_total; as a gauge the series
    # keeps llama-server's own name.
    text = _COUNTER_WITHOUT_TOTAL.sub(r"\1gauge", text)
    for fam in text_string_to_metric_families(text):
        typ = fam.type
        out = into.get(fam.name)
        if out is None:
            out = into[fam.name] = Metric(fam.name, fam.documentation, typ)
        elif out.type != typ:  # heads of different llama.cpp builds disagree: keep the first
            log.debug("metric %s is a %s here and a %s elsewhere; skipped", fam.name, typ,
                      out.type)
            continue
        for s in fam.samples:
            labels = {(f"exported_{k}" if k in extra else k): v for k, v in s.labels.items()}
            labels.update(extra)
            out.add_sample(s.name, labels, s.value, s.timestamp)


# ---------------------------------------------------------------------------------------------
# Per-request records


class RequestMetrics:
    """Fed by the router's on_request callback (its threads): prometheus_client's Counter and
    Histogram are thread-safe and cost a lock and an add each."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "hydra_http_requests", "HTTP requests through the router, by status and outcome",
            ["engine", "profile", "method", "endpoint", "status", "outcome", "model"],
            registry=registry)
        self.duration = Histogram(
            "hydra_http_request_duration_seconds",
            "HTTP request duration through the router, first byte in to last byte out",
            ["engine", "profile", "endpoint", "outcome"], buckets=DURATION_BUCKETS,
            registry=registry)
        self.bytes = Counter(
            "hydra_http_request_bytes", "HTTP bytes through the router (in: request body, "
            "out: response)", ["engine", "direction"], registry=registry)

    def observe(self, record: Mapping[str, Any], engine: str | None = None,
                profile: str | None = None) -> None:
        """``engine``: the label every other series of that port uses (``port-N``, or
        ``port-N/PROFILE`` with several profiles); ``profile``: the one that served it (the
        router's route), or ''."""
        eng = str(engine if engine is not None else record.get("engine") or "")
        prof = str(profile if profile is not None else record.get("route") or "")
        endpoint = endpoint_label(str(record.get("path") or ""))
        outcome = str(record.get("outcome") or "ok")
        status = record.get("status")
        self.requests.labels(eng, prof, str(record.get("method") or ""), endpoint,
                             str(status) if status is not None else "none", outcome,
                             str(record.get("model") or "")[:80]).inc()
        d = _num(record.get("duration_s"))
        if d is not None:
            self.duration.labels(eng, prof, endpoint, outcome).observe(d)
        for direction in ("in", "out"):
            n = _num(record.get(f"bytes_{direction}"))
            if n:
                self.bytes.labels(eng, direction).inc(n)


# ---------------------------------------------------------------------------------------------
# The HTTP side


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every 15 s would fill hydra's log

    def get_environ(self) -> dict[str, Any]:
        env = super().get_environ()
        # both ends of the connection: the dashboard asks the kernel which user is the peer
        env["hydra.peer"] = self.client_address
        env["hydra.local"] = self.connection.getsockname()
        return env


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """`GET /metrics` on a loopback port: hydra's state, per-request records and the heads'
    llama-server metrics. Threads of its own; `stop()` is bounded.

    snapshot: the daemon's status dict (read at each scrape; must be cheap and thread-safe).
    heads: who to scrape; default = every READY head in the snapshot. Pass a callable to add
           an api key (Head.api_key) or to scrape something else.
    external_ports: ports this server must never take (the engines' external ports); default
           = every engine `port` in the snapshot at start().
    wrap: given the WSGI app, returns the one to serve (the dashboard's routes beside it).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0,
                 snapshot: SnapshotFn | None = None, heads: HeadsFn | None = None, *,
                 scrape_timeout: float = 3.0,
                 external_ports: Sequence[int] | None = None,
                 wrap: Callable[[Any], Any] | None = None) -> None:
        if snapshot is None:
            raise TypeError("MetricsServer needs snapshot=")
        if not is_loopback(host):
            raise ValueError(f"metrics are served on a loopback address only, not {host!r}: "
                             "put a scraper on this host, or a reverse proxy with auth")
        self.host = host
        self._req_port = port
        self._snapshot = snapshot
        self._external = external_ports
        self._wrap = wrap  # wraps the WSGI app: more routes beside /metrics (the dashboard)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(snapshot))
        self.registry.register(HeadCollector(
            heads or (lambda: heads_from_snapshot(snapshot())), timeout=scrape_timeout))
        self.requests = RequestMetrics(self.registry)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- records from the router
    def observe_request(self, record: Mapping[str, Any], engine: str | None = None,
                        profile: str | None = None) -> None:
        """The router's on_request callback (or wrap it: `request_observer(engine)`)."""
        self.requests.observe(record, engine, profile)

    def request_observer(self, engine: str) -> Callable[[Mapping[str, Any]], None]:
        """A one-argument callback for `Router(on_request=...)` that labels with `engine`."""
        return lambda record: self.requests.observe(record, engine)

    # -- lifecycle
    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("metrics server not started")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("metrics server already started")
        external = set(self._external if self._external is not None else
                       (e.get("port") for e in self._snapshot().get("engines") or []))
        if self._req_port and self._req_port in external:
            raise ValueError(f"port {self._req_port} is an engine's external port; metrics "
                             "need a port of their own")
        cls = _Server6 if ":" in self.host else _Server
        app = make_wsgi_app(self.registry)
        if self._wrap is not None:
            app = self._wrap(app)
        self._server = make_server(self.host, self._req_port, app, cls,
                                   handler_class=_SilentHandler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.25},
                                        name="hydra-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on %s", self.url)

    def stop(self, timeout: float = 5.0) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(timeout)
        self._server = self._thread = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
