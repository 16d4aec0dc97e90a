"""Metrics, part 1: hydra's own state as Prometheus families, read from the daemon's published
status `snapshot()` at every scrape (`SnapshotCollector`), so nothing is stored twice and nothing
drifts: engine and process states, restarts, last exit codes, router counters, switches, the
profiles of a port that routes by model. The server is metrics.py.
"""

from __future__ import annotations

import re
import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from hydra_supervisor import __version__
from hydra_supervisor.serve import states

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
_STATUS_CLASS = re.compile(r"^[1-5]xx$")


# ---------------------------------------------------------------------------------------------
# From the snapshot


def engine_labels(engine: Mapping[str, Any]) -> tuple[str, str]:
    return str(engine.get("name", "")), str(engine.get("profile") or "")


def router_stats(snap: Snapshot) -> list[tuple[str, Mapping[str, Any]]]:
    """(port label, router counters) once per port. The router is the port's: its series are
    labelled by the port alone (engine="port-N"), so a switch does not move them to another
    profile. From `ports` (the daemon's snapshot); a snapshot without it (an older shape) has
    them on a port's first engine row."""
    out: dict[str, Mapping[str, Any]] = {}
    ports = snap.get("ports")
    if isinstance(ports, Sequence) and not isinstance(ports, str):
        for p in ports:
            if isinstance(p, Mapping) and isinstance(p.get("router"), Mapping):
                out.setdefault(str(p.get("name") or f"port-{p.get('port')}"), p["router"])
        return list(out.items())
    for e in snap.get("engines") or []:
        st = e.get("router")
        if isinstance(st, Mapping):
            port = e.get("port")
            out.setdefault(f"port-{port}" if port is not None else str(e.get("name", "")), st)
    return list(out.items())


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class SnapshotCollector(Collector):
    """hydra's own state, read from `snapshot()` at every scrape."""

    def __init__(self, snapshot: SnapshotFn) -> None:
        self._snapshot = snapshot
        self._tallies: dict[str, _SwitchTally] = {}
        self._lock = threading.Lock()  # concurrent scrapes

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        engines = list(snap.get("engines") or [])
        info = InfoMetricFamily("hydra", "hydra itself", labels=["version"])
        info.add_metric([__version__], {"pid": str(snap.get("pid", ""))})
        yield info
        started = num(snap.get("started"))
        if started is not None:
            yield GaugeMetricFamily("hydra_start_time_seconds",
                                    "When this hydra started (unix time)", value=started)
        yield from self._engines(engines)
        yield from self._processes(engines)
        yield from self._routers(router_stats(snap))
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
            lv = list(engine_labels(e))
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
            name, profile = engine_labels(e)
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
            name, profile = engine_labels(e)
            for p in e.get("processes") or []:
                lv = [name, profile, str(p.get("name", "")), str(p.get("role", "")),
                      str(p.get("device") or "")]
                current = str(p.get("state") or "")
                for s in dict.fromkeys([*PROCESS_STATES, current]):
                    if s:
                        state.add_metric([*lv, s], 1.0 if s == current else 0.0)
                up.add_metric(lv, 1.0 if current == "READY" else 0.0)
                restarts.add_metric(lv, num(p.get("restarts")) or 0.0)
                code = num(p.get("last_exit"))
                if code is not None:
                    last_exit.add_metric(lv, code)
                t0 = num(p.get("started"))
                if t0 is not None:
                    started.add_metric(lv, t0)
        yield from (state, up, restarts, last_exit, started)

    # -- routers
    @staticmethod
    def _routers(routers: list[tuple[str, Mapping[str, Any]]]) -> Iterator[Metric]:
        el = ["engine"]  # the port (port-N): no profile, the router is the port's
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
        for name, st in routers:  # none for router: false (llama-server on the port itself)
            lv = [name]
            total = num(st.get("accepted", st.get("total")))
            if total is not None:
                accepted.add_metric(lv, total)
            for kind, value in (st.get("by_kind") or {}).items():
                if isinstance(value, Mapping):  # {outcome: n} when the router splits them
                    for outcome, n in value.items():
                        conns.add_metric([*lv, str(kind), str(outcome)], num(n) or 0.0)
                else:
                    conns.add_metric([*lv, str(kind), "relayed"], num(value) or 0.0)
            for reason, n in _refusals(st).items():
                refused.add_metric([*lv, reason], n)
            for key, fam in gauges.items():
                v = num(st.get(key))
                if v is not None:
                    fam.add_metric(lv, v)
            for direction in ("up", "down"):
                v = num(st.get(f"bytes_{direction}"))
                if v is not None:
                    byte_count.add_metric([*lv, direction], v)
            h = st.get("http")
            if isinstance(h, Mapping):
                # {"requests": n, "1xx": n, ..., "5xx": n, "cut": n, "retried": n}
                for cls, n in h.items():
                    if _STATUS_CLASS.match(str(cls)):
                        http.add_metric([*lv, str(cls)], num(n) or 0.0)
                for counter, key in ((http_total, "requests"), (cut, "cut"),
                                     (retried, "retried")):
                    v = num(h.get(key))
                    if v is not None:
                        counter.add_metric(lv, v)
            ev = st.get("events")
            if isinstance(ev, Mapping):
                for what, n in ev.items():
                    events.add_metric([*lv, str(what)], num(n) or 0.0)
            if isinstance(st.get("alive"), bool):
                alive.add_metric(lv, 1.0 if st["alive"] else 0.0)
            for counter, key in ((recoveries, "recoveries"),
                                 (recovery_failures, "recovery_failures")):
                v = num(st.get(key))
                if v is not None:
                    counter.add_metric(lv, v)
            fds = st.get("fds")
            if isinstance(fds, Mapping):
                for what, n in fds.items():
                    v = num(n)
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
            # Keyed by the row's name: a lane numbers its reports (seq) on its own, so lanes
            # sharing a port each need their own tally. The name is stable across switches
            # (port-N for a port's one lane, port-N/PROFILE for a lane among several).
            with self._lock:
                tally = self._tallies.setdefault(name, _SwitchTally())
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
        v = num(raw)
        if v is not None:
            out[str(k)] = v
    total = num(switch.get("total_s"))
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
        out.update({str(k): v for k, n in refused.items() if (v := num(n)) is not None})
    for key, reason in _FLAT_REFUSALS.items():
        if key == "refused" and isinstance(refused, Mapping):
            continue
        v = num(st.get(key))
        if v is not None:
            out[reason] = out.get(reason, 0.0) + v
    return out


