"""A Route of a shared router, seen as the Router an Engine drives.

An Engine owns "its" router: it holds it while its head loads, releases it, drains and cuts its
in-flight requests, and points its HTTP upstream at its head. When several profiles share one
port (fleet.py), each profile's Engine gets a RouteView instead: the same calls, applied to that
profile's own Route (gate and upstream), while the listener and every other route stay shared.
"""

from __future__ import annotations

import logging
from typing import Any

from hydra_supervisor.router.gate import DEFAULT_RETRY_AFTER
from hydra_supervisor.router.relay import Router, Upstreams
from hydra_supervisor.router.routes import Route

log = logging.getLogger("hydra.router")


class RouteView:
    def __init__(self, router: Router, route: Route) -> None:
        self.router = router
        self.route = route
        self.name = f"{router.name} / {route.name}"

    def start(self) -> None:  # the shared router is started and stopped by its owner
        pass

    def stop(self) -> None:
        pass

    @property
    def port(self) -> int:
        return self.router.port

    @property
    def upstreams(self) -> Upstreams:
        return Upstreams(http=self.route.http, hydra=self.router.upstreams.hydra)

    def set_upstreams(self, u: Upstreams) -> None:
        self.route.http = u.http

    def hold(self, reason: str) -> None:
        same = self.route.gate.held_reason == reason
        self.route.gate.hold(reason)
        if not same:
            log.info("router %s: holding new requests (%s)", self.name, reason)

    def release(self) -> None:
        held = self.route.gate.held()
        self.route.gate.release()
        log.info("router %s: released (%d requests were held)", self.name, held)

    def set_unavailable(self, reason: str | None, retry_after: int = DEFAULT_RETRY_AFTER) -> None:
        self.route.gate.set_unavailable(reason, retry_after)

    def inflight(self) -> int:
        return self.route.gate.inflight()

    def held(self) -> int:
        return self.route.gate.held()

    def wait_idle(self, timeout: float) -> int:
        return self.route.gate.wait_idle(timeout)

    def cut_inflight(self, reason: str, requeue: bool = False) -> int:
        n = self.route.gate.cut_inflight(reason, requeue)
        if n:
            log.info("router %s: cut %d in-flight requests (%s)", self.name, n, reason)
        return n

    def set_request_defaults(self, d: dict[str, Any]) -> None:
        self.router.set_request_defaults(d)  # T1 defaults are the port's, not one profile's

    def alive(self) -> bool:
        return self.router.alive()

    def stats(self) -> dict[str, Any]:
        out = self.router.stats()
        out["held"] = self.route.gate.held()
        out["inflight"] = self.route.gate.inflight()
        out["route"] = self.route.stats()
        return out
