"""Prometheus metrics for hydra, served on a loopback port of its own (never the external port:
that port's HTTP belongs to llama-server).

Three sources, one registry:
  - the daemon's published status (serve/snapshot.py's typed `Snapshot`; its JSON is what
    `GET /status` serves, docs/control.md): read at every scrape by `SnapshotCollector`, so
    nothing is stored twice and nothing drifts: engine and process states, restarts, last
    exit codes, router counters, switches;
  - per-request records from the router's `on_request` callback (`observe_request`): HTTP
    requests by status, outcome and duration, in prometheus_client's own Counter/Histogram;
  - every READY head's own llama-server `/metrics` (it must run with `--metrics`), scraped at
    scrape time and relabelled with `engine` and `profile` (`HeadCollector`).
The exposition is prometheus_client's; nothing here formats the text protocol by hand.

The parts: metrics_state.py (the snapshot's families), metrics_requests.py (per-request
records), metrics_heads.py (the heads' own /metrics); this module is the HTTP server that
serves them, and keeps their public names reachable as `metrics.NAME`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hydra_supervisor.router.conn import is_loopback
from hydra_supervisor.runtime.metrics_heads import (
    Head,
    HeadCollector,
    HeadsFn,
    heads_from_snapshot,
    relabel,
)
from hydra_supervisor.runtime.metrics_requests import (
    DURATION_BUCKETS,
    KNOWN_PATHS,
    REQUEST_OUTCOMES,
    RequestMetrics,
    endpoint_label,
    status_class,
)
from hydra_supervisor.runtime.metrics_state import (
    ENGINE_STATES,
    PROCESS_STATES,
    SWITCH_RESULTS,
    SnapshotCollector,
    SnapshotFn,
)
from hydra_supervisor.runtime.sideport import Limits, SidePort
from hydra_supervisor.serve.snapshot import Snapshot

__all__ = [
    "DURATION_BUCKETS", "ENGINE_STATES", "KNOWN_PATHS", "PROCESS_STATES", "REQUEST_OUTCOMES",
    "SWITCH_RESULTS", "Head", "HeadCollector", "HeadsFn", "MetricsServer", "RequestMetrics",
    "SidePortCollector",
    "Snapshot", "SnapshotCollector", "SnapshotFn", "endpoint_label", "heads_from_snapshot",
    "relabel", "status_class",
]

log = logging.getLogger("hydra.metrics")


class SidePortCollector(Collector):
    """The metrics port's own connections (sideport.py's counts): how many are open, and what
    became of the others — an alert on `refused` or `evicted` rising means someone holds the
    port's connections."""

    OUTCOMES = ("served", "refused", "evicted", "timed_out", "too_large", "bad_request")

    def __init__(self, stats: Callable[[], Mapping[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        st = self._stats()
        if not st:
            return
        yield GaugeMetricFamily("hydra_metrics_port_open",
                                "Connections open on the metrics/dashboard port",
                                value=st.get("open", 0))
        conns = CounterMetricFamily("hydra_metrics_port_connections",
                                    "Connections to the metrics/dashboard port by outcome "
                                    "(docs/dashboard.md, Limits)", labels=["outcome"])
        for outcome in self.OUTCOMES:
            conns.add_metric([outcome], st.get(outcome, 0))
        yield conns
        yield CounterMetricFamily("hydra_metrics_port_accept_failures",
                                  "accept() on the metrics port failed (out of descriptors)",
                                  value=st.get("accept_failed", 0))


class MetricsServer:
    """`GET /metrics` on a loopback port: hydra's state, per-request records and the heads'
    llama-server metrics. Served by a SidePort (sideport.py): bounded connections, time-outs
    and body, a small pool of threads; `stop()` is bounded.

    snapshot: the daemon's published Snapshot (read at each scrape; must be cheap and
              thread-safe).
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
                 wrap: Callable[[Any], Any] | None = None,
                 limits: Limits | None = None) -> None:
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
        self.registry.register(SidePortCollector(self.stats))
        self._limits = limits
        self._server: SidePort | None = None

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
        return self._server.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("metrics server already started")
        external = set(self._external if self._external is not None else
                       (p.port for p in self._snapshot().ports))
        if self._req_port and self._req_port in external:
            raise ValueError(f"port {self._req_port} is an engine's external port; metrics "
                             "need a port of their own")
        app = make_wsgi_app(self.registry)
        if self._wrap is not None:
            app = self._wrap(app)
        server = SidePort(self.host, self._req_port, app, limits=self._limits)
        server.start()
        self._server = server
        log.info("metrics on %s", self.url)

    def stats(self) -> dict[str, int]:
        """The side port's counts (sideport.py): open connections, refused, evicted..."""
        return self._server.stats() if self._server is not None else {}

    def stop(self, timeout: float = 5.0) -> None:
        server = self._server
        if server is None:
            return
        server.stop(timeout)
        self._server = None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
