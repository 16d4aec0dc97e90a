"""A port's routing table and its own answers: `Port.select` (router threads), the load a
request for a stopped lane asks for, /v1/models, the state word of a lane on the port.

A part of ``Port`` (serve/port.py) as a mixin: the Port is one object with one set of fields
(no added indirection per request); this module holds what the router's table does with them.
`select` runs on router threads and only reads and posts work to the loop; the rest runs on
the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hydra_supervisor.router.routes import LocalReply, Route
from hydra_supervisor.serve import states
from hydra_supervisor.serve.states import LaneState

if TYPE_CHECKING:
    from hydra_supervisor.serve.lane import Lane
    from hydra_supervisor.serve.standby import Standby

log = logging.getLogger("hydra")
_DEMAND_WAIT_S = 5.0  # how long a router thread waits for the loop to take a request's load
MODEL_PATHS = ("/v1/models", "/models")
HEALTH_PATHS = ("/health", "/v1/health")


class PortRouting:
    """The router's table of ``Port``: `select` and what it answers or asks the loop for."""

    # The Port's state this part uses (serve/port.py sets it in Port.__init__).
    by_model: bool
    clock: Callable[[], float]
    lanes: dict[str, Lane]
    lookup: dict[str, str]
    default: str | None
    loop: asyncio.AbstractEventLoop | None
    standby: Standby | None
    _created: int
    _none: Route

    if TYPE_CHECKING:  # the Port's (port.py)
        def only(self) -> Lane | None: ...
        def down(self) -> str | None: ...

    # -- routing (router threads) ------------------------------------------------------------------

    def select(self, model: str | None, method: str, path: str) -> Route | LocalReply:
        if not self.by_model:
            lane = self.only()
            if self.standby is not None and method == "GET" and path in MODEL_PATHS \
                    and self.standby.wanted() is not None:
                return LocalReply(200, self.models_json())  # says which layout stands by
            if lane is not None and method == "GET" and path in HEALTH_PATHS:
                held = self._health_while_held(lane)
                if held is not None:
                    return held
            return lane.route if lane is not None else self._none
        if method == "GET" and path in MODEL_PATHS:
            return LocalReply(200, self.models_json())
        if not model and method in ("GET", "HEAD"):
            idle = self._idle_default(path)
            if idle is not None:
                return idle
            default = self.lanes.get(self.default) if self.default is not None else None
            if default is not None and method == "GET" and path in HEALTH_PATHS:
                held = self._health_while_held(default)
                if held is not None:
                    return held
        name = self.default if not model else self.lookup.get(model)
        if name is None:
            known = ", ".join(sorted(self.lookup))
            return LocalReply(404, {"error": {
                "code": 404, "type": "not_found_error",
                "message": f"model '{model}' is not served here; known models: {known}"}},
                counter="unknown_model")
        lane = self.lanes[name]
        if lane.on_demand and lane.phase in (LaneState.STOPPED, LaneState.FAILED):
            self._demand(lane)
        return lane.route

    @staticmethod
    def _health_while_held(lane: Lane) -> LocalReply | None:
        """GET /health while the lane holds its requests (its head loads or restarts): 503 at
        once, as llama-server itself answers while it loads, instead of holding it: a health
        checker (a load balancer, systemd, a monitor) must not wait out a load."""
        if lane.route.gate.held_reason is None:
            return None
        return LocalReply(503, {"error": {"code": 503, "message": "Loading model",
                                          "type": "unavailable_error"}},
                          counter="health_while_loading")

    def _idle_default(self, path: str) -> LocalReply | None:
        """A GET without a model while the default lane is not loaded (a health checker, a
        monitor): answered here, so polling does not load (or keep loaded) a profile."""
        lane = self.lanes[self.default] if self.default is not None else None
        if lane is None or lane.phase not in (LaneState.STOPPED, LaneState.FAILED):
            return None
        words = {n: self.state_of(x) for n, x in self.lanes.items()}
        if path == "/health" and lane.phase is LaneState.FAILED:
            # A load balancer must take this host out: its default profile does not serve.
            return LocalReply(503, {"error": {
                "code": 503, "type": "unavailable_error",
                "message": f"the default profile {lane.name} failed: {lane.error}"},
                "profiles": words}, counter="default_failed")
        if path == "/health":
            return LocalReply(200, {"status": "ok", "profiles": words})
        if path == "/slots":
            return LocalReply(200, [])
        return LocalReply(503, {"error": {
            "code": 503, "type": "unavailable_error",
            "message": f"the default profile {lane.name} is not loaded ({lane.error or lane.why}); "
                       "a request naming a model loads it (GET /v1/models lists them)"}},
            counter="default_not_loaded")

    def _demand(self, lane: Lane) -> None:
        """A request for a stopped or failed lane (a router thread): the loop decides and acts
        (the lane is the only writer of its gate, on the loop's thread); this thread waits for
        that, bounded, so that the request meets the gate as the loop left it (held for the
        load, or still answering the failure during its cooldown)."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:  # (tests route from the loop's own thread: it cannot wait for itself)
            self._demand_now(lane.name, later=True)
            return
        fut = asyncio.run_coroutine_threadsafe(self._demand_on_loop(lane.name), loop)
        try:
            fut.result(_DEMAND_WAIT_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            log.warning("profile %s: the loop did not take its load request within %gs",
                        lane.name, _DEMAND_WAIT_S)

    async def _demand_on_loop(self, name: str) -> None:
        self._demand_now(name)

    def _demand_now(self, name: str, later: bool = False) -> None:
        """(The loop's thread.) The gate is set at once; the load starts now or, ``later``, on
        the loop's next turn."""
        lane = self.lanes.get(name)
        if lane is None:
            return
        if lane.phase is LaneState.FAILED:
            if self.clock() - lane.failed_at < lane.cooldown:
                return  # its route answers 503 with the failure until the cooldown is over
            # Before the request reaches the gate: it must wait for the load, not get the 503.
            lane.hold(f"loading profile {lane.name} (on request, after a failure)",
                      clear_refusal=True)
        if later and self.loop is not None:
            self.loop.call_soon(self._want, name)
        else:
            self._want(name)

    def _want(self, name: str) -> None:
        lane = self.lanes[name]
        if lane.job is None and lane.phase in (LaneState.STOPPED, LaneState.FAILED):
            lane.job = asyncio.create_task(lane.load("on request"))

    # -- answers ----------------------------------------------------------------------------------

    def state_of(self, lane: Lane) -> str:
        if self.down():
            return states.PORT_DOWN  # no request reaches any lane here (phase: its own)
        return lane.state_now().value

    def models_json(self) -> dict[str, Any]:
        data = []
        for lane in self.lanes.values():
            data.append({
                "id": lane.name, "object": "model", "created": self._created,
                "owned_by": "hydra", "state": self.state_of(lane),
                "status": {"value": states.MODEL_STATUS[lane.state_now()]},
                "aliases": list(lane.aliases), "default": lane.name == self.default,
                "devices": list(lane.devices), "mode": lane.dep.plan.mode,
                "model": lane.dep.model_label, "on_demand": lane.on_demand,
                "error": lane.error, "standby": False})
        if self.standby is not None:
            data += self.standby.models()
        return {"object": "list", "data": data}
