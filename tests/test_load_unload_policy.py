"""`hydra load`, `hydra unload` and `hydra switch` among several profiles, with fake supervisors
(serve/: Port, Lane, Node; runtime/daemon_actions.py Actions): a switch stops only what does
not fit beside its target (least recently used first) and says why; a load goes beside what
serves; an unload drains, stops, and leaves the profile routable; idle counts from the last
request in flight (an injected clock); every action reply's `message` (golden); /v1/models of a
port with no lane; a stopped hydra's lanes say stopped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc.managed import State
from hydra_supervisor.router.gate import Gate
from hydra_supervisor.router.routes import LocalReply, Route
from hydra_supervisor.runtime.daemon import Daemon, Options
from hydra_supervisor.runtime.messages import message
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy
from hydra_supervisor.serve.snapshot import DaemonInfo, Snapshot
from hydra_supervisor.serve.states import LaneState
from hydra_supervisor.serve.table import RouteTable
from tests.lane_fakes import (
    BEHAVIOUR,
    STARTED,
    FakeClock,
    fdep,
    make,
    prof,
    route,
    run,
    until,
)


def _daemon(f: Port) -> Daemon:
    d = Daemon(f.state, Options(profile=None, profiles=list(f.lanes)), [f], f.node)
    f.listeners.remove(d._changed)  # (no status.json writes from the test's port)
    return d


def _three(tmp_path: Path, **kw: Any) -> Port:
    """a and b (8 GiB each) fit together on cuda0 (24 GiB); c (12 GiB) fits beside one of
    them only; d is on cuda1."""
    return make(tmp_path, (prof("a", min_resident=60.0), fdep("a", 30200, gpu0=8)),
                (prof("b", min_resident=60.0), fdep("b", 30201, gpu0=8)),
                (prof("c"), fdep("c", 30202, gpu0=12)),
                (prof("d"), fdep("d", 30203, gpu1=4)), **kw)


def test_switch_stops_only_what_does_not_fit_and_says_why(tmp_path: Path) -> None:
    f = _three(tmp_path)

    async def body() -> None:
        a, b, c, d = (f.lanes[n] for n in "abcd")
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        assert a.phase is LaneState.SERVING  # they fit side by side
        f.lanes["b"].route.touch()  # b used last: a is the least recently used
        rep = await _daemon(f).actions.switch("c")
        assert rep["result"] == "ok" and rep["from"] == "a", rep
        # min_resident (60 s) does not hold back an operator's switch; b fits beside c
        assert a.phase is LaneState.STOPPED and b.phase is LaneState.SERVING
        assert c.phase is LaneState.SERVING
        assert rep["stopped"] == [{"profile": "a", "cut": 0, "why":
                                   "it did not fit beside c (c needs 12,288 MiB of cuda0, "
                                   "8,192 MiB free)"}]
        assert rep["message"].startswith("c is serving (loaded in ")
        assert rep["message"].endswith(" Stopped a: it did not fit beside c (c needs "
                                       "12,288 MiB of cuda0, 8,192 MiB free).")
        assert "hydra switch c: it did not fit beside c" in a.why
        # a profile on another device: nothing stops
        rep = await _daemon(f).actions.switch("d")
        assert rep["result"] == "ok" and rep["from"] is None and rep["stopped"] == []
        assert "nothing else was stopped" in rep["message"]
        assert b.phase is LaneState.SERVING and c.phase is LaneState.SERVING
        rep = await _daemon(f).actions.switch("d")
        assert rep["result"] == "noop" and rep["message"] == (
            "Nothing to do: d is already serving (`hydra reload` applies an edited profile, "
            "`hydra restart` restarts).")

    run(f, body)


def test_switch_refuses_while_what_is_in_the_way_is_busy(tmp_path: Path) -> None:
    f = _three(tmp_path)

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        async with a.lock, b.lock:  # a reload or `hydra restart` of each runs
            with pytest.raises(Busy, match="no room for c now"):
                await f.node.activate(f.lanes["c"])
        assert a.phase is LaneState.SERVING

    run(f, body)


def test_load_goes_beside_and_evicts_only_what_does_not_fit(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=8)),
             (prof("b", min_resident=0.0), fdep("b", 30201, gpu0=8)),
             (prof("c", on_demand=False), fdep("c", 30202, gpu0=12)))

    async def body() -> None:
        a, b, c = (f.lanes[n] for n in "abc")
        acts = _daemon(f).actions
        rep = await acts.load("b")
        assert rep["result"] == "ok" and rep["stopped"] == [], rep
        assert a.phase is LaneState.SERVING and b.phase is LaneState.SERVING
        assert "it fits beside what serves: nothing else was stopped" in rep["message"]
        b.route.touch()  # a is the least recently used ...
        # ... but a request of a is in flight now: it counts as in use, so b (idle) makes
        # room for c (on_demand: false: only load or switch loads it)
        flight = a.route.gate.begin()
        rep = await acts.load("c")
        assert rep["result"] == "ok" and [x["profile"] for x in rep["stopped"]] == ["b"], rep
        assert c.phase is LaneState.SERVING and a.phase is LaneState.SERVING
        assert b.phase is LaneState.STOPPED and flight.cut is None
        a.route.gate.end(flight)
        assert "Stopped b: it did not fit beside c (c needs 12,288 MiB of cuda0, 8,192 MiB " \
               "free)." in rep["message"]
        rep = await acts.load("c")
        assert rep["result"] == "noop" and rep["message"] == "Nothing to do: c is already serving."
        with pytest.raises(HydraError, match=r"no profile 'zz' in this hydra \(its profiles: "
                                             r"a, b, c\)"):
            await acts.load("zz")

    run(f, body)


def test_unload_stops_and_the_next_request_loads_it_again(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)),
             (prof("c", on_demand=False), fdep("c", 30202, gpu1=4)))

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        acts = _daemon(f).actions
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        rep = await acts.unload("a")
        assert rep["result"] == "ok" and rep["unloaded"] == ["a"], rep
        assert a.phase is LaneState.STOPPED and b.phase is LaneState.SERVING
        assert a.why == "hydra unload" and a.unloads == 1
        assert rep["message"].startswith("Unloaded a in ")
        assert rep["message"].endswith("; the next request for it loads it again.")
        # not loaded: nothing to do, said
        rep = await acts.unload("a")
        assert rep["result"] == "noop"
        assert rep["message"] == "Nothing to do for a: it is not loaded (stopped: hydra unload)."
        route(f, "a")  # routable: a request loads it again
        await until(lambda: a.phase is LaneState.SERVING)
        assert a.loads == 2
        with pytest.raises(HydraError, match=r"no profile 'x' in this hydra \(its profiles: "
                                             r"a, b, c\)") as exc:
            await acts.unload("x")
        assert exc.value.hint is not None and "hydra status" in exc.value.hint
        # every loaded one; in flight requests are cut after the drain (as a switch)
        flight = b.route.gate.begin()
        rep = await acts.unload(None)
        assert sorted(rep["unloaded"]) == ["a", "b"] and rep["cut"] == 1, rep
        assert flight.cut is not None and "hydra unload" in flight.cut
        b.route.gate.end(flight)
        assert rep["not_loaded"] == {"c": "stopped: not loaded yet"}
        rep = await acts.unload(None)
        assert rep["result"] == "noop" and "Nothing to do for a" in rep["message"]

    run(f, body)


def test_unload_of_a_loading_profile_waits_for_the_load_then_stops_it(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        b = f.lanes["b"]
        BEHAVIOUR["b"] = "hang"  # STARTING until the test lets it be READY
        route(f, "b")
        await until(lambda: b.phase is LaneState.LOADING and b.sup is not None)
        task = asyncio.ensure_future(_daemon(f).actions.unload("b"))
        await asyncio.sleep(0.3)
        assert not task.done() and b.phase is LaneState.LOADING
        sup = STARTED[-1]
        assert sup.plan.profile == "b"
        for p in sup.fake_procs:
            p.to(State.READY, "ok")
        sup.first_ready.set()
        rep = await asyncio.wait_for(task, 5)
        assert rep["result"] == "ok" and b.phase is LaneState.STOPPED, rep
        assert "b was loading; it was stopped once that was over" in rep["message"]

    run(f, body)


def test_idle_counts_from_the_last_request_in_flight() -> None:
    clock = FakeClock()
    r = Route("a", Gate(), clock=clock)
    r.touch()
    clock.advance(5)
    assert r.idle_for() == 5 and r.stats()["idle_s"] == 5
    r.started()
    flight = r.gate.begin()  # a stream decodes for 20 s: not idle meanwhile
    clock.advance(20)
    assert r.idle_for() == 0 and r.stats()["idle_s"] == 0 and r.last_active() == clock()
    r.gate.end(flight)
    r.touch()  # (the router's, when the request ends)
    clock.advance(3)
    assert r.idle_for() == 3


def test_ttl_counts_from_the_last_request_in_flight_on_the_policy_clock(tmp_path: Path) -> None:
    clock = FakeClock()
    f = make(tmp_path, (prof("a", ttl=10.0), fdep("a", 30200, gpu0=4)), clock=clock)

    async def body() -> None:
        a = f.lanes["a"]
        flight = a.route.gate.begin()
        clock.advance(30)  # a long request: ttl long past since it arrived
        t0 = f.ticks
        await until(lambda: f.ticks >= t0 + 2)
        assert a.phase is LaneState.SERVING
        a.route.gate.end(flight)
        a.route.touch()
        clock.advance(9)
        t0 = f.ticks
        await until(lambda: f.ticks >= t0 + 2)
        assert a.phase is LaneState.SERVING  # 9 s since it last had something in flight
        clock.advance(2)
        await until(lambda: a.phase is LaneState.STOPPED)
        assert a.why == "idle 11s (ttl 10s)"

    run(f, body)


def test_models_of_a_port_with_no_lane_is_an_empty_list() -> None:
    none = Route("none", Gate())
    table = RouteTable(none=none)
    models = table.select(None, "GET", "/v1/models")
    assert isinstance(models, LocalReply) and models.status == 200
    assert models.body == {"object": "list", "data": []}
    assert table.select(None, "GET", "/props") is none  # the rest: 503 naming hydra switch
    assert table.select("x", "POST", "/v1/chat/completions") is none


@pytest.mark.parametrize("names", [("a",), ("a", "b")])
def test_status_says_stopped_once_hydra_stopped(tmp_path: Path, names: tuple[str, ...]) -> None:
    f = make(tmp_path, *((prof(n), fdep(n, 30200 + i, gpu0=4)) for i, n in enumerate(names)))

    async def go() -> None:
        await f.start(["a"])
        await asyncio.wait_for(f.started.wait(), 5)
        await until(lambda: f.lanes["a"].phase is LaneState.SERVING)
        await f.shutdown("SIGTERM")
        f.close()
        row = f.status({}).lanes[0]
        assert row.state == "stopped" and row.why == "SIGTERM"  # not "recovering"
        snap = Snapshot(daemon=DaemonInfo(pid=1, started=0.0, state_dir="/s",
                                          stopped="SIGTERM"), ports=(f.status({}),))
        summary = snap.summary()  # status.json: "stopped" beside stopped:, not recovering/idle
        assert summary["state"] == "stopped" and summary["stopped"] == "SIGTERM"

    asyncio.run(go())


# -- messages (golden) ------------------------------------------------------------------------

GOLDEN: list[tuple[str, dict[str, Any], str]] = [
    ("switch", {"result": "ok", "to": "demo", "from": "demo-moe", "total_s": 3.21, "cut": 0,
                "stopped": [{"profile": "demo-moe", "cut": 2, "why":
                             "it did not fit beside demo (demo needs 812 MiB of host memory, "
                             "300 MiB free)"}]},
     "demo is serving (loaded in 3.2 s). Stopped demo-moe: it did not fit beside demo (demo "
     "needs 812 MiB of host memory, 300 MiB free) (2 requests were cut after the drain)."),
    ("switch", {"result": "ok", "to": "b", "from": "a", "total_s": 0.5, "cut": 1,
                "stopped": []},
     "Switched a -> b in 0.50 s: b is serving. 1 request was cut after the drain."),
    ("switch", {"result": "ok", "to": "b", "from": "a", "total_s": 0.01, "instant": True},
     "b is serving: the port flipped from a to its loaded standby layout in 0.01 s; nothing "
     "restarted, a stands by."),
    ("switch", {"result": "rolled_back", "to": "b", "from": "a", "failed_phase": "start",
                "error": "b.head: exit 1"},
     "The switch to b failed in phase start: b.head: exit 1. Rolled back: a serves again."),
    ("switch", {"result": "noop", "to": "a", "reason": "a is already serving"},
     "Nothing to do: a is already serving."),
    ("load", {"result": "failed", "to": "b", "error": "b.head: exit 1", "stopped": []},
     "b failed to load: b.head: exit 1."),
    ("load", {"result": "ok", "to": "b", "total_s": 42.4, "stopped": []},
     "b is serving (loaded in 42 s); it fits beside what serves: nothing else was stopped."),
    ("unload", {"result": "ok", "total_s": 0.2, "on_demand": {"a": False},
                "stopped": [{"profile": "a", "why": "hydra unload", "cut": 0},
                            {"profile": "a-solo", "cut": 0,
                             "why": "the standby of a goes with it"}]},
     "Unloaded a in 0.20 s; it stays stopped until `hydra load a` or `hydra switch a` "
     "(on_demand: false). Unloaded a-solo (the standby of a goes with it)."),
    ("unload", {"result": "noop", "stopped": [], "not_loaded": {}},
     "Nothing to do: no profile is loaded."),
    ("restart", {"result": "ok", "engine": "demo.peer-cpu", "profile": "demo", "seconds": 4.04,
                 "restarted": ["demo.peer-cpu", "demo.head"]},
     "Restarted demo.peer-cpu and its head demo.head (a peer serves one head: the head "
     "restarts with it) of demo; it serves again after 4.0 s."),
    ("restart", {"result": "ok", "engine": "demo.head", "profile": "demo", "seconds": 2.5,
                 "restarted": ["demo.head"], "notes": ["keep_slots: restored slot 0"]},
     "Restarted demo.head of demo; it serves again after 2.5 s. keep_slots: restored slot 0."),
    ("reload", {"result": "ok", "reloaded": {"a": "restarted a.head in 2.31s",
                                             "b": "rolled back: b.head: exit 1"}, "cut": 0,
                "not_applied": ["port: the file says 9; hydra keeps serving on 8"],
                "notes": ["not applied: port: the file says 9; hydra keeps serving on 8"]},
     "Reloaded a: restarted a.head in 2.31s. Reload of b rolled back: b.head: exit 1. Not "
     "applied: port: the file says 9; hydra keeps serving on 8."),
    ("reload", {"result": "noop", "reason": "profiles unchanged", "reloaded": {}},
     "Nothing to do: profiles unchanged."),
    ("switch", {"error": "profile b is loading; try again when it is done"},
     "profile b is loading; try again when it is done."),
]


@pytest.mark.parametrize("action,reply,said", GOLDEN)
def test_messages(action: Any, reply: dict[str, Any], said: str) -> None:
    assert message(action, reply) == said

