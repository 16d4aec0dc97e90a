"""Spawning and stopping one child process: own process group, death signal, bounded stop.

Children run in their own process group (so a stop reaches anything they fork) and carry
PR_SET_PDEATHSIG=SIGKILL, so they die with hydra even when hydra itself is SIGKILLed. Output goes
straight to a log file (no pipe hydra must drain: a slow log reader can never block a child or a
stop). Stop = SIGTERM to the group, bounded wait, SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _child_setup(parent: int) -> Callable[[], None]:
    def setup() -> None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # hydra may have died between fork and prctl: then nobody would ever signal us.
        if os.getppid() != parent:
            os._exit(1)

    return setup


class LogUnavailable(OSError):
    """The child's log file cannot be opened (the log dir is gone or not writable)."""


def rotate(log: Path, keep: int = 3) -> None:
    """Keep the logs of the last `keep` runs: engine.log.1 is the previous run."""
    for i in range(keep, 0, -1):
        older = log.with_name(f"{log.name}.{i}")
        newer = log.with_name(f"{log.name}.{i - 1}") if i > 1 else log
        if newer.exists():
            newer.replace(older)


async def spawn(argv: Sequence[str], env: Mapping[str, str], log: Path
                ) -> asyncio.subprocess.Process:
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        rotate(log)
        out = log.open("ab")
    except OSError as exc:
        raise LogUnavailable(exc.errno, exc.strerror, str(log)) from exc
    with out:
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **env}, process_group=0, preexec_fn=_child_setup(os.getpid()))


def kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


async def stop(proc: asyncio.subprocess.Process, grace: float = 10.0) -> int:
    """TERM the group; TERM again after 2 s; KILL after `grace` seconds. Returns the status.

    The second TERM is for llama-server, which can hang in its clean-up when requests are in
    flight; a second signal makes it exit at once ("terminating immediately").
    """
    if proc.returncode is not None:
        kill_group(proc.pid, signal.SIGKILL)  # leftovers of the group, if any
        return proc.returncode
    kill_group(proc.pid, signal.SIGTERM)
    first = min(2.0, grace / 2)
    try:
        return await asyncio.wait_for(proc.wait(), first)
    except TimeoutError:
        kill_group(proc.pid, signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), grace - first)
    except TimeoutError:
        kill_group(proc.pid, signal.SIGKILL)
        return await asyncio.wait_for(proc.wait(), 10.0)


async def kill_now(proc: asyncio.subprocess.Process) -> int:
    """SIGKILL the group at once (for a hung process, which would ignore SIGTERM)."""
    kill_group(proc.pid, signal.SIGKILL)
    return await asyncio.wait_for(proc.wait(), 10.0)


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
