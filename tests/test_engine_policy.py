"""A lane's switch policy with fake supervisors and a fake router (fast, no processes).

Hold, drain, stop, start, gate, release; rollback when the new layout fails; one switch at a
time; cancellation mid-switch; requests held while the head is not READY. (Issue 18: what
the Engine did is a Port with one lane, serve/port.py and serve/lane.py; the lane drives its
own route, which the fake router hands out.)
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.plan.deployment import Deployment, Timeouts
from hydra_supervisor.plan.plan import EngineSpec, Plan, Role, RouterSpec
from hydra_supervisor.proc.managed import State
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router.gate import Gate
from hydra_supervisor.router.routes import LocalReply, Route
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy, SwitchTimeouts


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
        self.route_by_model = False
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


class FakeProc:
    def __init__(self, name: str, role: Role, owner: FakeSupervisor) -> None:
        self.name = name
        self.spec = type("S", (), {"role": role})()
        self.state = State.STOPPED
        self.reason = ""
        self.pid: int | None = None
        self.owner = owner

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
        self.head = FakeProc("head", Role.HEAD, self)
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


@pytest.fixture
def engine(tmp_path: Path) -> Port:
    """A port as `hydra up` makes it for one profile (or none): not open yet, so that a test
    plans its lane first (`opened`)."""
    BEHAVIOUR.clear()
    STARTED.clear()
    return Port(StateDir(tmp_path), "127.0.0.1", 8080, node=Node({}),
                profiles=lambda: ["a", "b"],
                make_supervisor=FakeSupervisor,
                make_router=FakeRouter,  # type: ignore[arg-type]
                switch_timeouts=SwitchTimeouts(drain=0.1, gpu_free=0.1))


async def opened(port: Port, d: Deployment | None) -> None:
    """Open the port with a lane for `d` (None: a port with no lane) and start it."""
    if d is not None:
        port.plan_lane(None, d)
    port.open()
    await port.start()


def lane_of(port: Port) -> Lane:
    lane = port.only()
    assert lane is not None
    return lane


def route(port: Port) -> FakeRoute:
    """The lane's route (the old FakeRouter's hold/release/unavailable record is on it)."""
    r = lane_of(port).route
    assert isinstance(r, FakeRoute)
    return r


def word(port: Port) -> str:
    """The state word `hydra status` shows for the port's (only) lane, or the port's own."""
    lane = port.only()
    return lane.state_now().value if lane is not None else port.row(None, {})["state"]


async def started(port: Port, d: Deployment) -> None:
    await opened(port, d)
    sup = lane_of(port).sup
    assert sup is not None
    await asyncio.wait_for(sup.first_ready.wait(), 5)


def test_model_less_start_names_the_profiles(engine: Port) -> None:
    async def go() -> None:
        await opened(engine, None)
        assert word(engine) == "idle"
        msg = engine._none.gate.unavailable_reason() or ""  # a port with no lane answers
        assert "hydra switch NAME" in msg and "a, b" in msg
        rep = await engine.switch_to(dep("a"))
        assert rep.result == "ok" and word(engine) == "serving"
        assert route(engine).unavailable is None and route(engine).held is None
        await engine.shutdown("test")

    asyncio.run(go())


def test_switch_phases_in_order_and_requests_released(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        lane = lane_of(engine)
        old = lane.sup
        rep = await engine.switch_to(dep("b", peers=1))
        assert rep.result == "ok", rep
        assert list(rep.phases) == ["hold", "drain", "stop", "gpu_free", "start", "release"]
        assert old is not None and all(p.state is State.STOPPED for p in old.procs)
        assert lane.dep is not None and lane.dep.profile == "b"
        assert lane.last_good is lane.dep
        calls = [c for c, _ in route(engine).calls]
        # held before anything stopped; released only after the new head was READY
        assert calls.index("hold") < calls.index("release", calls.index("hold"))
        assert route(engine).held is None
        await engine.shutdown("test")

    asyncio.run(go())


def test_failed_switch_rolls_back_and_names_the_phase(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        lane = lane_of(engine)
        lane.last_good = lane.dep
        BEHAVIOUR["broken"] = "crash"
        rep = await engine.switch_to(dep("broken"))
        assert rep.result == "rolled_back"
        assert rep.failed_phase == "start" and "head" in (rep.error or "")
        assert rep.log_tail == ["head log line"]
        assert lane.dep is not None and lane.dep.profile == "a"
        assert word(engine) == "serving"
        assert route(engine).held is None
        await engine.shutdown("test")

    asyncio.run(go())


def test_failed_rollback_leaves_an_idle_engine_that_says_so(engine: Port) -> None:
    async def go() -> None:
        BEHAVIOUR["broken"] = "crash"
        await opened(engine, None)
        rep = await engine.switch_to(dep("broken"))
        assert rep.result == "failed"
        assert word(engine) == "idle"  # the port has no lane again
        assert "hydra switch NAME" in (engine._none.gate.unavailable_reason() or "")
        await engine.shutdown("test")

    asyncio.run(go())


def test_a_layout_that_never_gets_ready_times_out_and_rolls_back(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        BEHAVIOUR["slow"] = "hang"
        rep = await engine.switch_to(dep("slow", load=0.2))
        assert rep.result == "rolled_back" and "not ready within" in (rep.error or "")
        await engine.shutdown("test")

    asyncio.run(go())


def test_second_switch_is_refused_while_one_runs(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        BEHAVIOUR["slow"] = "hang"
        first = asyncio.create_task(engine.switch_to(dep("slow", load=0.5)))
        await asyncio.sleep(0.05)
        with pytest.raises(Busy, match="already running"):
            await engine.switch_to(dep("b"))
        await first
        await engine.shutdown("test")

    asyncio.run(go())


def test_drain_timeout_cuts_and_counts(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        route(engine).inflight_left = 3
        route(engine).unanswered = 2  # no response byte yet: sent again, not cut
        rep = await engine.switch_to(dep("b"))
        assert rep.result == "ok" and rep.cut == 1
        assert ("cut", True) in route(engine).calls  # the switch asks for the re-send
        assert any("3 requests still in flight" in n and "1 cut" in n
                   and "2 without a response byte sent again" in n for n in rep.notes)
        await engine.shutdown("test")

    asyncio.run(go())


def test_cancel_mid_switch_leaves_nothing_running(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        BEHAVIOUR["slow"] = "hang"
        task = asyncio.create_task(engine.switch_to(dep("slow", load=30)))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await engine.shutdown("SIGTERM")
        assert all(p.state is State.STOPPED for s in STARTED for p in s.procs)

    asyncio.run(go())


def test_requests_held_while_the_head_is_not_ready(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        sup = lane_of(engine).sup
        assert isinstance(sup, FakeSupervisor)
        assert route(engine).held is None
        sup.head.to(State.BACKOFF, "exit 134 (SIGABRT); restart in 1s")
        assert "backoff" in (route(engine).held or "")
        sup.head.to(State.STARTING, "spawning")
        assert "loading model" in (route(engine).held or "")
        sup.head.to(State.READY, "health check passed")
        assert route(engine).held is None
        await engine.shutdown("test")

    asyncio.run(go())


def test_health_answers_503_at_once_while_the_head_loads(engine: Port) -> None:
    """A health checker is not held through a load: 503 "Loading model" as llama-server answers
    while it loads; every other request is still held; once READY /health goes to the head."""
    async def go() -> None:
        await started(engine, dep("a"))
        sup = lane_of(engine).sup
        assert isinstance(sup, FakeSupervisor)
        assert engine.select(None, "GET", "/health") is lane_of(engine).route
        sup.head.to(State.STARTING, "spawning")
        health = engine.select(None, "GET", "/health")
        assert isinstance(health, LocalReply) and health.status == 503
        assert health.body == {"error": {"code": 503, "message": "Loading model",
                                         "type": "unavailable_error"}}
        assert engine.select(None, "POST", "/v1/chat/completions") is lane_of(engine).route
        sup.head.to(State.READY, "health check passed")
        assert engine.select(None, "GET", "/health") is lane_of(engine).route
        await engine.shutdown("test")

    asyncio.run(go())


def test_restart_names_the_engines_it_knows(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a", peers=1))
        lane = lane_of(engine)
        with pytest.raises(Exception, match="engines: peer-0, head"):
            await lane.restart("nope")
        res = await lane.restart("peer-0")
        assert res["engine"] == "peer-0"
        assert lane.sup is not None and lane.sup.restarted == ["peer-0"]  # type: ignore
        await engine.shutdown("test")

    asyncio.run(go())
