"""A port's routing table: an immutable value the loop publishes after every change of the
port's lanes; router threads read it and decide nothing the loop decides.

`Port` (serve/port.py) builds a `RouteTable` on the event loop whenever a lane changes (its
phase, its processes, its profile) or the port's set of lanes changes (a switch, a flip), and
hands it to its router in one assignment. A router thread asks `select(model, method, path)`:
the answer is a lane's Route (its gate holds, releases or refuses; the lane is the only
writer of it) or a LocalReply the table answers itself (/v1/models, 404 for an unknown model,
/health while the default lane is not loaded). A request for a lane the table publishes as
loadable (stopped or failed, loaded on request) is *posted* to the loop (`ask_load`), which
decides whether and when it loads: the table itself never starts anything.

Every port works the same way, with any number of lanes: the request's `model` picks the lane
(its name or an alias); no model picks the default lane; a port with one lane also sends it
every other model name (llama-server on its own answers any `model`) but those another port
of this hydra serves; one with several answers 404 naming the known ones; a port with no lane
answers 503 naming `hydra switch NAME` (but GET /v1/models: an empty list).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from hydra_supervisor.router.replies import JSONValue
from hydra_supervisor.router.routes import LocalReply, Route

MODEL_PATHS = ("/v1/models", "/models")
HEALTH_PATHS = ("/health", "/v1/health")

JSONDict = dict[str, JSONValue]


@dataclass(frozen=True)
class Entry:
    """One lane as the router sees it, published by the loop."""

    name: str
    route: Route
    state: str  # the published word (serve/states.py)
    loadable: bool  # stopped or failed, and loaded on request: a request asks the loop
    failed: bool  # its last load failed (the default's /health answers 503)
    reason: str  # why it is not loaded, or its error (for the default's 503)


def _no_load(_name: str) -> None:
    return None


@dataclass(frozen=True)
class RouteTable:
    """What the router reads per request (router threads); built on the loop, never changed."""

    entries: Mapping[str, Entry] = field(default_factory=lambda: MappingProxyType({}))
    lookup: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    default: str | None = None
    none: Route | None = None  # where requests go while the port has no lane (503)
    models: JSONDict = field(default_factory=dict)  # /v1/models, as published
    ask_load: Callable[[str], None] = _no_load  # posts a load request to the loop
    elsewhere: frozenset[str] = frozenset()  # model names other ports of this hydra serve

    @property
    def needs_model(self) -> bool:
        """Whether a request's `model` can change where it goes (more than one lane): a port
        with one lane routes without reading the body first."""
        return len(self.entries) > 1

    def __call__(self, model: str | None, method: str, path: str) -> Route | LocalReply:
        return self.select(model, method, path)

    def select(self, model: str | None, method: str, path: str) -> Route | LocalReply:
        if method == "GET" and path in MODEL_PATHS:
            # no lane (hydra up --no-profile): an empty list, as OpenAI's API and
            # llama-server's router mode answer with no model, not an error clients retry
            return LocalReply(200, _copy(self.models) if self.entries
                              else {"object": "list", "data": []})
        if not self.entries:  # every other request: 503 naming `hydra switch NAME`
            assert self.none is not None
            return self.none
        default = self.entries.get(self.default) if self.default is not None else None
        if not model and method in ("GET", "HEAD") and default is not None:
            idle = self._idle_default(default, path)
            if idle is not None:
                return idle
            if method == "GET" and path in HEALTH_PATHS:
                held = _health_while_held(default)
                if held is not None:
                    return held
        name = self.default if not model else self.lookup.get(model)
        if name is None and model and len(self.entries) == 1 and model not in self.elsewhere:
            name = next(iter(self.entries))  # one lane: any model name (as llama-server)
        if name is None:
            known = ", ".join(sorted(self.lookup))
            return LocalReply(404, {"error": {
                "code": 404, "type": "not_found_error",
                "message": f"model '{model}' is not served here; known models: {known}"}},
                counter="unknown_model")
        entry = self.entries[name]
        if entry.loadable:
            self.ask_load(name)  # the loop decides (and sets the gate the request meets)
        return entry.route

    def _idle_default(self, entry: Entry, path: str) -> LocalReply | None:
        """A GET without a model while the default lane is not loaded (a health checker, a
        monitor): answered here, so polling does not load (or keep loaded) a profile."""
        if entry.state not in ("stopped", "failed"):
            return None
        words = {n: e.state for n, e in self.entries.items()}
        if path == "/health" and entry.failed:
            # A load balancer must take this host out: its default profile does not serve.
            return LocalReply(503, {"error": {
                "code": 503, "type": "unavailable_error",
                "message": f"the default profile {entry.name} failed: {entry.reason}"},
                "profiles": words}, counter="default_failed")
        if path == "/health":
            return LocalReply(200, {"status": "ok", "profiles": words})
        if path == "/slots":
            return LocalReply(200, [])
        return LocalReply(503, {"error": {
            "code": 503, "type": "unavailable_error",
            "message": f"the default profile {entry.name} is not loaded ({entry.reason}); "
                       "a request naming a model loads it (GET /v1/models lists them)"}},
            counter="default_not_loaded")


def _health_while_held(entry: Entry) -> LocalReply | None:
    """GET /health while the lane holds its requests (its head loads or restarts): 503 at
    once, as llama-server itself answers while it loads, instead of holding it: a health
    checker (a load balancer, systemd, a monitor) must not wait out a load."""
    if entry.route.gate.held_reason is None:
        return None
    return LocalReply(503, {"error": {"code": 503, "message": "Loading model",
                                      "type": "unavailable_error"}},
                      counter="health_while_loading")


def _copy(models: JSONDict) -> JSONDict:
    """A fresh copy for one reply (the reply may be changed by whoever sends it)."""
    data = models.get("data")
    rows: list[JSONValue] = [dict(r) if isinstance(r, Mapping) else r for r in data] \
        if isinstance(data, list) else []
    return {**models, "data": rows}
