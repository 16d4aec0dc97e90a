"""Metrics, part 1: hydra's own state as Prometheus families, read from the daemon's published
status (serve/snapshot.py's typed `Snapshot`) at every scrape (`SnapshotCollector`), so nothing
is stored twice and nothing drifts: engine and process states, restarts, last exit codes,
router counters, switches, the lanes of each port. The server is metrics.py.
"""

from __future__ import annotations

import re
import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

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
from hydra_supervisor.serve.snapshot import LaneStatus, RouterCounters, Snapshot, SwitchStatus

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


@dataclass(frozen=True)
class Row:
    """One `engine` label of the metrics: a lane (engine="port-N/PROFILE"), or a port with no
    lane (engine="port-N", profile "")."""

    name: str
    profile: str
    state: str
    url: str
    lane: LaneStatus | None  # None: the port's own row


def engine_rows(snap: Snapshot) -> list[Row]:
    out = []
    for p in snap.ports:
        if not p.lanes:
            out.append(Row(p.name, "", p.word(), p.url, None))
        out += [Row(x.name, x.profile, x.state, p.url, x) for x in p.lanes]
    return out


class SnapshotCollector(Collector):
    """hydra's own state, read from `snapshot()` at every scrape."""

    def __init__(self, snapshot: SnapshotFn) -> None:
        self._snapshot = snapshot
        self._tallies: dict[str, _SwitchTally] = {}
        self._lock = threading.Lock()  # concurrent scrapes

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        rows = engine_rows(snap)
        info = InfoMetricFamily("hydra", "hydra itself", labels=["version"])
        info.add_metric([__version__], {"pid": str(snap.daemon.pid)})
        yield info
        yield GaugeMetricFamily("hydra_start_time_seconds",
                                "When this hydra started (unix time)",
                                value=snap.daemon.started)
        yield from self._engines(rows)
        yield from self._processes(rows)
        # The router is the port's: its series are labelled by the port alone
        # (engine="port-N"), so a switch does not move them to another profile.
        yield from self._routers([(p.name, p.router) for p in snap.ports
                                  if p.router is not None])
        yield from self._switches(snap)
        yield from self._profiles(rows)

    # -- the lanes of a port (their loads, unloads and gate counters)
    @staticmethod
    def _profiles(rows: list[Row]) -> Iterator[Metric]:
        el = ["engine", "profile"]
        loads = CounterMetricFamily("hydra_profile_loads",
                                    "Loads of a profile (at start, on request, by switch)",
                                    labels=el)
        unloads = CounterMetricFamily("hydra_profile_unloads",
                                      "Unloads of a profile (ttl, room for another, switch)",
                                      labels=el)
        held = GaugeMetricFamily("hydra_profile_held",
                                 "Requests held for the profile (loading, room)", labels=el)
        inflight = GaugeMetricFamily("hydra_profile_inflight",
                                     "The profile's requests sent upstream", labels=el)
        waiting = GaugeMetricFamily("hydra_profile_waiting",
                                    "Requests queued for a concurrency slot", labels=el)
        # Its live load, as hydra's router counts it (router/traffic.py): no `metrics: true`
        # needed, and tokens counted as they stream (llama-server's own counter moves only
        # when a request ends).
        lane_inflight = GaugeMetricFamily(
            "hydra_lane_inflight", "Requests of the lane sent upstream, response not finished",
            labels=el)
        lane_queued = GaugeMetricFamily(
            "hydra_lane_queued", "Requests of the lane held at its gate or waiting for a "
            "concurrency slot", labels=el)
        lane_tps = GaugeMetricFamily(
            "hydra_lane_tokens_per_second", "Tokens the lane generated per second over the "
            "last 5 s, counted by hydra's router as they stream", labels=el)
        generated = CounterMetricFamily(
            "hydra_generated_tokens", "Tokens generated by the lane since hydra started "
            "(exact once each request ends: llama-server's predicted_n)", labels=el)
        prompt = CounterMetricFamily(
            "hydra_prompt_tokens", "Prompt tokens of the lane's requests since hydra started "
            "(cached ones included)", labels=el)
        lanes = [(r, r.lane) for r in rows if r.lane is not None]
        for r, lane in lanes:
            lv = [r.name, r.profile]
            loads.add_metric(lv, float(lane.loads))
            unloads.add_metric(lv, float(lane.unloads))
            held.add_metric(lv, float(lane.held))
            inflight.add_metric(lv, float(lane.inflight))
            waiting.add_metric(lv, float(lane.waiting or 0))
            lane_inflight.add_metric(lv, float(lane.inflight))
            lane_queued.add_metric(lv, float(lane.queued))
            lane_tps.add_metric(lv, lane.tokens_per_s)
            generated.add_metric(lv, float(lane.generated_tokens))
            prompt.add_metric(lv, float(lane.prompt_tokens))
        if lanes:
            yield from (loads, unloads, held, inflight, waiting, lane_inflight, lane_queued,
                        lane_tps, generated, prompt)

    # -- engines
    @staticmethod
    def _engines(rows: list[Row]) -> Iterator[Metric]:
        info = InfoMetricFamily("hydra_engine", "An engine: one external port, one layout",
                                labels=["engine", "profile"])
        state = GaugeMetricFamily("hydra_engine_state", "1 for the engine's current state",
                                  labels=["engine", "profile", "state"])
        for r in rows:
            lane = r.lane
            info.add_metric([r.name, r.profile], {
                "mode": (lane.mode or "") if lane else "",
                "model": (lane.model or "") if lane else "", "url": r.url,
                # a port's standby layout (serve/standby.py) beside its active one
                "role": lane.role if lane else "active",
            })
            for s in dict.fromkeys([*ENGINE_STATES, r.state]):
                if s:
                    state.add_metric([r.name, r.profile, s], 1.0 if s == r.state else 0.0)
        yield info
        yield state

    # -- processes
    @staticmethod
    def _processes(rows: list[Row]) -> Iterator[Metric]:
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
        for r in rows:
            for p in r.lane.processes if r.lane is not None else ():
                lv = [r.name, r.profile, p.name, p.role, p.device]
                for s in dict.fromkeys([*PROCESS_STATES, p.state]):
                    if s:
                        state.add_metric([*lv, s], 1.0 if s == p.state else 0.0)
                up.add_metric(lv, 1.0 if p.state == "READY" else 0.0)
                restarts.add_metric(lv, float(p.restarts))
                if p.last_exit is not None:
                    last_exit.add_metric(lv, float(p.last_exit))
                if p.started is not None:
                    started.add_metric(lv, p.started)
        yield from (state, up, restarts, last_exit, started)

    # -- routers
    @staticmethod
    def _routers(routers: list[tuple[str, RouterCounters]]) -> Iterator[Metric]:
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
            accepted.add_metric(lv, float(st.accepted))
            for kind, n in st.by_kind.items():
                conns.add_metric([*lv, kind, "relayed"], float(n))
            for reason, n in st.refused.items():
                refused.add_metric([*lv, reason], float(n))
            for key, value in (("open", st.open), ("held", st.held), ("inflight", st.inflight),
                               ("pending", st.pending), ("open_peak", st.open_peak),
                               ("pooled", st.pooled)):
                gauges[key].add_metric(lv, float(value))
            byte_count.add_metric([*lv, "up"], float(st.bytes_up))
            byte_count.add_metric([*lv, "down"], float(st.bytes_down))
            # http: {"requests": n, "1xx": n, ..., "5xx": n, "cut": n, "retried": n}
            for cls, n in st.http.items():
                if _STATUS_CLASS.match(cls):
                    http.add_metric([*lv, cls], float(n))
            for counter, key in ((http_total, "requests"), (cut, "cut"), (retried, "retried")):
                if key in st.http:
                    counter.add_metric(lv, float(st.http[key]))
            for what, n in st.events.items():
                events.add_metric([*lv, what], float(n))
            alive.add_metric(lv, 1.0 if st.alive else 0.0)
            recoveries.add_metric(lv, float(st.recoveries))
            recovery_failures.add_metric(lv, float(st.recovery_failures))
            if st.fds is not None:
                for what, n in (("nofile", st.fds.nofile), ("budget", st.fds.budget),
                                ("relays", st.fds.relays)):
                    fd_gauge.add_metric([*lv, what], float(n))
        yield from (accepted, conns, refused, *gauges.values(), byte_count, http_total, http,
                    cut, retried, events, alive, recoveries, recovery_failures, fd_gauge)

    # -- switches
    def _switches(self, snap: Snapshot) -> Iterator[Metric]:
        count = CounterMetricFamily("hydra_switches", "Layout switches by result",
                                    labels=["engine", "result"])
        phases = SummaryMetricFamily("hydra_switch_phase_seconds",
                                     "Time spent in each switch phase (phase=total: whole "
                                     "switch)", labels=["engine", "phase"])
        last = GaugeMetricFamily("hydra_switch_last_phase_seconds",
                                 "The last switch's time per phase", labels=["engine", "phase"])
        # A lane's reports, and a port's without a lane (its first switch failed).
        histories = [(x.name, x.switches) for p in snap.ports for x in p.lanes]
        histories += [(p.name, p.switches) for p in snap.ports if not p.lanes]
        for name, switches in histories:
            # Keyed by the row's name: a lane numbers its reports (seq) on its own, so lanes
            # sharing a port each need their own tally. The name is stable across switches
            # (port-N/PROFILE for a lane, port-N for a port without one).
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
    """Cumulative switch counts from a snapshot that keeps only the last N switch reports (a
    lane's deque). The lane numbers its reports (``seq``: 1, 2, …), so each scrape adds
    those numbered after the last one it counted and the counters never go down. (More than N
    switches between two scrapes: the oldest are not counted.)"""

    def __init__(self) -> None:
        self.last_seq = 0
        self.results: Tally[str] = Tally()
        self.phase_count: Tally[str] = Tally()
        self.phase_sum: dict[str, float] = {}

    def update(self, switches: Sequence[SwitchStatus]) -> None:
        for s in switches:
            if s.seq > self.last_seq:
                self._count(s)
        self.last_seq = max([self.last_seq, *(s.seq for s in switches)])

    def _count(self, s: SwitchStatus) -> None:
        self.results[s.result] += 1
        for phase, secs in _phases(s).items():
            self.phase_count[phase] += 1
            self.phase_sum[phase] = self.phase_sum.get(phase, 0.0) + secs


def _phases(switch: SwitchStatus) -> dict[str, float]:
    return {**switch.phases, "total": switch.total_s}
