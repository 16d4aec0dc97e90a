"""Every change is a switch (issue 20), fast: a port's lane and the real Supervisor on fake
children (tests/fake_children.py), a port of several lanes on fake supervisors, the router's
gate and HTTP leg on sockets. (Issue 18: the Engine is a Port with one lane, the Fleet a Port
routed by model; serve/.)

- a head-only change (reload, CONFIGURE), a switch and `hydra restart` fail fast on the first
  failed start (no backoff, no retry) and roll back; the supervisor never gives up over it, and
  the reply names llama.cpp's own error line;
- reloads asked for while one runs are coalesced into one run after it (the last edit wins);
- a profile whose load failed does not evict a healthy one to try again (and backs off);
- a planned change whose drain runs out re-sends the requests that had no response byte;
- a `router: false` target is refused before anything stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc import process
from hydra_supervisor.proc.llamaerr import error_line
from hydra_supervisor.proc.managed import State
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.proc.supervisor import Supervisor
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.runtime import daemon_actions
from hydra_supervisor.runtime.daemon import Daemon, Options
from hydra_supervisor.serve import lane as lane_mod
from hydra_supervisor.serve.lane import Lane
from hydra_supervisor.serve.node import Node
from hydra_supervisor.serve.port import Port
from hydra_supervisor.serve.reports import SwitchReport, SwitchTimeouts
from hydra_supervisor.serve.states import LaneState
from hydra_supervisor.testing.routerhelp import one_route, read_request, wait_until
from tests.fake_children import Behaviour, FakeWorld, deployment
from tests.lane_fakes import (
    BEHAVIOUR,
    FakeClock,
    FakeRoute,
    FakeRouter,
    fdep,
    make,
    prof,
    route,
    run,
    until,
)
from tests.lane_fakes import dep as edep

pytestmark = pytest.mark.timeout(60)

BAD_ARG = 'error while handling argument "--cache-type-k": Unsupported cache type: bogus'


async def _engine(tmp: Path, w: FakeWorld, bad_logs: dict[str, list[int]], first: Deployment
                  ) -> Port:
    """A port with one lane (`first`, started) whose supervisors are real, on fake children;
    spawn number n of process NAME in bad_logs[NAME] writes llama.cpp's bad-argument line (and
    usage text) to its log."""
    counts: dict[str, int] = {}

    async def spawn(argv: Sequence[str], env: Mapping[str, str], log: Path, *,
                    outlive_client: bool = False) -> process.Child:
        name = Path(log).stem.split(".", 1)[-1]  # the role: a lane names it PROFILE.ROLE
        counts[name] = counts.get(name, 0) + 1
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        text = "build: 1 (abc)\n"
        if counts[name] in bad_logs.get(name, []):
            text = f"{BAD_ARG}\n\nusage:\n  -h, --help   print usage and exit\n\n" \
                "to show complete usage, run with -h\n"
        Path(log).write_text(text)
        return await w.spawn(argv, env, log, outlive_client=outlive_client)

    seams = dataclasses.replace(w.seams(), spawn=spawn)
    eng = Port(StateDir(tmp / "state"), "127.0.0.1", 8080, node=Node({}),
               make_supervisor=lambda d, st: Supervisor(d, st, seams=seams),
               make_router=FakeRouter,  # type: ignore[arg-type]
               switch_timeouts=SwitchTimeouts(drain=0.1, gpu_free=0.1), exit_on_fatal=True)
    eng.plan_lane(None, first)
    eng.open()
    await eng.start()
    lane = _lane(eng)
    await until(lambda: lane.phase in (LaneState.SERVING, LaneState.FAILED), timeout=20)
    return eng


def _lane(eng: Port) -> Lane:
    lane = eng.only()
    assert lane is not None
    return lane


def _with_head_flag(dep: Deployment, *flag: str) -> Deployment:
    """`dep` whose head gets more arguments: plandiff says HEAD (peers keep running)."""
    engines = tuple(replace(e, args=(*e.args, *flag)) if e.name == "head" else e
                    for e in dep.plan.engines)
    return replace(dep, plan=replace(dep.plan, engines=engines))


def test_head_only_change_fails_fast_rolls_back_and_the_supervisor_keeps_serving(
        tmp_path: Path) -> None:
    async def body() -> None:
        w = FakeWorld()
        ok, bad = Behaviour(load=0.5), Behaviour(load=0.2, exit_at_load=1)
        w.behaviours["head"] = [ok, bad, ok]
        old = deployment(1)
        eng = await _engine(tmp_path, w, {"head": [2]}, old)
        lane = _lane(eng)
        sup = lane.sup
        assert sup is not None
        await asyncio.wait_for(sup.first_ready.wait(), 10)
        await w.wait_for(lambda: all(p.state is State.READY for p in sup.procs))
        peer_pid = sup.procs[0].pid
        t0 = time.monotonic()
        rep = await lane.apply(_with_head_flag(old, "--cache-type-k", "bogus"))
        took = time.monotonic() - t0
        assert rep.result == "rolled_back", rep
        assert rep.failed_phase == "restart_head"
        assert BAD_ARG in (rep.error or ""), rep.error  # llama.cpp's own line, not the usage
        assert "exited during start-up (exit 1)" in (rep.error or "")
        # one failed start, no backoff: the bad head ran once, the old one came back at once
        assert w.spawned("head") == ["t.head"] * 3
        assert took * w.scale < 5.0, f"{took * w.scale:.1f} policy seconds"
        assert lane.sup is sup and sup.fatal is None and not sup.stopping.is_set()
        assert lane.dep == lane.own(old) and "bogus" not in sup.head.spec.args  # type: ignore[union-attr]
        assert all(p.state is State.READY for p in sup.procs)
        assert sup.procs[0].pid == peer_pid  # the peer was never touched
        assert lane.state_now().value == "serving"
        route = lane.route  # the lane's gate (the old FakeRouter's own)
        assert isinstance(route, FakeRoute) and route.held is None
        # the supervisor still restarts a crash as usual (not fail-fast any more)
        w.behaviours["head"] = [ok]
        live = w.live("head")
        assert live is not None
        live.kill(1)
        await w.wait_for(lambda: len(w.spawned("head")) == 4
                         and sup.head is not None and sup.head.state is State.READY)
        await eng.shutdown("test")

    asyncio.run(asyncio.wait_for(body(), 50))


def test_a_switch_fails_fast_without_a_retry(tmp_path: Path) -> None:
    async def body() -> None:
        w = FakeWorld()
        w.behaviours["head"] = [Behaviour(load=0.3), Behaviour(load=0.2, exit_at_load=1),
                                Behaviour(load=0.3)]
        old = deployment(0)
        eng = await _engine(tmp_path, w, {"head": [2]}, old)
        lane = _lane(eng)
        assert lane.sup is not None
        await asyncio.wait_for(lane.sup.first_ready.wait(), 10)
        new = replace(_with_head_flag(old, "-ctk", "bogus"),
                      plan=replace(_with_head_flag(old, "-ctk", "bogus").plan, profile="new"))
        rep = await eng.switch_in(new)
        assert rep.result == "rolled_back" and rep.failed_phase == "start", rep
        assert BAD_ARG in (rep.error or "")
        assert (rep.error or "").count("head:") == 1  # named once
        # old, new once (no retry), old again
        assert w.spawned("head") == ["t.head", "new.head", "t.head"]
        assert lane.dep == lane.own(old) and lane.state_now().value == "serving"
        await eng.shutdown("test")

    asyncio.run(asyncio.wait_for(body(), 50))


def test_hydra_restart_fails_fast_and_starts_the_layout_again(tmp_path: Path) -> None:
    async def body() -> None:
        w = FakeWorld()
        ok = Behaviour(load=0.3)
        w.behaviours["head"] = [ok, Behaviour(load=0.2, exit_at_load=1), ok]
        eng = await _engine(tmp_path, w, {"head": [2]}, deployment(0))
        lane = _lane(eng)
        assert lane.sup is not None
        await asyncio.wait_for(lane.sup.first_ready.wait(), 10)
        with pytest.raises(HydraError) as info:
            await lane.restart("head")
        msg = str(info.value)
        assert "restart of t.head failed" in msg and BAD_ARG in msg, msg
        assert "started again and serves" in msg
        assert w.spawned("head") == ["t.head"] * 3
        assert lane.state_now().value == "serving" and lane.sup is not None \
            and not lane.sup.fatal
        await eng.shutdown("test")

    asyncio.run(asyncio.wait_for(body(), 50))


def test_router_false_target_is_refused_before_anything_stops(tmp_path: Path) -> None:
    async def body() -> None:
        w = FakeWorld()
        eng = await _engine(tmp_path, w, {}, deployment(0))
        lane = _lane(eng)
        sup = lane.sup
        assert sup is not None
        await asyncio.wait_for(sup.first_ready.wait(), 10)
        target = replace(deployment(0), plan=replace(deployment(0, router=False).plan,
                                                     profile="own-port"))
        for call in (eng.switch_in, lane.apply):
            with pytest.raises(HydraError, match="router: false"):
                # the daemon asks this before a switch and a reload
                daemon_actions.check_servable(eng, target)
                await call(target)
        assert lane.sup is sup and not sup.stopping.is_set() and w.spawned("head") == ["t.head"]
        assert not lane.switches  # nothing ran, nothing to report
        await eng.shutdown("test")

    asyncio.run(asyncio.wait_for(body(), 50))


def test_llama_error_line_prefers_the_cause() -> None:
    log = ["0.00.007 I srv  main: loading model",
           "0.01.356.078 E llama_init_from_model: quantized V cache requires flash_attn "
           "to be enabled",
           "0.02.740.081 E cmn  common_init_: failed to create context with model 'm.gguf'",
           "0.02.741.985 E srv  llama_server: exiting due to model loading error"]
    assert error_line(log) == ("llama_init_from_model: quantized V cache requires flash_attn "
                               "to be enabled")
    assert error_line([BAD_ARG, "", "usage:", "-c, --ctx-size N  (error if ...)"]) == BAD_ARG
    assert error_line(["all good"]) is None


# -- reloads during a reload ------------------------------------------------------------------


def _daemon(tmp: Path, first: Deployment | None) -> tuple[Daemon, Port]:
    """A Daemon over one port (no router: nothing binds), with a lane for `first` (not
    started) or none."""
    node = Node({})
    port = Port(StateDir(tmp / "state"), "127.0.0.1", 8080, node=node, use_router=False)
    if first is not None:
        port.plan_lane(None, first)
    port.open()
    return Daemon(StateDir(tmp / "state"), Options(profile=None), [port], node), port


def test_reloads_during_a_reload_are_coalesced_and_the_last_edit_wins(tmp_path: Path) -> None:
    async def body() -> None:
        d, _ = _daemon(tmp_path, None)  # hydra up --no-profile: a port with no lane
        edits = ["v1"]  # the profile file; each run reads it when it starts
        runs: list[str] = []

        done = asyncio.Event()  # a run ends when the test says so, not after a time

        async def once() -> dict[str, Any]:
            seen = edits[-1]
            runs.append(seen)
            await done.wait()
            return {"result": "ok", "applied": seen}

        d.actions.reload_once = once
        first = asyncio.ensure_future(d.reload())
        await until(lambda: runs == ["v1"])  # the first run has read the files
        edits.append("v2")
        second = asyncio.ensure_future(d.reload())  # SIGHUP 1 during the reload
        await until(lambda: d.actions.reloads._next is not None)  # queued behind the first
        edits.append("v3")
        third = asyncio.ensure_future(d.reload())  # SIGHUP 2 while it waits: same run
        for _ in range(3):  # (no clock in this: each step lets the new task run its ask)
            await asyncio.sleep(0)
        assert runs == ["v1"]  # nothing more ran yet: the second run waits for the first
        done.set()
        r1, r2, r3 = await asyncio.gather(first, second, third)
        assert r1["applied"] == "v1"
        assert r2["applied"] == r3["applied"] == "v3"  # one run after the first: last edit
        assert runs == ["v1", "v3"]
        # once it has read the files, a later request is a run of its own
        edits.append("v4")
        assert (await d.reload())["applied"] == "v4" and runs[-1] == "v4"

    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_failed_change_is_said_on_the_status_line_until_one_works(tmp_path: Path) -> None:
    async def body() -> None:
        d, port = _daemon(tmp_path, edep("p"))  # the lane's reports are what it reads
        lane = _lane(port)
        outcome: list[Any] = []

        async def once() -> dict[str, Any]:
            what = outcome.pop(0)
            if isinstance(what, Exception):
                raise what
            lane.switches.append(what)  # what the lane records for a change
            return what.to_json()

        d.actions.reload_once = once
        outcome.append(SwitchReport(to="p", frm="p", result="rolled_back",
                                    error=f"head: exited (exit 1): {BAD_ARG}"))
        await d.reload()
        assert f"last change failed: p: head: exited (exit 1): {BAD_ARG}" in \
            d._status_line(d.take())
        outcome.append(HydraError("p.yaml:3: unknown key 'thraeds'"))
        with pytest.raises(HydraError):
            await d.reload()
        assert "last change failed: reload: p.yaml:3" in d._status_line(d.take())
        outcome.append(SwitchReport(to="p", frm="p", result="ok"))
        await d.reload()
        assert "failed" not in d._status_line(d.take())

    asyncio.run(asyncio.wait_for(body(), 20))


# -- several profiles: a failed one does not evict a healthy one --------------------------------


def test_a_failed_profile_does_not_evict_a_healthy_one_each_time_it_is_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane_mod, "FAIL_COOLDOWN", 0.2)
    clock = FakeClock()  # cooldowns pass when the test says so
    f = make(tmp_path, (prof("a", min_resident=0.0), fdep("a", 30200, gpu0=20)),
             (prof("b", min_resident=0.0), fdep("b", 30201, gpu0=20)), clock=clock)

    async def body() -> None:
        a, b = f.lanes["a"], f.lanes["b"]
        BEHAVIOUR["b"] = "crash"
        route(f, "b")  # its first try may evict a (it never failed before)
        await until(lambda: b.phase is LaneState.FAILED)
        assert b.fails == 1 and a.unloads == 1
        route(f, "a")
        await until(lambda: a.phase is LaneState.SERVING)
        # Asked for again after its cooldown: it does not stop a to try again.
        for n in (2, 3):
            clock.advance(b.cooldown + 0.05)
            route(f, "b")
            await until(lambda n=n: b.fails == n)  # type: ignore[misc]
            assert b.phase is LaneState.FAILED and a.phase is LaneState.SERVING
            assert a.unloads == 1
            refusal = b.route.gate.refusal_now()
            assert refusal is not None and "does not stop a" in refusal.message
        assert b.cooldown == pytest.approx(0.8)  # doubled after each failure in a row
        assert b.loads == 1  # only the first try started anything
        # `hydra switch b` may stop a (and rolls back when b fails again)
        rep = await f.node.activate(b)
        assert rep.result == "rolled_back" and a.phase is LaneState.SERVING
        # fixed: its next load may evict again, and a success resets the count
        BEHAVIOUR["b"] = "ok"
        rep = await f.node.activate(b)
        assert rep.result == "ok" and b.fails == 0

    run(f, body)


# -- a drain that runs out: requests without a response byte are sent again ---------------------


class _Upstream:
    """A tiny HTTP upstream: `answer` False reads the request and says nothing (a request
    queued in llama-server); True answers 200 at once."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.got = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        buf = b""
        while True:  # each request of a keep-alive connection (the router pools them)
            req = read_request(c, buf)
            if req is None:
                return
            buf = req[2]
            self.got += 1
            if not self.answer:
                break
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain"
                      b"\r\n\r\nok")
        try:  # not answering: until the router shuts it (the cut)
            c.recv(4096)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def _post(port: int, out: list[bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                  b"Connection: close\r\n\r\n{}")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        out.append(data)


def test_a_drain_that_runs_out_resends_requests_without_a_response_byte() -> None:
    old, new = _Upstream(answer=False), _Upstream(answer=True)
    r = Router("127.0.0.1", 0, Upstreams(), allow=("127.0.0.0/8",))
    lane = one_route(r, ("127.0.0.1", old.port))
    r.start()
    try:
        replies: list[bytes] = []
        clients = [threading.Thread(target=_post, args=(r.port, replies)) for _ in range(3)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 10
        while old.got < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert old.got == 3
        # the switch: hold, drain (runs out), cut with requeue, new upstream, release
        lane.hold("switching to profile new")
        assert lane.wait_idle(0.2) == 3
        assert lane.cut_inflight("cut by the switch to new after 0s of draining",
                              requeue=True) == 0  # none had a response byte: none cut
        wait_until(lambda: lane.gate.held() == 3, what="the 3 re-sent requests held")
        assert replies == []  # held, not answered 503
        lane.http = ("127.0.0.1", new.port)
        lane.release()
        for t in clients:
            t.join(20)
        assert len(replies) == 3 and all(x.startswith(b"HTTP/1.1 200") for x in replies), \
            replies
        assert new.got == 3
        st = r.stats()["http"]
        assert st["cut"] == 0 and st["retried"] >= 3
    finally:
        r.stop()
        old.close()
        new.close()


def test_a_cut_without_requeue_still_answers_503() -> None:
    old = _Upstream(answer=False)
    r = Router("127.0.0.1", 0, Upstreams(), allow=("127.0.0.0/8",))
    lane = one_route(r, ("127.0.0.1", old.port))
    r.start()
    try:
        replies: list[bytes] = []
        t = threading.Thread(target=_post, args=(r.port, replies))
        t.start()
        deadline = time.monotonic() + 10
        while old.got < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lane.cut_inflight("cut: profile a stopped") == 1
        t.join(20)
        assert replies and replies[0].startswith(b"HTTP/1.1 503"), replies
    finally:
        r.stop()
        old.close()


def test_a_failed_change_of_a_running_profile_is_not_marked_failed_while_it_rolls_back(
        tmp_path: Path) -> None:
    """A profile's new layout fails fast (its supervisor ends FATAL at once); the port must not
    take that for the serving lane going FATAL: the lane rolls back and it serves on."""
    from tests.lane_fakes import FleetFake

    class Breaks(FleetFake):
        async def run(self) -> None:
            if "--bad" in self.plan.head.args:
                self.head.to(State.FATAL, "exited during start-up (exit 1)")
                self.fatal = f"head: exited during start-up (exit 1): {BAD_ARG}"
                return
            await super().run()

    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)))
    f.make_supervisor = Breaks
    for m in f.lanes.values():
        m.make_supervisor = Breaks  # type: ignore[assignment]

    async def body() -> None:
        a = f.lanes["a"]
        assert a.phase is LaneState.SERVING
        bad = fdep("a", 30200, gpu0=4)
        assert bad.plan.router is not None
        bad = replace(bad, plan=replace(bad.plan, engines=tuple(  # plandiff: ALL (a switch)
            replace(e, args=(*e.args, "--bad")) for e in bad.plan.engines),
            router=replace(bad.plan.router, rpc=("127.0.0.1", 50999))))
        rep = await f.apply_to("a", bad)
        assert rep.result == "rolled_back" and BAD_ARG in (rep.error or ""), rep
        ticks = f.ticks
        await until(lambda: f.ticks >= ticks + 2)  # a tick would have marked it failed
        assert a.phase is LaneState.SERVING and a.error is None
        assert a.state_now().value == "serving"

    run(f, body)
