"""Spawning, watching and stopping one child process: own process group, death signal, bounded
stop, and the OS facts the supervisor judges liveness by.

Children run in their own process group (so a stop reaches anything they fork) and carry
PR_SET_PDEATHSIG=SIGKILL, so they die with hydra even when hydra itself is SIGKILLed. hydra is
a child subreaper (PR_SET_CHILD_SUBREAPER), so the grandchild of a wrapper script whose shell
dies is re-parented to hydra rather than to init: hydra reaps it (waitpid on that pid only,
never waitpid(-1), which would steal asyncio's children) and its group is stopped with the
child's. Output goes straight to a log file (no pipe hydra must drain: a slow log reader can
never block a child or a stop); hydra bounds that file by size beside the child, copytruncate
style (logfiles.py). Stop = SIGTERM (+SIGCONT, so a stopped process acts on it) to the
group, a second SIGTERM, SIGKILL, every wait bounded; a child that survives SIGKILL (stuck in
uninterruptible sleep) is reported, never waited for forever.

A ggml-rpc-server is spawned with SIGPIPE ignored (`outlive_client`): it writes its answers with
plain send(), so a head killed while its peer computes made the peer die of SIGPIPE on its next
write (5 of 8 head kills under traffic on this machine); with SIGPIPE ignored that write fails
with EPIPE, the rpc-server closes that client and accepts the next head. (Python's subprocess
resets SIGPIPE to SIG_DFL in a child, restore_signals; the child setup below ignores it again
after that, and an ignored signal stays ignored across exec.)

The supervisor reaches all of this through its Seams (seams.py), so its policy tests run
on fake children that implement the small `Child` protocol below.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from hydra_supervisor.proc import filemodes, logfiles

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)

Sleep = Callable[[float], Awaitable[None]]


class Child(Protocol):
    """What the supervisor needs of a running child (a real process or a test's fake)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def signal_group(self, sig: int) -> None: ...

    @property
    def exited_at(self) -> float | None:
        """When hydra saw it exit (its clock, monotonic), None while it runs: which of two
        processes died first (status names the first as the cause)."""
        ...


class Spawn(Protocol):
    """How the supervisor starts a child (`spawn` below, or a test's fake)."""

    def __call__(self, argv: Sequence[str], env: Mapping[str, str], log: Path, *,
                 outlive_client: bool = False) -> Awaitable[Child]: ...


class RealChild:
    """An asyncio subprocess that leads its own process group."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.rotator: asyncio.Task[None] | None = None  # bounds its log (logfiles.Rotator)
        self._exited_at: float | None = None
        # Stamped as soon as asyncio reports the exit, whoever waits on it (or nobody).
        self._stamp = asyncio.ensure_future(self._note_exit())

    async def _note_exit(self) -> None:
        await self.proc.wait()
        self._exited_at = time.monotonic()

    @property
    def exited_at(self) -> float | None:
        return self._exited_at

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def wait(self) -> int:
        return await self.proc.wait()

    def signal_group(self, sig: int) -> None:
        kill_group(self.proc.pid, sig)


def _child_setup(parent: int, mark: tuple[bytes, bytes] | None = None, *,
                 ignore_sigpipe: bool = False) -> Callable[[], None]:
    """Runs in the child between fork and exec (after subprocess reset the signals).
    `mark`: the run marker's bytes around the pid (logfiles.mark_parts), written to its stdout
    (the log) before the program's first line. `ignore_sigpipe`: SIGPIPE ignored across exec
    (a write to a vanished client fails with EPIPE instead of killing the child)."""

    def setup() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # hydra may have died between fork and prctl: then nobody would ever signal us.
        if os.getppid() != parent:
            os._exit(1)
        if ignore_sigpipe:
            signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        if mark is not None:
            with contextlib.suppress(OSError):  # a full disk: the child runs all the same
                os.write(1, mark[0] + str(os.getpid()).encode() + mark[1])

    return setup


class LogUnavailable(OSError):
    """The child's log file cannot be opened (the log dir is gone or not writable)."""


async def spawn(argv: Sequence[str], env: Mapping[str, str], log: Path, *,
                outlive_client: bool = False) -> Child:
    """Start a child writing to `log` (O_APPEND; a new run shifts the last one's file to
    NAME.log.1), bounded by size beside it without a pipe (logfiles.py says why). The file
    opens with the run's marker (logfiles.RunMark: wall-clock time, pid, hydra's pid).
    `outlive_client` (a ggml-rpc-server): SIGPIPE ignored, so that a client (its head) that
    vanishes mid-answer does not take it down (the module's doc)."""
    pol = filemodes.current()
    try:
        fd = logfiles.open_for_child(log)
    except OSError as exc:
        raise LogUnavailable(exc.errno, exc.strerror, str(log)) from exc
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **env}, process_group=0,
            preexec_fn=_child_setup(os.getpid(), logfiles.mark_parts(log, os.getpid()),
                                    ignore_sigpipe=outlive_client))
    except BaseException:
        os.close(fd)
        raise
    child = RealChild(proc)
    rot = logfiles.Rotator(fd, log, max_bytes=pol.log_max_bytes, keep=pol.log_keep)
    child.rotator = asyncio.create_task(rot.run(lambda: proc.returncode is None))
    return child


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def within(aw: Awaitable[int], seconds: float, sleep: Sleep) -> int | None:
    """`aw`'s result if it finishes within `seconds` (measured by `sleep`), else None."""
    task = asyncio.ensure_future(aw)
    timer = asyncio.ensure_future(sleep(seconds))
    try:
        await asyncio.wait({task, timer}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, timer, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


@dataclass(frozen=True)
class Stopped:
    """How a stop ended: the exit status, or (stuck) why the child could not be stopped."""

    code: int | None
    stuck: str | None = None


async def stop(child: Child, grace: float = 10.0, *, sleep: Sleep = asyncio.sleep,
               kill_wait: float = 5.0) -> Stopped:
    """TERM the group; TERM again after min(2 s, grace/2); KILL at `grace`; wait `kill_wait`.

    The second TERM is for llama-server, which can hang in its clean-up when requests are in
    flight; a second signal makes it exit at once ("terminating immediately"). SIGCONT follows
    each TERM so that a stopped (SIGSTOP) process acts on it.
    """
    if child.returncode is not None:
        child.signal_group(signal.SIGKILL)  # leftovers of the group, if any
        return Stopped(child.returncode)
    first = min(2.0, grace / 2)
    for wait in (first, grace - first):
        child.signal_group(signal.SIGTERM)
        child.signal_group(signal.SIGCONT)
        code = await within(child.wait(), wait, sleep)
        if code is not None:
            child.signal_group(signal.SIGKILL)  # a grandchild that ignored TERM
            return Stopped(code)
    return await kill_now(child, sleep=sleep, kill_wait=kill_wait)


async def kill_now(child: Child, *, sleep: Sleep = asyncio.sleep, kill_wait: float = 5.0
                   ) -> Stopped:
    """SIGKILL the group at once (for a hung process, which would ignore SIGTERM)."""
    child.signal_group(signal.SIGKILL)
    code = await within(child.wait(), kill_wait, sleep)
    if code is not None:
        return Stopped(code)
    return Stopped(None, stuck=f"pid {child.pid} survived SIGKILL for {kill_wait:.0f}s "
                            f"(state {state_name(child.pid)})")


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 134:
        return "exit 134 (SIGABRT: llama.cpp aborted)"
    return f"exit {code}"


# -- what the OS says about a child (liveness by progress) ------------------------------------


@dataclass(frozen=True)
class ProcStat:
    """A child's process tree at one instant: stopped (SIGSTOP / traced) anywhere in it, and
    the CPU seconds it has used in all (user + system), which grows while it works."""

    stopped: bool
    cpu: float
    state: str = ""


def group_stat(pid: int) -> ProcStat | None:
    """The child and its descendants (a wrapper script's llama-server runs below it)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    stopped = False
    cpu = 0.0
    states = []
    for p in procs:
        try:
            with p.oneshot():
                st = p.status()
                t = p.cpu_times()
        except psutil.Error:
            continue
        states.append(st)
        stopped |= st in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        cpu += t.user + t.system
    if not states or all(s == psutil.STATUS_ZOMBIE for s in states):
        return None
    worst = next((s for s in states if s in (psutil.STATUS_STOPPED, psutil.STATUS_DISK_SLEEP)),
                 states[0])
    return ProcStat(stopped=stopped, cpu=cpu, state=worst)


def state_name(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


def owns_port(pid: int, port: int) -> bool | None:
    """Is the listener on `port` the child `pid` (or in its process group)? None: cannot tell
    (no listener seen, or one whose owner this user may not see)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    owners = [c.pid for c in conns
              if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN]
    if not owners:
        return None
    for owner in owners:
        if owner is None:
            continue
        if owner == pid:
            return True
        with contextlib.suppress(OSError):
            if os.getpgid(owner) == pid:
                return True
    return False if any(o is not None for o in owners) else None


# -- subreaper ---------------------------------------------------------------------------------


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux 3.4+)."""
    return bool(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)


def adopted(groups: Collection[int]) -> list[psutil.Process]:
    """Our children that we did not start: orphans re-parented to us (subreaper) from the
    process groups of our managed children (`groups`: their pids, each a group leader). A
    grandchild stays in its child's group; hydra's own helpers (the guard, a tool it runs) are
    in other groups and are never touched; the leaders themselves are asyncio's to reap."""
    out = []
    try:
        kids = psutil.Process().children()
    except psutil.Error:
        return []
    for p in kids:
        if p.pid in groups:
            continue
        try:
            if os.getpgid(p.pid) in groups:
                out.append(p)
        except OSError:
            continue
    return out


def reap_adopted(groups: Collection[int]) -> list[int]:
    """waitpid (non-blocking) each adopted orphan that has exited; returns the reaped pids."""
    reaped = []
    for p in adopted(groups):
        with contextlib.suppress(ChildProcessError, OSError):
            done, _ = os.waitpid(p.pid, os.WNOHANG)
            if done:
                reaped.append(p.pid)
    return reaped
