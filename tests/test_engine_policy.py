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

from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc.managed import State
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.router.routes import LocalReply
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy, SwitchTimeouts
from hydra_supervisor.serve.states import LaneState
from tests.lane_fakes import (
    BEHAVIOUR,
    STARTED,
    FakeRoute,
    FakeRouter,
    FakeSupervisor,
    dep,
    until,
)


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
                switch_timeouts=SwitchTimeouts(drain=0.1, gpu_free=0.1), exit_on_fatal=True)


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
    return lane.state_now().value if lane is not None else port.status({}).word()


async def started(port: Port, d: Deployment) -> None:
    """Opened with a lane for `d`, its start-up load begun."""
    await opened(port, d)
    lane = lane_of(port)
    await until(lambda: lane.sup is not None or lane.error is not None)
    sup = lane.sup
    assert sup is not None
    await asyncio.wait_for(sup.first_ready.wait(), 5)
    await until(lambda: lane.phase is not LaneState.LOADING)  # the load saw it READY


def test_model_less_start_names_the_profiles(engine: Port) -> None:
    async def go() -> None:
        await opened(engine, None)
        assert word(engine) == "idle"
        msg = engine._none.gate.unavailable_reason() or ""  # a port with no lane answers
        assert "hydra switch NAME" in msg and "a, b" in msg
        rep = await engine.switch_in(dep("a"))
        assert rep.result == "ok" and word(engine) == "serving"
        assert route(engine).unavailable is None and route(engine).held is None
        await engine.shutdown("test")

    asyncio.run(go())


def test_switch_phases_in_order_and_requests_released(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        lane = lane_of(engine)
        old = lane.sup
        rep = await engine.switch_in(dep("b", peers=1))
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
        rep = await engine.switch_in(dep("broken"))
        assert rep.result == "rolled_back"
        assert rep.failed_phase == "start" and "head" in (rep.error or "")
        assert rep.log_tail == ["broken.head log line"]
        assert lane.dep is not None and lane.dep.profile == "a"
        assert word(engine) == "serving"
        assert route(engine).held is None
        await engine.shutdown("test")

    asyncio.run(go())


def test_failed_rollback_leaves_an_idle_engine_that_says_so(engine: Port) -> None:
    async def go() -> None:
        BEHAVIOUR["broken"] = "crash"
        await opened(engine, None)
        rep = await engine.switch_in(dep("broken"))
        assert rep.result == "failed"
        assert word(engine) == "idle"  # the port has no lane again
        assert "hydra switch NAME" in (engine._none.gate.unavailable_reason() or "")
        await engine.shutdown("test")

    asyncio.run(go())


def test_a_layout_that_never_gets_ready_times_out_and_rolls_back(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        BEHAVIOUR["slow"] = "hang"
        rep = await engine.switch_in(dep("slow", load=0.2))
        assert rep.result == "rolled_back" and "not ready within" in (rep.error or "")
        await engine.shutdown("test")

    asyncio.run(go())


def test_second_switch_is_refused_while_one_runs(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        BEHAVIOUR["slow"] = "hang"
        first = asyncio.create_task(engine.switch_in(dep("slow", load=0.5)))
        await until(lambda: any(lane.lock.locked() for lane in engine.lanes.values()))
        with pytest.raises(Busy, match="already running"):
            await engine.switch_in(dep("b"))
        await first
        await engine.shutdown("test")

    asyncio.run(go())


def test_drain_timeout_cuts_and_counts(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        route(engine).inflight_left = 3
        route(engine).unanswered = 2  # no response byte yet: sent again, not cut
        rep = await engine.switch_in(dep("b"))
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
        task = asyncio.create_task(engine.switch_in(dep("slow", load=30)))
        await until(lambda: any(s.plan.profile == "slow" for s in STARTED))  # mid-switch
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
        with pytest.raises(Exception, match="engines: a.peer-0, a.head"):
            await lane.restart("nope")
        res = await lane.restart("peer-0")  # one report type: a SwitchReport
        # a peer restarts with its head (issue 29: the report says so)
        assert res.result == "ok" and res.restarted == ["a.peer-0", "a.head"]
        assert lane.sup is not None and lane.sup.restarted == ["a.peer-0"]  # type: ignore
        await engine.shutdown("test")

    asyncio.run(go())


def test_router_series_keep_their_port_labels_across_a_switch(engine: Port) -> None:
    """The router is the port's: its counters are on the port's status (`ports`), and its
    metric series are labelled engine="port-8080" alone, so a switch from profile a to b
    keeps the same series and their counts carry on (they moved to profile b before)."""
    from hydra_supervisor.runtime.metrics_state import SnapshotCollector
    from hydra_supervisor.serve.snapshot import DaemonInfo, Snapshot

    counts = {"accepted": 0}

    def take() -> Snapshot:
        return Snapshot(daemon=DaemonInfo(pid=1, started=0.0, state_dir="/s"),
                        ports=(engine.status({}),))

    def router_series(snap: Snapshot) -> dict[tuple[str, frozenset[Any]], float]:
        c = SnapshotCollector(lambda: snap)
        return {(s.name, frozenset(s.labels.items())): s.value for m in c.collect()
                for s in m.samples if s.name.startswith("hydra_router_")}

    async def go() -> None:
        await started(engine, dep("a"))
        router = engine.router
        assert isinstance(router, FakeRouter)
        plain = router.stats
        router.stats = lambda: {**plain(), **counts}  # type: ignore[method-assign]
        counts["accepted"] = 5
        before = take()
        rep = await engine.switch_in(dep("b"))
        assert rep.result == "ok", rep
        counts["accepted"] = 9
        after = take()
        await engine.shutdown("test")
        assert [x.profile for _, x in before.lanes()] == ["a"]
        assert [x.profile for _, x in after.lanes()] == ["b"]
        assert [p.name for p in after.ports] == ["port-8080"]
        router_after = after.ports[0].router
        assert router_after is not None and router_after.accepted == 9
        s0, s1 = router_series(before), router_series(after)
        assert s0.keys() == s1.keys()  # the same series, the same labels
        key = ("hydra_router_connections_accepted_total",
               frozenset({("engine", "port-8080")}))
        assert (s0[key], s1[key]) == (5, 9)
        # (the counters are typed now: bytes by direction are there at 0 from a fake router)
        assert all(dict(lv) == {"engine": "port-8080"} for name, lv in s1
                   if name not in ("hydra_router_fds", "hydra_router_bytes_total"))
        assert all(dict(lv).keys() == {"engine", "direction"} for name, lv in s1
                   if name == "hydra_router_bytes_total")

    asyncio.run(go())


def test_a_switch_to_what_serves_is_a_no_op_that_says_so(engine: Port) -> None:
    """One answer on every port (issue 28): nothing restarts; `hydra restart` restarts."""
    async def go() -> None:
        await started(engine, dep("a"))
        lane = lane_of(engine)
        sup = lane.sup
        rep = await engine.switch(lane)
        assert rep.result == "noop" and "already serving" in (rep.reason or "")
        assert lane.sup is sup and not STARTED[1:]  # nothing started again
        await engine.shutdown("test")

    asyncio.run(go())


def test_restart_holds_drains_restarts_then_releases(engine: Port) -> None:
    """`hydra restart` is planned as a switch is: new requests held first, those in flight
    drained (bounded by the switch drain), then the restart, then the release to the READY
    head; the lane says `switching` meanwhile."""
    async def go() -> None:
        await started(engine, dep("a", peers=1))
        lane = lane_of(engine)
        sup = lane.sup
        assert isinstance(sup, FakeSupervisor)
        r = route(engine)
        seen: dict[str, object] = {}

        async def restart(name: str, fail_fast: bool = False) -> None:
            r.calls.append(("restart", name))
            seen.update(held=r.held, state=lane.state_now().value, fail_fast=fail_fast)
            sup.head.to(State.STOPPING, "planned restart")  # the gate stays the change's
            seen["held_while_stopping"] = r.held
            sup.head.to(State.STARTING, "spawning")
            sup.head.to(State.READY, "health check passed")
        sup.restart = restart  # type: ignore[method-assign]
        r.calls.clear()
        rep = await lane.restart("head")
        assert rep.result == "ok" and rep.restarted == ["a.head"], rep
        assert list(rep.phases) == ["hold", "drain", "restart"], rep.phases
        calls = [c for c, _ in r.calls]
        assert calls.index("hold") < calls.index("drain") < calls.index("restart") \
            < calls.index("release"), r.calls
        assert ("drain", 0.1) in r.calls  # the switch's drain bound
        assert seen["held"] == "restarting a.head (hydra restart)"
        assert seen["held_while_stopping"] == "restarting a.head (hydra restart)"
        assert seen["state"] == "switching" and seen["fail_fast"] is True
        assert r.held is None and lane.state_now().value == "serving"
        assert rep.cut == 0 and rep.notes == []
        await engine.shutdown("test")

    asyncio.run(go())


def test_restart_whose_drain_runs_out_cuts_only_partial_answers(engine: Port) -> None:
    async def go() -> None:
        await started(engine, dep("a"))
        lane = lane_of(engine)
        r = route(engine)
        r.inflight_left, r.unanswered = 3, 2  # 2 without a response byte: sent again
        rep = await lane.restart("head")
        assert rep.result == "ok" and rep.cut == 1, rep
        assert ("cut", True) in r.calls
        assert any("3 requests still in flight" in n and "2 without a response byte sent "
                   "again to the restarted head" in n for n in rep.notes), rep.notes
        assert r.held is None
        await engine.shutdown("test")

    asyncio.run(go())
