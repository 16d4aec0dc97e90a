"""Resource exhaustion never stops the serving quietly (docs/supervision.md, "How hydra
ends"): the Supervisor's watch failing for want of descriptors (EMFILE from /proc, as a
flood of sockets caused it) is said and waited out while the processes serve on, and watching
resumes; a failure that is not exhaustion (a bug) ends the run FATAL with its real cause, never
as a plain stop. The real Supervisor on fake children (tests/fake_children.py): a process table
that refuses to be read on demand is a fault no real binary shows on demand. The daemon's side
(such a FATAL ends `hydra up` with exit 1, and an exception out of its run too): tests/
test_unrequested_exit.py."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from hydra_supervisor.errors import exhausted
from hydra_supervisor.proc import process
from hydra_supervisor.proc.managed import State
from tests.fake_children import FakeWorld, Run, deployment, go


class Faulty:
    """FakeWorld.proc_stat, raising `exc` while `on`."""

    def __init__(self, world: FakeWorld) -> None:
        self.world = world
        self.exc: BaseException | None = None
        self.raised = 0

    def __call__(self, pid: int) -> process.ProcStat | None:
        if self.exc is not None:
            self.raised += 1
            raise self.exc
        return FakeWorld.proc_stat(self.world, pid)


def test_exhausted_says_which_failures_are_resources() -> None:
    assert exhausted(OSError(errno.EMFILE, "Too many open files"))
    assert exhausted(OSError(errno.ENFILE, "Too many open files in system"))
    assert exhausted(MemoryError())
    assert exhausted(RuntimeError("can't start new thread"))
    assert not exhausted(OSError(errno.ENOENT, "No such file"))
    assert not exhausted(RuntimeError("a bug"))


def test_out_of_descriptors_the_watch_waits_and_the_processes_serve_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        faulty = Faulty(w)
        w.proc_stat = faulty  # type: ignore[method-assign]
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        head = r.mp("head")
        pid = head.pid
        faulty.exc = OSError(errno.EMFILE, "Too many open files", "/proc/1/stat")
        await r.until(lambda: faulty.raised >= 4, 60)  # it kept trying, backing off
        assert r.task is not None and not r.task.done()
        assert head.state is State.READY and head.pid == pid and head.restarts == 0
        assert r.sup.fatal is None
        faulty.exc = None
        # watching again: a head killed now is noticed and restarted
        next(c for c in w.children if c.pid == pid).kill()
        await r.until(lambda: head.pid != pid and head.state is State.READY, 60)
        await r.stop()
    with caplog.at_level(logging.WARNING, logger="hydra"):
        go(tmp_path, body)
    said = [r.getMessage() for r in caplog.records if "watching failed" in r.getMessage()]
    assert said and "Too many open files" in said[0] and "serve on" in said[0], said


def test_a_failure_that_is_not_exhaustion_ends_the_run_fatal_with_its_cause(
        tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        faulty = Faulty(w)
        w.proc_stat = faulty  # type: ignore[method-assign]
        r = Run(w, deployment(0), tmp).start()
        await r.all_ready()
        faulty.exc = RuntimeError("injected bug in the watch")
        assert r.task is not None
        await w.wait_for(lambda: r.task is not None and r.task.done(), 60)
        r.task.result()  # it ended, not raised
        assert r.sup.fatal is not None
        assert "RuntimeError: injected bug in the watch" in r.sup.fatal
        assert r.sup.stop_reason == f"FATAL: {r.sup.fatal}"
        assert all(p.state is State.STOPPED for p in r.sup.procs)
    go(tmp_path, body)
