"""A port's status rows: one per lane (or the port's own, with no lane), and the port's row for
the daemon's snapshot, which carries its router's counters (metrics label them by the port: a
switch does not move them). The first lane row carries a copy for `hydra status`.

A part of ``Port`` (serve/port.py) as a mixin; runs on the loop (the snapshot is built there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hydra_supervisor.proc import gpumem
from hydra_supervisor.router import Router
from hydra_supervisor.serve import states
from hydra_supervisor.serve.portwatch import PortWatch
from hydra_supervisor.serve.reports import SwitchReport

if TYPE_CHECKING:
    import collections

    from hydra_supervisor.serve.lane import Lane
    from hydra_supervisor.serve.standby import Standby


class PortStatus:
    """The status rows of ``Port``."""

    # The Port's state this part uses (serve/port.py sets it in Port.__init__).
    host: str
    port: int
    by_model: bool
    lanes: dict[str, Lane]
    default: str | None
    router: Router | None
    watch: PortWatch | None
    standby: Standby | None
    reports: collections.deque[SwitchReport]

    if TYPE_CHECKING:  # the Port's (port.py) and its routing part's (port_routing.py)
        @property
        def url(self) -> str: ...
        def alive(self) -> bool: ...
        def down(self) -> str | None: ...
        def state_of(self, lane: Lane) -> str: ...

    def router_stats(self) -> dict[str, Any] | None:
        """The port's router counters (held/inflight: every route's gate), None without a
        router (router: false)."""
        if self.router is None:
            return None
        st = self.router.stats()
        if self.watch is not None:
            st.update(self.watch.counts())
        return st

    def _row_router(self, st: dict[str, Any] | None, lane: Lane | None
                    ) -> dict[str, Any] | None:
        """The copy of the port's counters `st` on its first row (`hydra status`, the
        dashboard): a port's one lane shows its own gate's held/inflight."""
        if st is None:
            return None
        st = dict(st)
        if lane is not None and not self.by_model:
            st["held"] = lane.route.gate.held()
            st["inflight"] = lane.route.gate.inflight()
        return st

    def row(self, lane: Lane | None, gpu: dict[int, int]) -> dict[str, Any]:
        """One status row: a lane (or, for a port with none, the port itself); its `router`
        is None (`snapshot` puts the port's counters on the first row)."""
        sup = lane.sup if lane is not None else None
        dep = lane.dep if lane is not None else None
        if lane is None:
            word = states.PORT_DOWN if self.down() else states.IDLE
        else:
            word = self.state_of(lane)
        row: dict[str, Any] = {
            "name": f"port-{self.port}/{lane.name}" if self.by_model and lane is not None
            else f"port-{self.port}",  # stable across switches (metric labels)
            "profile": dep.profile if dep is not None else None,
            "source": dep.plan.source if dep is not None else None,
            "mode": dep.plan.mode if dep is not None else None,
            "model": dep.model_label if dep is not None else None,
            "host": self.host, "port": self.port, "url": self.url, "state": word,
            "down": self.down(),
            "switching": lane.switching if lane is not None else None,
            "fatal": sup.fatal if sup is not None else None,
            "degraded": sup.degraded if sup is not None else None,
            "processes": lane.process_rows(gpu) if lane is not None else [],
            "requests_last_min": lane.requests_last_min() if lane is not None else None,
            "router": None,
            "switches": [s.to_json() for s in (lane.switches if lane is not None
                                                else self.reports)],
        }
        if self.by_model and lane is not None:
            row["fleet"] = {"port": self.port, "default": lane.name == self.default,
                            **lane.lane_row()}
        return row

    def snapshot(self, gpu: dict[int, int] | None = None,
                 router: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """A row per lane; a copy of the port's router counters rides on the first row only
        (for `hydra status`; metrics read the port's own, `status_row()`). `router`: those
        counters when the caller has taken them already (one `Router.stats()` per snapshot)."""
        if gpu is None:
            running = any(x.running for x in self.lanes.values())
            gpu = gpumem.used_by_pid() if running else {}
        st = router if router is not None else self.router_stats()
        first = next(iter(self.lanes.values()), None)
        rows = [self.row(lane, gpu) for lane in self.lanes.values()] or [self.row(None, gpu)]
        rows[0]["router"] = self._row_router(st, first)
        if not self.lanes:
            return rows
        return self.standby.rows(rows, gpu) if self.standby is not None else rows

    def port_row(self) -> dict[str, Any]:
        return {"port": self.port, "url": self.url, "default": self.default,
                "profiles": list(self.lanes), "alive": self.alive(), "down": self.down()}

    def status_row(self, router: dict[str, Any] | None = None) -> dict[str, Any]:
        """The port in the snapshot's `ports`: its row and its router's counters (`router`:
        taken already by the caller)."""
        return {**self.port_row(), "name": f"port-{self.port}",
                "router": router if router is not None else self.router_stats()}
