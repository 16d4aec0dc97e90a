"""Lane- and port-level policy fakes, shared by the fast serve/ policy tests (no processes).

What is faked: a lane's route (`FakeRoute`, over a real Gate) and the router that hands routes
out (`FakeRouter`); a supervisor and its processes (`FakeSupervisor`, a serve/runner.py
Runner, also named `FleetFake`; its `FakeProc`s are ManagedProcesses it moves itself), started
to the behaviour a test scripts per profile in `BEHAVIOUR` and recorded in `STARTED`; the
policy's clock (`FakeClock`). Plus the deployments and helpers those tests build on: `dep` (a
one-lane port's layout), `fdep`/`prof`/`GIB` (a by-model port's layouts, on a real
plan.layout.Layout, and profiles), `make`/`run`/`route`/`until` (a by-model port on fake
supervisors, run with a body, requests selected, conditions awaited).

Typed as strictly as the package (`mypy --strict`, scripts/test): the fakes are checked against
the Protocols they stand in for (Runner, RouterLike) below.

Used by tests/test_engine_policy.py, test_fleet_policy.py, test_change_policy.py,
test_port_down.py and test_standby_policy.py. (The supervisor's own policy tests run the real
Supervisor on fake children instead: tests/fake_children.py.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Literal, TypedDict, Unpack

from hydra_supervisor.config.profile import Node as NodeFile
from hydra_supervisor.config.profile import Profile, RestartPolicy
from hydra_supervisor.jsontypes import JSONValue
from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.devices import Device, Inventory, Kind
from hydra_supervisor.plan.layout import Layout
from hydra_supervisor.plan.plan import (
    Address,
    EngineSpec,
    ModelKind,
    Placement,
    Plan,
    PlanMode,
    PlanTransport,
    Role,
    RouterSpec,
)
from hydra_supervisor.proc.health import Gated
from hydra_supervisor.proc.managed import ManagedProcess, State
from hydra_supervisor.proc.seams import UpstreamMoved
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router import Upstreams
from hydra_supervisor.router.gate import Gate
from hydra_supervisor.router.routes import Route, RouteTable
from hydra_supervisor.router.traffic import Traffic
from hydra_supervisor.serve.clock import Clock
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.portwatch import RouterLike
from hydra_supervisor.serve.reports import SwitchTimeouts
from hydra_supervisor.serve.runner import Runner

# -- a lane's route, the router, supervisors (one-lane port: test_engine_policy) ---------------

# What FakeRoute and FakeRouter record: (what, with what), e.g. ("hold", reason),
# ("cut", requeue), ("upstreams", address), ("start", None).
Call = tuple[str, object]


class FakeRoute(Route):
    """A lane's route that records what the lane does with it (hold, release, unavailable,
    upstream, cut) and fakes the requests in flight; its gate is real (held/unavailable
    reasons are read from it)."""

    calls: list[Call]
    inflight_left: int
    unanswered: int

    def __init__(self, name: str, gate: Gate) -> None:
        super().__init__(name, gate)
        self.calls = []
        self.inflight_left = 0
        self.unanswered = 0  # of inflight_left: without a response byte (re-sent on a cut)

    def __setattr__(self, name: str, value: object) -> None:
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
        self.calls.append(("drain", timeout))
        return self.inflight_left

    def cut_inflight(self, reason: str, requeue: bool = False) -> int:
        n, self.inflight_left = self.inflight_left, 0
        self.calls.append(("cut", requeue))
        return n - self.unanswered if requeue else n


class FakeRouter:
    """What a Port uses of its router (router/core.py Router), recorded; no sockets. Its
    `kw` (allow, name, the port's router_kwargs) are taken and ignored."""

    def __init__(self, host: str, port: int, upstreams: Upstreams | None,
                 **kw: object) -> None:
        self.calls: list[Call] = []
        self.port = port
        self.upstreams = upstreams
        self.running = False
        self.fail_start = 0  # the next N start() calls raise OSError (port taken)
        self.routes: list[FakeRoute] = []
        self.table: RouteTable | None = None
        self.traffic = Traffic()  # nothing reports into it: every lane reads zeros

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

    def set_upstreams(self, u: Upstreams) -> None:
        self.upstreams = u
        self.calls.append(("upstreams", u))

    def set_request_defaults(self, d: Mapping[str, JSONValue]) -> None:
        self.calls.append(("defaults", d))

    def stats(self) -> dict[str, bool | int]:
        return {"alive": self.running, "open": 0}


# The fake is what a PortWatch restarts (serve/portwatch.py RouterLike): mypy checks it here.
_AS_WATCHED: Callable[[str, int, Upstreams | None], RouterLike] = FakeRouter


# A fake process's spec answers at the discard port: nothing listens there, and a fake
# process has no HTTP (the lane's upstream for its head).
FAKE_HOST, FAKE_PORT = "127.0.0.1", 9


class FakePid:
    """The running child behind a FakeProc: a pid, no process (process.Child)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.exited_at: float | None = None

    async def wait(self) -> int:
        raise NotImplementedError("a fake supervisor never waits on its children")

    def signal_group(self, sig: int) -> None:
        pass


class FakeProc(ManagedProcess):
    """A ManagedProcess the fake supervisor moves as a test says (no transition table, no
    log file): `to` sets state and reason and tells the supervisor's listeners."""

    def __init__(self, spec: EngineSpec, owner: FakeSupervisor) -> None:
        super().__init__(spec=replace(spec, host=FAKE_HOST, port=FAKE_PORT),
                         binary=spec.program, log_path=Path(f"{spec.name}.log"),
                         policy=RestartPolicy(), on_change=lambda mp, moved: None)
        self.owner = owner

    def start(self, pid: int) -> None:
        self.child = FakePid(pid)

    def stopped(self) -> None:
        self.child = None

    def to(self, new: State, reason: str = "") -> None:
        self.state, self.reason = new, reason
        for fn in self.owner.listeners:
            fn(self)

    def log_tail(self, n: int = 12) -> list[str]:
        return [f"{self.name} log line"]

    def row(self) -> dict[str, str]:
        return {"name": self.name, "state": self.state.value}


# How each fake profile behaves when started (by its plan's profile; not named: "ok"):
# "ok" serves, "crash" leaves its head in BACKOFF, "hang" stays STARTING.
Behave = Literal["ok", "crash", "hang"]
BEHAVIOUR: dict[str, Behave] = {}
STARTED: list[FakeSupervisor] = []


class FakeSupervisor:
    """A Runner (serve/runner.py) whose processes do as BEHAVIOUR says for its profile."""

    def __init__(self, dep: Deployment, state: StateDir) -> None:
        self.plan = dep.plan
        self.timeouts = dep.timeouts
        self.model_label = "m"
        self.first_ready = asyncio.Event()
        self.stopping = asyncio.Event()
        self.fatal: str | None = None
        self.degraded: str | None = None
        self.listeners: list[Callable[[ManagedProcess], None]] = []
        # the lane's seams (issue 18: `router` is gone): its route (stall rule), a moved
        # upstream's callback, fail-fast for a change, the planned head swap
        self.traffic: Gated | None = None
        self.on_upstream_moved: UpstreamMoved | None = None
        self.on_replanned: Callable[[Deployment], None] | None = None
        self.fail_fast = False
        self.before_head_swap: Callable[[str], Awaitable[None]] | None = None
        head = next((e for e in dep.plan.engines if e.role is Role.HEAD), None) or EngineSpec(
            name="head", role=Role.HEAD, program="llama-server", args=(), env=(),
            host=FAKE_HOST, port=FAKE_PORT, device="cpu", start_order=len(dep.plan.peers))
        self.fake_head = FakeProc(head, self)
        self.fake_procs = [FakeProc(e, self) for e in dep.plan.peers] + [self.fake_head]
        # what the lane reads (the Runner's types; the same objects as fake_head, fake_procs)
        self.head: ManagedProcess | None = self.fake_head
        self.procs: list[ManagedProcess] = list(self.fake_procs)
        self.restarted: list[str] = []
        self.unkillable: list[str] = []
        self.on_publish: Callable[[], None] | None = None
        STARTED.append(self)

    def request_stop(self, reason: str) -> None:
        self.stopping.set()

    def kill_all_now(self) -> None:
        """Nothing to kill: its processes are fakes (request_stop ends them)."""

    async def run(self) -> None:
        how = BEHAVIOUR.get(self.plan.profile, "ok")
        for p in self.fake_procs:
            p.to(State.STARTING, "spawning")
            p.start(1000 + len(STARTED))
        await asyncio.sleep(0.01)
        if how == "crash":
            self.fake_head.to(State.BACKOFF, "exit 1; restart in 1s")
        elif how == "ok":
            for p in self.fake_procs:
                p.to(State.READY, "ok")
            self.first_ready.set()
        await self.stopping.wait()
        for p in self.fake_procs:
            p.to(State.STOPPED, "stopped")
            p.stopped()

    async def restart(self, name: str, fail_fast: bool = False) -> None:
        self.restarted.append(name)

    def adopt_head(self, dep: Deployment) -> None:  # a head-only reload (plandiff HEAD)
        self.plan = dep.plan
        self.timeouts = dep.timeouts


# The fake is a Runner (what Lane's `make_supervisor` makes): mypy checks it here.
_AS_RUNNER: Callable[[Deployment, StateDir], Runner] = FakeSupervisor


def dep(name: str, peers: int = 0, load: float = 5.0) -> Deployment:
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=("-m", name),
                      env=(), host="127.0.0.1", port=30200, device="cpu", start_order=peers)
    ps = tuple(EngineSpec(name=f"peer-{i}", role=Role.PEER, program="ggml-rpc-server", args=(),
                          env=(), host="127.0.0.1", port=30052 + i, device="cpu",
                          start_order=i) for i in range(peers))
    plan = Plan(profile=name, source=f"{name}.yaml", model_path="m.gguf",
                model_kind=ModelKind.DENSE,
                mode=PlanMode.COMBINE if peers else PlanMode.SOLO, transport=PlanTransport.RPC,
                engines=(*ps, head), router=RouterSpec(("127.0.0.1", 30200), None, ()))
    return Deployment(plan=plan, binaries={}, timeouts=Timeouts(load=load, peer=1.0))


# -- a port routed by model (test_fleet_policy) --------------------------------------------------

GIB = 1 << 30

# A by-model port's fake supervisor: the same fake (the name its tests import).
FleetFake = FakeSupervisor


DEVICES = {"gpu0": Device("gpu0", Kind.CUDA, 24 * GIB, 24 * GIB, cuda_index=0),
           "gpu1": Device("gpu1", Kind.CUDA, 16 * GIB, 16 * GIB, cuda_index=1)}


class Knobs(TypedDict, total=False):
    """A profile's routing knobs (docs/routing.md) a test sets with `prof`."""

    aliases: tuple[str, ...]
    on_demand: bool
    ttl: float | None
    min_resident: float
    concurrency: int | None
    queue: int


def prof(name: str, **kw: Unpack[Knobs]) -> Profile:
    return Profile(name=name, source=f"{name}.yaml", model=name, **kw)


def layout(plan: Plan, profile: Profile) -> Layout:
    """What a lane reads of its layout: the devices (DEVICES) and the profile; the rest is
    empty (no node file, model or inventory is read)."""
    return Layout(node=NodeFile(source="fake-node.yaml", devices={}), profile=profile,
                  model_path=Path(plan.model_path), model=None, devices=DEVICES,
                  inventory=Inventory(gpus=(), cpu_total=0, cpu_free=0, source="fake"),
                  plan=plan, external=Address("127.0.0.1", 0))


def fdep(name: str, port: int, *, profile: Profile | None = None, **gib: float) -> Deployment:
    """A by-model port's layout of profile `name` (`profile`: its profile, else `prof(name)`)
    needing `gib` GiB on each named device of DEVICES, its head at `port`."""
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=("-m", name),
                      env=(), host="127.0.0.1", port=port, device=next(iter(gib)),
                      start_order=0)
    places = tuple(Placement(dev, 1, int(n * GIB), 0, 0, 0) for dev, n in gib.items())
    plan = Plan(profile=name, source=f"{name}.yaml", model_path=f"{name}.gguf",
                model_kind=ModelKind.DENSE, mode=PlanMode.SOLO, transport=PlanTransport.RPC,
                engines=(head,), placements=places,
                router=RouterSpec(("127.0.0.1", port), None, ()))
    return Deployment(plan=plan, binaries={}, timeouts=Timeouts(load=5.0, peer=1.0),
                      layout=layout(plan, profile or prof(name)))


def with_profile(dep: Deployment, profile: Profile) -> Deployment:
    """`dep` with `profile` as its layout's profile (what planning that profile gives)."""
    return dep if dep.layout is None else replace(dep, layout=replace(dep.layout,
                                                                       profile=profile))


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
         drain: float = 0.2, clock: Clock | None = None) -> Port:
    """A by-model port on fake supervisors serving `members` (a test's profile and layout
    each), opened; `clock`: the policy's (the node's; default the real one)."""
    BEHAVIOUR.clear()
    STARTED.clear()
    cap = {"cuda0": 24 * GIB, "cuda1": 16 * GIB}
    node = Node(cap, load_wait=5.0) if clock is None else Node(cap, load_wait=5.0, clock=clock)
    f = Port(StateDir(tmp_path), "127.0.0.1", 0, node=node,
             allow=("127.0.0.0/8",), switch_timeouts=SwitchTimeouts(drain=drain, gpu_free=0.1),
             load_wait=5.0, make_supervisor=FakeSupervisor)
    f.default = default
    for prof_, dep_ in members:
        f.plan_lane(prof_, with_profile(dep_, prof_))
    try:
        f.open()
    except BaseException:
        f.close()  # a refused port does not keep its router running
        raise
    return f


def run(f: Port, body: Callable[[], Awaitable[None]], initial: list[str] | None = None) -> None:
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
