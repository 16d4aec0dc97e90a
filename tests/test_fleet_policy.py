"""The policy of a port that routes by model (serve/: Port, Lane, Node) with fake supervisors
(fast, no processes): routing by model, on-demand load, room made by evicting the least
recently used profile after a drain (never cut), min_resident, ttl, failed loads,
`hydra switch` (the node's activate) with rollback.

The router is real (port 0) so the gates are real; requests are simulated by calling
`select` (what a router thread does) and by flights on a route's gate.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc.managed import State
from hydra_supervisor.router.routes import LocalReply
from hydra_supervisor.runtime.daemon import Daemon, Options
from hydra_supervisor.serve import lane as lane_mod
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import Busy
from hydra_supervisor.serve.states import LaneState
from tests.lane_fakes import (
    BEHAVIOUR,
    GIB,
    STARTED,
    FakeClock,
    fdep,
    make,
    prof,
    route,
    run,
    until,
)


async def ticks(f: Port, n: int = 2) -> None:
    """Until the port's policy pass (ttl, parked requests) has run `n` more times: a negative
    assertion after it holds because the policy looked, not because time went by."""
    t0 = f.ticks
    await until(lambda: f.ticks >= t0 + n)


def test_routing_by_name_alias_and_default(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", aliases=("alpha",)), fdep("a", 30200, gpu0=4)),
             (prof("b"), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        assert route(f, "a") is f.lanes["a"].route
        assert route(f, "alpha") is f.lanes["a"].route
        assert route(f, None) is f.lanes["a"].route  # no model: the default
        assert route(f, "b") is f.lanes["b"].route
        missing = f.select("gpt-4", "POST", "/v1/chat/completions")
        assert isinstance(missing, LocalReply) and missing.status == 404
        assert "known models: a, alpha, b" in missing.body["error"]["message"]
        models = f.select(None, "GET", "/v1/models")
        assert isinstance(models, LocalReply) and models.status == 200
        ids = {d["id"]: d for d in models.body["data"]}
        # (the fleet's "running" is "serving" now)
        assert ids["a"]["state"] == "serving" and ids["a"]["aliases"] == ["alpha"]
        assert ids["a"]["default"] is True and ids["a"]["devices"] == ["gpu0"]

    run(f, body)


def test_stopped_profile_loads_on_request_and_holds_it_meanwhile(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        b = f.lanes["b"]
        assert b.phase is LaneState.STOPPED
        assert "not loaded; loading it on request" in (b.route.gate.held_reason or "")
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        assert b.route.gate.held_reason is None and b.route.gate.refusal_now() is None
        assert b.loads == 1
        # a kept running: they fit side by side (different GPUs)
        assert f.lanes["a"].phase is LaneState.SERVING
        states = {d["id"]: d["state"] for d in f.models_json()["data"]}
        assert states == {"a": "serving", "b": "serving"}  # (was "running")

    run(f, body)


def test_on_demand_false_answers_503_naming_hydra_switch(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)),
             (prof("b", on_demand=False), fdep("b", 30201, gpu0=30)))

    async def body() -> None:
        b = f.lanes["b"]
        route(f, "b")
        await ticks(f)  # the policy looked at the parked request twice
        assert b.phase is LaneState.STOPPED and b.loads == 0
        refusal = b.route.gate.refusal_now()
        assert refusal is not None and refusal.status == 503
        assert "hydra switch b" in refusal.message

    run(f, body)


def test_eviction_of_the_lru_after_drain_then_min_resident_bounds_ping_pong(
        tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b", min_resident=0.6), fdep("b", 30201, gpu0=20)))

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        assert a.phase is LaneState.STOPPED and a.unloads == 1
        assert "making room for b" in a.why
        # a at once: b must stay min_resident (0.6 s) first; a waits, held, with the reason
        t0 = time.monotonic()
        route(f, "a")
        await until(lambda: "min_resident" in (a.route.gate.held_reason or ""))
        assert b.phase is LaneState.SERVING
        await until(lambda: a.phase is LaneState.SERVING)
        assert time.monotonic() - t0 >= 0.5
        assert b.phase is LaneState.STOPPED
        assert a.loads == 2 and b.loads == 1

    run(f, body)


def test_eviction_never_cuts_in_flight_requests(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b"), fdep("b", 30201, gpu0=20)), drain=0.1)

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        flight = a.route.gate.begin()  # a request a is answering
        route(f, "b")
        await until(lambda: a.drains_given_up >= 2)  # several drains of 0.1 s gave up
        assert a.phase in (LaneState.SERVING, LaneState.UNLOADING) and b.phase is LaneState.LOADING
        assert flight.cut is None
        a.route.gate.end(flight)
        await until(lambda: b.phase is LaneState.SERVING)
        assert a.phase is LaneState.STOPPED and flight.cut is None

    run(f, body)


def test_ttl_unloads_an_idle_profile_and_the_next_request_loads_it(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)),
             (prof("b", ttl=0.3), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        b = f.lanes["b"]
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        # stopped, and its unload job over (a request routed meanwhile is held at the gate
        # and loaded by the next policy pass; route() here sends no request to hold)
        await until(lambda: b.phase is LaneState.STOPPED and b.job is None)
        assert b.unloads == 1 and "ttl 0.3s" in b.why
        assert f.lanes["a"].phase is LaneState.SERVING  # no ttl: stays
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        assert b.loads == 2

    run(f, body)


def test_ttl_waits_for_in_flight_requests(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", ttl=0.2), fdep("a", 30200, gpu0=4)))

    async def body() -> None:
        a = f.lanes["a"]
        flight = a.route.gate.begin()
        await until(lambda: time.monotonic() - a.route.last_used > 2 * 0.2)  # ttl long past
        await ticks(f)  # ... and the policy looked
        assert a.phase is LaneState.SERVING
        a.route.gate.end(flight)
        a.route.touch()
        await until(lambda: a.phase is LaneState.STOPPED)

    run(f, body)


def test_failed_load_answers_held_requests_and_leaves_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane_mod, "FAIL_COOLDOWN", 0.3)
    clock = FakeClock()  # the cooldown runs on the policy's clock, moved below
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)),
             clock=clock)

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        BEHAVIOUR["b"] = "crash"
        route(f, "b")
        await until(lambda: b.phase is LaneState.FAILED)
        refusal = b.route.gate.refusal_now()
        assert refusal is not None and "profile b failed to load" in refusal.message
        assert "exit 1" in (b.error or "")
        assert a.phase is LaneState.SERVING and a.route.gate.refusal_now() is None
        route(f, "b")  # within the cooldown: no new attempt
        await ticks(f)
        assert b.phase is LaneState.FAILED and b.loads == 1
        clock.advance(0.31)  # the cooldown (0.3 s) is over
        BEHAVIOUR["b"] = "ok"
        route(f, "b")  # after it: tried again, and the request is held, not refused
        assert b.route.gate.refusal_now() is None
        await until(lambda: b.phase is LaneState.SERVING)
        assert b.loads == 2 and b.error is None

    run(f, body)


def test_never_fits_fails_with_the_sizes(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)),
             (prof("huge"), fdep("huge", 30201, gpu1=40)))

    async def body() -> None:
        h = f.lanes["huge"]
        route(f, "huge")
        await until(lambda: h.phase is LaneState.FAILED)
        assert "does not fit this node even alone" in (h.error or "")
        assert not [s for s in STARTED if s.plan.profile == "huge"]

    run(f, body)


def test_activate_stops_sharers_and_rolls_back_on_failure(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=20)),
             (prof("b"), fdep("b", 30201, gpu0=20)), (prof("c"), fdep("c", 30202, gpu1=4)))

    async def body() -> None:
        a, b, c = (f.lanes[n] for n in "abc")
        route(f, "c")
        await until(lambda: c.phase is LaneState.SERVING)
        rep = (await f.node.activate(b)).to_json()
        assert rep["result"] == "ok" and rep["from"] == "a"
        assert a.phase is LaneState.STOPPED and b.phase is LaneState.SERVING
        assert c.phase is LaneState.SERVING  # on another GPU: untouched
        assert (await f.node.activate(b)).to_json()["result"] == "noop"
        BEHAVIOUR["a"] = "crash"
        BEHAVIOUR["c"] = "crash"
        rep = (await f.node.activate(a)).to_json()
        assert rep["result"] == "rolled_back" and rep["failed_phase"] == "start"
        assert b.phase is LaneState.SERVING and a.phase is LaneState.FAILED
        # A name no lane has: the daemon's `hydra switch` plans it for the port's default lane
        # (as on any port); a name no profile file has is refused before anything stops.
        d = Daemon(f.state, Options(profile=None, profiles=["a", "b", "c"]), [f], f.node)
        f.listeners.remove(d._changed)
        with pytest.raises(HydraError, match="unknown profile 'zzz'"):
            await d.switch("zzz")

    run(f, body)


def test_activate_refused_while_a_load_runs(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        BEHAVIOUR["b"] = "slow"  # never READY: the load waits
        route(f, "b")
        await until(lambda: f.lanes["b"].job is not None)
        with pytest.raises(Busy):
            await f.node.activate(f.lanes["b"])
        models = {d["id"]: d for d in f.models_json()["data"]}
        assert models["b"]["state"] == "loading" and models["b"]["status"] == {"value": "loading"}
        assert models["a"]["status"] == {"value": "loaded"}

    run(f, body)


def test_requests_parked_while_a_profile_stopped_bring_it_back(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b", min_resident=0.0), fdep("b", 30201, gpu0=20)))

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        route(f, "b")
        await until(lambda: a.phase is LaneState.UNLOADING or b.phase is LaneState.SERVING)
        # a request for a parked in a's gate (it skipped select's trigger): the tick finds it
        result: list[Any] = []
        waiter = asyncio.get_running_loop().run_in_executor(
            None, lambda: result.append(a.route.gate.wait_turn()))
        await until(lambda: b.phase is LaneState.SERVING)
        await until(lambda: a.phase is LaneState.SERVING, timeout=5)
        await asyncio.wait_for(waiter, 5)
        assert result == [None]  # released to go upstream, not refused

    run(f, body)


def test_a_profile_going_fatal_at_runtime_is_marked_failed(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        a = f.lanes["a"]
        sup = a.sup
        assert sup is not None
        sup.fatal = "head: crashed 5 times"
        sup.head.to(State.FATAL, "crashed 5 times")
        await until(lambda: a.phase is LaneState.FAILED)
        assert a.error == "head: crashed 5 times"
        route(f, "b")
        await until(lambda: f.lanes["b"].phase is LaneState.SERVING)

    run(f, body)


def test_names_must_be_unique_and_default_served(tmp_path: Path) -> None:
    with pytest.raises(HydraError, match="claimed by profiles a and b"):
        make(tmp_path, (prof("a", aliases=("x",)), fdep("a", 30200, gpu0=4)),
             (prof("b", aliases=("x",)), fdep("b", 30201, gpu1=4)))
    with pytest.raises(HydraError, match="default profile 'z'"):
        make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), default="z")


def test_health_is_503_while_the_default_profile_has_failed(tmp_path: Path) -> None:
    """A load balancer's check must take the host out when its default profile failed (a
    stopped one is fine: the next request loads it)."""
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))
    BEHAVIOUR["a"] = "crash"

    async def body() -> None:
        a = f.lanes["a"]
        await until(lambda: a.phase is LaneState.FAILED)
        health = f.select(None, "GET", "/health")
        assert isinstance(health, LocalReply) and health.status == 503
        assert isinstance(health.body, dict)
        assert "the default profile a failed" in health.body["error"]["message"]
        assert health.body["profiles"] == {"a": "failed", "b": "stopped"}

    run(f, body)


def test_monitoring_gets_do_not_load_a_stopped_default(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b", min_resident=0.0), fdep("b", 30201, gpu0=20)))

    async def body() -> None:
        a = f.lanes["a"]
        assert route(f, None) is a.route  # loaded: GETs go to it
        assert f.select(None, "GET", "/health") is a.route
        route(f, "b")
        await until(lambda: f.lanes["b"].phase is LaneState.SERVING
                    and a.phase is LaneState.STOPPED)
        health = f.select(None, "GET", "/health")
        assert isinstance(health, LocalReply) and health.status == 200
        # (b's word was "running")
        assert health.body == {"status": "ok", "profiles": {"a": "stopped", "b": "serving"}}
        slots = f.select(None, "GET", "/slots")
        assert isinstance(slots, LocalReply) and slots.body == []
        props = f.select(None, "GET", "/props")
        assert isinstance(props, LocalReply) and props.status == 503
        assert "a request naming a model loads it" in props.body["error"]["message"]
        await ticks(f)
        assert a.phase is LaneState.STOPPED and a.loads == 1  # none of these loaded it
        models = f.select(None, "GET", "/v1/models")
        assert isinstance(models, LocalReply)
        status = {d["id"]: d["status"]["value"] for d in models.body["data"]}
        assert status == {"a": "unloaded", "b": "loaded"}
        # a POST without a model is a real request: it loads the default
        route(f, None)
        await until(lambda: a.phase is LaneState.SERVING)

    run(f, body)


def test_reload_restarts_only_what_changed_and_updates_knobs(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        sup = a.sup
        assert sup is not None
        # a's head gets a new flag (a head-only change) and a ttl: the head restarts in place
        new = fdep("a", 30200, gpu0=4)
        new = replace(new, plan=replace(new.plan, engines=tuple(
            replace(e, args=(*e.args, "--ctx-size", "8192")) for e in new.plan.engines)))
        assert f.differs(a, prof("a", ttl=60.0), new)
        did, _ = await f.replace(a, (prof("a", ttl=60.0), new))
        assert did.startswith("restarted a.head in ")
        assert a.sup is sup and sup.restarted == ["a.head"]
        assert a.ttl == 60.0 and "--ctx-size" in a.dep.plan.head.args
        assert a.phase is LaneState.SERVING
        # unchanged: nothing to do
        assert not f.differs(a, prof("a", ttl=60.0), new)
        # a stopped profile takes the new plan (and concurrency) at its next load
        b_new = fdep("b", 30201, gpu1=6)
        did, _ = await f.replace(b, (prof("b", concurrency=2, queue=1), b_new))
        assert did == "not loaded: the new settings apply at its next load"
        assert b.phase is LaneState.STOPPED and b.needs == {"cuda1": 6 * GIB}
        assert b.route.limiter is not None and b.route.limiter.limit == 2
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)

    run(f, body)


def test_ttl_and_eviction_leave_a_profile_alone_while_it_restarts(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", ttl=0.2, min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b"), fdep("b", 30201, gpu0=20)))

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        async with a.lock:  # what a reload or `hydra restart a.head` holds
            await until(lambda: time.monotonic() - a.route.last_used > 2 * 0.2)  # ttl past
            await ticks(f)  # ... and the policy looked
            assert a.phase is LaneState.SERVING
            route(f, "b")  # needs a's room: it waits instead of stopping a mid-restart
            await until(lambda: b.phase is LaneState.LOADING)
            await ticks(f)  # several passes of b's wait for room (TICK each)
            assert a.phase is LaneState.SERVING and b.phase is LaneState.LOADING
        await until(lambda: b.phase is LaneState.SERVING)
        assert a.phase is LaneState.STOPPED

    run(f, body)


def test_activate_drains_then_cuts_and_counts_what_it_cut(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=20)),
             (prof("b"), fdep("b", 30201, gpu0=20)), drain=0.1)

    async def body() -> None:
        flight = f.lanes["a"].route.gate.begin()  # a request a never finishes
        rep = (await f.node.activate(f.lanes["b"])).to_json()
        assert rep["result"] == "ok" and rep["from"] == "a"
        assert rep["cut"] == 1 and flight.cut is not None and "hydra switch b" in flight.cut
        f.lanes["a"].route.gate.end(flight)

    run(f, body)


def test_a_profile_restarting_after_a_crash_can_be_evicted_and_held_requests_wait(
        tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b"), fdep("b", 30201, gpu0=20)))

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        sup = a.sup
        assert sup is not None
        sup.head.to(State.BACKOFF, "exit 1; restart in 1.0s")  # crashed, backing off
        assert f.state_of(a) == "recovering"
        assert "head backoff" in (a.route.gate.held_reason or "")  # its requests wait
        route(f, "b")
        await until(lambda: b.phase is LaneState.SERVING)
        assert a.phase is LaneState.STOPPED and a.unloads == 1
        assert all(p.state is State.STOPPED for p in sup.procs)

    run(f, body)
