"""Lane- and port-level policy fakes, shared by the fast serve/ policy tests (no processes).

What is faked: a lane's route (`FakeRoute`, over a real Gate) and the router that hands routes
out (`FakeRouter`); a supervisor and its processes (`FakeSupervisor`, `FakeProc`; `FleetFake`
adds a head-only reload), started to the behaviour a test scripts per profile in `BEHAVIOUR`
and recorded in `STARTED`; the policy's clock (`FakeClock`). Plus the deployments and helpers
those tests build on: `dep` (a one-lane port's layout), `fdep`/`prof`/`GIB` (a by-model
port's layouts and profiles), `make`/`run`/`route`/`until` (a by-model port on fake
supervisors, run with a body, requests selected, conditions awaited).

Used by tests/test_engine_policy.py, test_fleet_policy.py, test_change_policy.py,
test_port_down.py and test_standby_policy.py. (The supervisor's own policy tests run the real
Supervisor on fake children instead: tests/fake_children.py.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.devices import Device, Kind
from hydra_supervisor.plan.plan import EngineSpec, Placement, Plan, Role, RouterSpec
from hydra_supervisor.proc.managed import State
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router.gate import Gate
from hydra_supervisor.router.routes import Route
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import SwitchTimeouts

# -- a lane's route, the router, supervisors (one-lane port: test_engine_policy) ---------------


class FakeRoute(Route):
    """A lane's route that records what the lane does with it (hold, release, unavailable,
    upstream, cut) and fakes the requests in flight; its gate is real (held/unavailable
    reasons are read from it)."""

    calls: list[tuple[str, Any]]
    inflight_left: int
    unanswered: int

    def __init__(self, name: str, gate: Gate) -> None:
        super().__init__(name, gate)
        self.calls = []
        self.inflight_left = 0
        self.unanswered = 0  # of inflight_left: without a response byte (re-sent on a cut)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "http" and "calls" in self.__dict__:
            self.calls.append(("upstreams", value))
        super().__setattr__(name, value)

    @property
    def held(self) -> str | None:
        return self.gate.held_reason

    @property
    def unavailable(self) -> str | None:
        return self.gate.unavailable_reason()

    def hold(self, reason: str) -> None:
        super().hold(reason)
        self.calls.append(("hold", reason))

    def release(self) -> None:
        super().release()
        self.calls.append(("release", None))

    def set_unavailable(self, reason: str | None, retry_after: int = 5) -> None:
        super().set_unavailable(reason, retry_after)
        self.calls.append(("unavailable", reason))

    def wait_idle(self, timeout: float) -> int:
        return self.inflight_left

    def cut_inflight(self, reason: str, requeue: bool = False) -> int:
        n, self.inflight_left = self.inflight_left, 0
        self.calls.append(("cut", requeue))
        return n - self.unanswered if requeue else n


class FakeRouter:
    def __init__(self, host: str, port: int, upstreams: Any, **kw: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.port = port
        self.upstreams = upstreams
        self.running = False
        self.fail_start = 0  # the next N start() calls raise OSError (port taken)
        self.routes: list[FakeRoute] = []
        self.table: Any = None

    def new_route(self, name: str, limit: int | None = None, queue: int = 0) -> FakeRoute:
        route = FakeRoute(name, Gate(120.0, 1024))
        self.routes.append(route)
        return route

    def start(self) -> None:
        self.calls.append(("start", None))
        if self.fail_start:
            self.fail_start -= 1
            raise OSError(98, "Address already in use")
        self.running = True

    def stop(self) -> None:
        self.calls.append(("stop", None))
        self.running = False

    def alive(self) -> bool:
        return self.running

    def set_upstreams(self, u: Any) -> None:
        self.upstreams = u
        self.calls.append(("upstreams", u))

    def set_request_defaults(self, d: dict[str, Any]) -> None:
        self.calls.append(("defaults", d))

    def stats(self) -> dict[str, Any]:
        return {"alive": self.running, "open": 0}


@dataclass(frozen=True)
class FakeSpec:
    role: Role
    host: str = "127.0.0.1"
    port: int = 9
    device: str = "gpu0"
    managed: bool = True


class FakeProc:
    """A process as a lane reads it (its status: serve/lane.py `_process_status`)."""

    def __init__(self, name: str, role: Role, owner: FakeSupervisor) -> None:
        self.name = name
        self.spec = FakeSpec(role)
        self.state = State.STOPPED
        self.reason = ""
        self.pid: int | None = None
        self.owner = owner
        self.restarts = 0
        self.started_wall: float | None = None
        self.alive = False
        self.last_exit: int | None = None
        self.log_path = f"/logs/{name}.log"
        self.warning = ""
        self.first_failure_log: str | None = None

    def to(self, st: State, reason: str = "") -> None:
        self.state, self.reason = st, reason
        for fn in self.owner.listeners:
            fn(self)

    def log_tail(self) -> list[str]:
        return [f"{self.name} log line"]

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value}


# How each fake profile behaves when started.
BEHAVIOUR: dict[str, str] = {}
STARTED: list[FakeSupervisor] = []


class FakeSupervisor:
    def __init__(self, dep: Deployment, state: StateDir) -> None:
        self.plan = dep.plan
        self.timeouts = dep.timeouts
        self.model_label = "m"
        self.first_ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.fatal: str | None = None
        self.degraded: str | None = None
        self.listeners: list[Any] = []
        # the lane's seams (issue 18: `router` is gone): its route (stall rule), a moved
        # upstream's callback, fail-fast for a change, the planned head swap
        self.traffic: Any = None
        self.on_upstream_moved: Any = None
        self.fail_fast = False
        self.before_head_swap: Any = None
        head = next((e.name for e in dep.plan.engines if e.role is Role.HEAD), "head")
        self.head = FakeProc(head, Role.HEAD, self)
        self.procs = [FakeProc(e.name, e.role, self) for e in dep.plan.peers] + [self.head]
        self.restarted: list[str] = []
        self.unkillable: list[str] = []
        self.on_publish: Any = None
        STARTED.append(self)

    def request_stop(self, reason: str) -> None:
        self.stopping.set()

    async def run(self) -> None:
        how = BEHAVIOUR.get(self.plan.profile, "ok")
        for p in self.procs:
            p.to(State.STARTING, "spawning")
            p.pid = 1000 + len(STARTED)
        await asyncio.sleep(0.01)
        if how == "crash":
            self.head.to(State.BACKOFF, "exit 1; restart in 1s")
        elif how == "ok":
            for p in self.procs:
                p.to(State.READY, "ok")
            self.first_ready.set()
        await self.stopping.wait()
        for p in self.procs:
            p.to(State.STOPPED, "stopped")
            p.pid = None

    async def restart(self, name: str, fail_fast: bool = False) -> None:
        self.restarted.append(name)


def dep(name: str, peers: int = 0, load: float = 5.0) -> Deployment:
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=("-m", name),
                      env=(), host="127.0.0.1", port=30200, device="cpu", start_order=peers)
    ps = tuple(EngineSpec(name=f"peer-{i}", role=Role.PEER, program="ggml-rpc-server", args=(),
                          env=(), host="127.0.0.1", port=30052 + i, device="cpu",
                          start_order=i) for i in range(peers))
    plan = Plan(profile=name, source=f"{name}.yaml", model_path="m.gguf", model_kind="dense",
                mode="combine" if peers else "solo", transport="rpc", host="127.0.0.1",
                port=8080, engines=(*ps, head),
                router=RouterSpec("127.0.0.1", 8080, ("127.0.0.1", 30200), None, ()))
    return Deployment(plan=plan, binaries={}, timeouts=Timeouts(load=load, peer=1.0))


# -- a port routed by model (test_fleet_policy) --------------------------------------------------

GIB = 1 << 30


class FleetFake(FakeSupervisor):
    def adopt_head(self, dep: Deployment) -> None:  # a head-only reload (plandiff HEAD)
        self.plan = dep.plan
        self.timeouts = dep.timeouts


DEVICES = {"gpu0": Device("gpu0", Kind.CUDA, 24 * GIB, 24 * GIB, cuda_index=0),
           "gpu1": Device("gpu1", Kind.CUDA, 16 * GIB, 16 * GIB, cuda_index=1)}


def fdep(name: str, port: int, **gib: float) -> Deployment:
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=("-m", name),
                      env=(), host="127.0.0.1", port=port, device=next(iter(gib)),
                      start_order=0)
    places = tuple(Placement(dev, 1, int(n * GIB), 0, 0, 0) for dev, n in gib.items())
    plan = Plan(profile=name, source=f"{name}.yaml", model_path=f"{name}.gguf",
                model_kind="dense", mode="solo", transport="rpc", host="127.0.0.1", port=0,
                engines=(head,), placements=places,
                router=RouterSpec("127.0.0.1", 0, ("127.0.0.1", port), None, ()))
    return Deployment(plan=plan, binaries={}, timeouts=Timeouts(load=5.0, peer=1.0),
                      # what a lane reads of its layout.Layout: devices, and the profile
                      # (None here: the test gives the lane its Profile)
                      layout=SimpleNamespace(devices=DEVICES, profile=None))


def prof(name: str, **kw: Any) -> Profile:
    return Profile(name=name, source=f"{name}.yaml", model=name, **kw)


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


class FakeClock:
    """The policy's clock (cooldowns, loaded_at, failed_at), moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s

def make(tmp_path: Path, *members: tuple[Profile, Deployment], default: str = "a",
         drain: float = 0.2, clock: Callable[[], float] | None = None) -> Port:
    BEHAVIOUR.clear()
    STARTED.clear()
    node = Node({"cuda0": 24 * GIB, "cuda1": 16 * GIB}, load_wait=5.0,
                **({"clock": clock} if clock is not None else {}))
    f = Port(StateDir(tmp_path), "127.0.0.1", 0, node=node,
             allow=("127.0.0.0/8",), switch_timeouts=SwitchTimeouts(drain=drain, gpu_free=0.1),
             load_wait=5.0, make_supervisor=FleetFake)
    f.default = default
    for prof_, dep_ in members:
        f.plan_lane(prof_, dep_)
    try:
        f.open()
    except BaseException:
        f.close()  # a refused port does not keep its router running
        raise
    return f


def run(f: Port, body: Callable[[], Any], initial: list[str] | None = None) -> None:
    async def go() -> None:
        await f.start(["a"] if initial is None else initial)
        await asyncio.wait_for(f.started.wait(), 5)
        try:
            await body()
        finally:
            await f.shutdown("test")
            f.close()

    asyncio.run(go())


def route(f: Port, model: str | None) -> Route:
    sel = f.select(model, "POST", "/v1/chat/completions")
    assert isinstance(sel, Route), sel
    return sel
