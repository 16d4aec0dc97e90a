"""A terminal that speaks: the lifecycle events the serving objects emit (serve/events.py) and
the lines `hydra up` prints for them after `ready:` (cli/up.py EventPrinter), on fake
supervisors (tests/lane_fakes.py); the real thing: test_up_events (slow, llama-server)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from hydra_supervisor.cli.up import EventPrinter, event_line
from hydra_supervisor.proc.managed import State
from hydra_supervisor.serve.events import SAID, Event, Kind
from hydra_supervisor.serve.states import LaneState
from hydra_supervisor.testing.harness import free_port, wait_until
from tests.lane_fakes import BEHAVIOUR, STARTED, fdep, make, prof, route, run, until

AT = dt.datetime(2026, 12, 4, 5, 30, 0).timestamp()  # local time: the line shows 05:30:00


def ev(kind: Kind, subject: str = "demo.head", detail: str = "", **kw: object) -> Event:
    return Event(kind, subject, detail, at=AT, **kw)  # type: ignore[arg-type]


GOLDEN = [
    (ev(Kind.DIED, detail="head killed by SIGKILL; restart 1 in 1.0s"),
     "05:30:00 demo.head died: head killed by SIGKILL; restart 1 in 1.0s"),
    (ev(Kind.STOPPED, detail="stopped: peer demo.peer-cpu1 lost"),
     "05:30:00 demo.head stopped: stopped: peer demo.peer-cpu1 lost"),
    (ev(Kind.UNHEALTHY, detail="/health silent, no CPU progress for 30s"),
     "05:30:00 demo.head unhealthy: /health silent, no CPU progress for 30s"),
    (ev(Kind.RESTARTED, seconds=4.21), "05:30:00 demo.head restarted, ready again after 4.2s"),
    (ev(Kind.RESTARTED, detail="hydra restart", seconds=3.0),
     "05:30:00 demo.head restarted (hydra restart), ready again after 3.0s"),
    (ev(Kind.HEALTHY, seconds=12.0), "05:30:00 demo.head healthy again after 12.0s"),
    (ev(Kind.LOADED, "demo-moe", "on request", seconds=3.14),
     "05:30:00 demo-moe loaded on demand in 3.1s"),
    (ev(Kind.LOADED, "demo-moe", "hydra switch", seconds=3.0),
     "05:30:00 demo-moe loaded (hydra switch) in 3.0s"),
    (ev(Kind.LOAD_FAILED, "demo-moe", "demo-moe.head: exited during start-up (exit 1):\n"
        "error: invalid argument: --bogus"),
     "05:30:00 demo-moe failed to load: demo-moe.head: exited during start-up (exit 1): "
     "error: invalid argument: --bogus"),
    (ev(Kind.UNLOADED, "demo", "making room for demo-moe"),
     "05:30:00 demo unloaded: making room for demo-moe"),
    (ev(Kind.SWITCHED, "demo-moe", seconds=5.2, frm="demo"),
     "05:30:00 switched demo -> demo-moe in 5.2s"),
    (ev(Kind.SWITCHED, "demo-local", "instant, nothing restarted", seconds=0.0, frm="demo"),
     "05:30:00 switched demo -> demo-local in 0.0s (instant, nothing restarted)"),
    (ev(Kind.SWITCHED, "demo", "restarted demo.head", seconds=2.5, frm="demo"),
     "05:30:00 demo changed in 2.5s (restarted demo.head)"),
    (ev(Kind.SWITCH_FAILED, "broken", "rolled back: demo.head not ready", seconds=1.5,
        frm="demo"),
     "05:30:00 switch demo -> broken failed after 1.5s: rolled back: demo.head not ready"),
    (ev(Kind.STANDBY_READY, "demo-local", "beside demo: `hydra switch demo-local` is instant"),
     "05:30:00 standby demo-local ready beside demo: `hydra switch demo-local` is instant"),
    (ev(Kind.STANDBY_FAILED, "demo-local", "not loaded: does not fit beside demo"),
     "05:30:00 standby demo-local not loaded: does not fit beside demo"),
    (ev(Kind.RELOADED, "reload", "demo: restarted demo.head in 2.10s"),
     "05:30:00 reload done: demo: restarted demo.head in 2.10s"),
    (ev(Kind.RELOAD_FAILED, "reload", "rolled back: demo.head exited"),
     "05:30:00 reload failed: rolled back: demo.head exited"),
    (ev(Kind.FATAL, "demo", "demo.head: exit 1; restart budget spent"),
     "05:30:00 demo FATAL: demo.head: exit 1; restart budget spent"),
]


@pytest.mark.parametrize(("event", "line"), GOLDEN, ids=[e.kind.value for e, _ in GOLDEN])
def test_one_short_line_per_event(event: Event, line: str) -> None:
    assert event_line(event) == line


def test_every_kind_has_a_golden_line() -> None:
    assert {e.kind for e, _ in GOLDEN} == set(Kind)


def _printer(quiet: bool = False) -> tuple[EventPrinter, list[str], list[str]]:
    outs: list[str] = []
    errs: list[str] = []
    return EventPrinter(quiet=quiet, write_out=outs.append, write_err=errs.append), outs, errs


def test_the_printer_speaks_after_ready_errors_on_stderr_and_q_keeps_only_errors() -> None:
    p, outs, errs = _printer()
    p(ev(Kind.DIED, detail="exit 1"))  # before ready: the spinner says it
    assert outs == [] and errs == []
    p.live = True
    p(ev(Kind.DIED, detail="exit 1"))
    p(ev(Kind.LOAD_FAILED, "x", "boom"))
    assert outs == ["05:30:00 demo.head died: exit 1"]
    assert errs == ["05:30:00 x failed to load: boom"]
    q, outs, errs = _printer(quiet=True)
    q.live = True
    q(ev(Kind.DIED, detail="exit 1"))
    q(ev(Kind.RESTARTED, seconds=1.0))
    q(ev(Kind.FATAL, "demo", "gave up"))
    assert outs == [] and errs == ["05:30:00 demo FATAL: gave up"]


def test_a_log_record_an_event_line_says_leaves_the_terminal_once_it_speaks() -> None:
    p, _, _ = _printer()
    said = logging.LogRecord("hydra", logging.ERROR, __file__, 1, "x failed", None, None)
    said.__dict__.update(SAID)
    other = logging.LogRecord("hydra", logging.WARNING, __file__, 1, "port moved", None, None)
    assert p.unsaid(said) and p.unsaid(other)  # before ready: the log says it
    p.live = True
    assert not p.unsaid(said) and p.unsaid(other)


# -- what the lanes emit (fake supervisors) ------------------------------------------------------


def test_lanes_emit_died_restarted_loaded_unloaded_and_nothing_on_a_planned_stop(
        tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=4)), (prof("b"), fdep("b", 30201, gpu1=4)))
    got: list[Event] = []
    f.sinks.append(got.append)

    async def body() -> None:
        a = f.lanes["a"]
        assert [e.kind for e in got] == [Kind.LOADED]
        assert got[0].subject == "a" and got[0].detail == "at start"
        got.clear()
        head = STARTED[0].fake_head
        head.to(State.BACKOFF, "head killed by SIGKILL; restart 1 in 1.0s")
        head.to(State.STARTING, "spawning")
        head.to(State.BACKOFF, "exited during start-up (exit 1); restart 2 in 2.0s")
        head.to(State.STARTING, "spawning")
        head.to(State.READY, "health check passed")
        assert [(e.kind, e.subject, e.detail) for e in got] == [
            (Kind.DIED, "a.head", "head killed by SIGKILL; restart 1 in 1.0s"),
            (Kind.DIED, "a.head", "exited during start-up (exit 1); restart 2 in 2.0s"),
            (Kind.RESTARTED, "a.head", "")]
        assert got[-1].seconds is not None and got[-1].seconds >= 0
        got.clear()
        head.to(State.UNHEALTHY, "/health silent")
        head.to(State.READY, "answering /health again")
        assert [e.kind for e in got] == [Kind.UNHEALTHY, Kind.HEALTHY]
        got.clear()
        route(f, "b")  # loads b on request
        await until(lambda: f.lanes["b"].phase is LaneState.SERVING)
        assert [(e.kind, e.subject, e.detail) for e in got] == [
            (Kind.LOADED, "b", "on request")]
        got.clear()
        assert await f.lanes["b"].unload("idle 300s (ttl 300s)") == 0
        assert [(e.kind, e.subject, e.detail) for e in got] == [
            (Kind.UNLOADED, "b", "idle 300s (ttl 300s)")]
        got.clear()
        a.sup.request_stop("test")  # type: ignore[union-attr]
        head.to(State.STOPPING, "stopping")
        head.to(State.STOPPED, "stopped")
        assert got == []  # a stop hydra asked for is no death

    run(f, body)


def test_a_failed_load_and_a_switch_emit_their_result(tmp_path: Path) -> None:
    f = make(tmp_path, (prof("a"), fdep("a", 30200, gpu0=20)),
             (prof("b"), fdep("b", 30201, gpu0=20)))
    got: list[Event] = []
    f.sinks.append(got.append)

    async def body() -> None:
        got.clear()
        BEHAVIOUR["b"] = "crash"
        rep = await f.switch(f.lanes["b"])
        assert rep.result == "rolled_back"
        kinds = [(e.kind, e.subject) for e in got]
        assert kinds == [(Kind.UNLOADED, "a"), (Kind.LOAD_FAILED, "b"), (Kind.LOADED, "a"),
                         (Kind.SWITCH_FAILED, "b")], kinds
        assert got[-1].frm == "a" and got[-1].error
        assert got[-1].detail.startswith("rolled back: "), got[-1].detail
        got.clear()
        BEHAVIOUR["b"] = "ok"
        await until(lambda: f.lanes["a"].job is None)
        f.lanes["b"].failed_at = float("-inf")
        rep = await f.switch(f.lanes["b"])
        assert rep.result == "ok"
        assert [(e.kind, e.subject) for e in got][-1] == (Kind.SWITCHED, "b")
        assert not got[-1].error

    run(f, body)


# -- the real thing -------------------------------------------------------------------------------


@pytest.mark.slow
def test_up_prints_died_and_restarted_when_the_head_is_killed(hydra_up) -> None:  # type: ignore[no-untyped-def]
    up = hydra_up("--profile", "demo", "--port", str(free_port()))
    st = up.wait_ready()
    pid = st["status"]["engines"][0]["pid"]
    os.kill(pid, signal.SIGKILL)

    def stdout() -> str:
        up.out.flush()
        return Path(up.out.name).read_text()

    wait_until(lambda: "demo.head restarted" in stdout(), 90, "a 'restarted' line")
    text = stdout()
    after = text[text.index("ready:"):]
    assert "demo.head died: head killed by SIGKILL; restart 1 in" in after, text
    assert after.index("demo.head died") < after.index("demo.head restarted, ready again after")
    t0 = time.monotonic()
    assert up.stop() == 0
    assert time.monotonic() - t0 < 30
    assert "died" not in Path(up.out.name).read_text()[len(text):]  # a stop is no death
