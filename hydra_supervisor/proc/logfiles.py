"""Child logs: bounded by size without ever blocking the child, read back, and followed.

A child (llama-server, ggml-rpc-server) writes its stdout and stderr straight into
`logs/NAME.log`, a file hydra opened for it with O_APPEND. There is no pipe between the child
and hydra: a pipe must be drained, and a child whose pipe is full blocks in write() -- for
llama-server, a stalled server -- whenever hydra is slow, stopped or busy. The file never fills.

Bounding it is hydra's job, done beside the child, copytruncate style (`Rotator`): every second
hydra looks at the file's size through its own descriptor; past `log_max_bytes` it copies the
file to NAME.log.1 (older ones shift to .2 .. .N, the oldest goes) and truncates the live file to
0. The child's next write lands at the new end (O_APPEND: no hole, no sparse file), and it never
waits for any of this. The price: bytes the child writes between the copy's last read and the
truncate (microseconds: the copy reads up to the size it sees at that instant, then
truncates at once) can be lost, and the live file may pass the limit by what the child writes in
a second. A new run of the child also shifts the files (NAME.log -> NAME.log.1), so .1 is always
"the output just before the live file's".

Kept on disk per child: at most (1 + keep) files of about `log_max_bytes` each (node file keys
`logs: {max_mib, keep}`), plus NAME.log.first-failure (a copy of one run's log, bounded the same
way).

`follow` is `tail -F` for these files: it notices a new file under the name (a restart: new
inode) and a truncation (a size rotation: it reads the rest of what it had not yet shown from
the fresh NAME.log.1 first), and waits for a file that is not there yet.

Wall-clock times. Every spawn starts with one line hydra writes into the file itself, between
fork and exec (so it comes before anything the child prints, and carries the child's own pid):

    --- hydra: demo.head started 2026-12-04T05:30:00.123+00:00 pid 1234 (hydra pid 999) ---

It delimits each run (a failed start's reply quotes only that run's lines: `tail`), says which
hydra started it (`hydra logs` and the dashboard offer only the running hydra's logs:
`current_logs`), and anchors the run in wall-clock time: llama-server runs with
`--log-timestamps` (plan/argv.py), whose stamps count from its own start ("0.02.740.058" =
minutes.seconds.ms.us), and `Stamper` turns them into wall-clock times from the marker. Why a
marker and not hydra's own prefix on every line: the child writes its file directly (no pipe,
see above), so hydra never sees the lines as they are written; and llama.cpp has no
wall-clock option. ggml-rpc-server prints no times at all: its marker is all there is.
hydra's own log (`hydra`, logs/hydra.log) has wall-clock times on every line.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import io
import logging
import logging.handlers
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hydra_supervisor.errors import HydraError
from hydra_supervisor.proc import filemodes

POLL = 1.0  # seconds between size checks of a running child's log
CHUNK = 1 << 20


def fallback_dir(state_root: Path) -> Path:
    """Where children's logs go when the state dir's logs/ cannot be written."""
    tag = hashlib.sha1(str(state_root).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"hydra-{os.getuid()}-{tag}-logs"


def fallback_path(state_root: Path, name: str) -> Path:
    """Where a child's log goes when the state dir's logs/ cannot be written."""
    return fallback_dir(state_root) / f"{name}.log"


def rotated(log: Path, i: int) -> Path:
    return log.with_name(f"{log.name}.{i}")


def shift(log: Path, keep: int) -> None:
    """NAME.log.{keep-1} -> .{keep}, ..., NAME.log -> .1 (a new run starts an empty file)."""
    for i in range(keep, 0, -1):
        newer = rotated(log, i - 1) if i > 1 else log
        if newer.exists():
            newer.replace(rotated(log, i))
    for stale in log.parent.glob(f"{log.name}.*"):  # past a smaller keep than before
        suffix = stale.name[len(log.name) + 1:]
        if suffix.isdigit() and int(suffix) > keep:
            stale.unlink(missing_ok=True)


def open_for_child(log: Path) -> int:
    """The descriptor a new child writes to (read+append: hydra reads it back to rotate).
    Shifts the previous run's file to NAME.log.1 first."""
    pol = filemodes.current()
    filemodes.secure_dir(log.parent)
    if log.exists() and log.stat().st_size > 0:
        shift(log, pol.log_keep)
    return filemodes.open_private(log, os.O_RDWR | os.O_APPEND | os.O_CREAT)


class OwnLog(logging.handlers.RotatingFileHandler):
    """hydra's own log (logs/hydra.log), rotated by size: opened as a state file (never
    through a link: filemodes.open_private), and a write that fails (a full disk) is one
    warning line on stderr, once, never the logging module's traceback; hydra goes on."""

    def __init__(self, path: Path, max_bytes: int = 10 << 20, keep: int = 3) -> None:
        self._warned = False
        super().__init__(path, maxBytes=max_bytes, backupCount=keep)

    def _open(self) -> io.TextIOWrapper:
        fd = filemodes.open_private(Path(self.baseFilename), os.O_WRONLY | os.O_APPEND
                                    | os.O_CREAT)
        return open(fd, "a", encoding=self.encoding, errors=self.errors)  # noqa: SIM115

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        exc = sys.exc_info()[1]
        if self._warned:
            return
        self._warned = True
        why = getattr(exc, "strerror", None) or exc
        sys.stderr.write(f"warning: cannot write {self.baseFilename}: {why} (hydra goes on; "
                         "its log lines reach stderr only)\n")


# -- run markers --------------------------------------------------------------------------------

HYDRA = "hydra"  # the name of hydra's own log (logs/hydra.log) beside its children's
_MARK = re.compile(r"^--- hydra: (?P<name>\S+) started (?P<at>\S+) pid (?P<pid>\d+) "
                   r"\(hydra pid (?P<hydra>\d+)\) ---$")


@dataclass(frozen=True)
class RunMark:
    """The line that opens one run of a child in its log (the module doc)."""

    name: str
    at: dt.datetime  # wall-clock time of the spawn, with its UTC offset
    pid: int
    hydra_pid: int

    def line(self) -> str:
        return (f"--- hydra: {self.name} started {self.at.isoformat(timespec='milliseconds')} "
                f"pid {self.pid} (hydra pid {self.hydra_pid}) ---")

    @classmethod
    def parse(cls, line: str) -> RunMark | None:
        m = _MARK.match(line.rstrip("\n"))
        if m is None:
            return None
        try:
            at = dt.datetime.fromisoformat(m["at"])
        except ValueError:
            return None
        return cls(m["name"], at, int(m["pid"]), int(m["hydra"]))


def mark_parts(log: Path, hydra_pid: int, now: float | None = None) -> tuple[bytes, bytes]:
    """The marker of a run about to start, as the bytes before and after the child's pid (the
    child writes it between fork and exec, when its pid is known: process.spawn)."""
    at = dt.datetime.fromtimestamp(time.time() if now is None else now).astimezone()
    head = RunMark(log.name.removesuffix(".log"), at, 0, hydra_pid).line()
    before, _, after = head.partition(" pid 0 ")
    return f"{before} pid ".encode(), f" {after}\n".encode()


def _first_line(path: Path) -> str | None:
    try:
        with path.open("rb") as fh:
            return fh.readline(512).decode(errors="replace")
    except OSError:
        return None


def run_of(log: Path, start: int = 0, keep: int = 16) -> RunMark | None:
    """The marker of the run the file `log` (or, `start` > 0, NAME.log.{start}) belongs to: its
    first line, or after a size rotation the first line of the nearest older file that opens a
    run. None: no marker (a log older than markers, or not there)."""
    for i in range(start, keep + 1):
        path = log if i == 0 else rotated(log, i)
        first = _first_line(path)
        if first is None:
            return None
        mark = RunMark.parse(first)
        if mark is not None:
            return mark
    return None


# llama.cpp's --log-timestamps: minutes.seconds.ms.us since the process started
_STAMP = re.compile(r"^(\d+)\.(\d\d)\.(\d\d\d)\.(\d\d\d) ")


class Stamper:
    """Rewrites llama.cpp's relative stamps as wall-clock times (local, as hydra.log writes
    them), from the run marker before them; a marker line passes through and starts the next
    run's clock. Lines without a stamp, or before any marker, pass through unchanged."""

    def __init__(self, start: RunMark | None = None) -> None:
        self.start = start

    def line(self, text: str) -> str:
        mark = RunMark.parse(text)
        if mark is not None:
            self.start = mark
            return text
        m = _STAMP.match(text)
        if m is None or self.start is None:
            return text
        us = ((int(m[1]) * 60 + int(m[2])) * 1000 + int(m[3])) * 1000 + int(m[4])
        at = self.start.at + dt.timedelta(microseconds=us)
        wall = at.astimezone().strftime("%Y-%m-%d %H:%M:%S.") + f"{at.microsecond // 1000:03d} "
        return wall + text[m.end():]


# -- which logs there are ---------------------------------------------------------------------


def current_logs(logs_dir: Path, hydra_pid: int | None,
                 named: Mapping[str, Path] | None = None, *,
                 fallback: Path | None = None) -> dict[str, Path]:
    """The logs of the hydra `hydra_pid` by name: "hydra" (its own, logs/hydra.log), every
    child log whose run marker names that hydra (processes it runs now, and those it ran and
    stopped: an unloaded or failed profile's), in `logs_dir` and in the `fallback` dir
    (fallback_dir: where children log when logs/ is not writable), and `named` (the processes
    its status names, with the file each writes). `hydra_pid` None (no hydra runs): every log
    there is, the last run's and older ones alike. The dashboard's log picker and `hydra logs`
    offer these; `pick` resolves a name among them.

    The dashboard, in the running hydra: `current_logs(state.logs, os.getpid(), {p.name:
    Path(p.log) for _, _, p in snap.processes()}, fallback=fallback_dir(state.root))`."""
    found: dict[str, Path] = {}
    for where in (fallback, logs_dir):
        if where is None:
            continue
        with contextlib.suppress(OSError):
            for path in sorted(where.glob("*.log")):
                name = path.name.removesuffix(".log")
                mark = run_of(path)
                if name != HYDRA and (hydra_pid is None or (
                        mark is not None and mark.hydra_pid == hydra_pid)):
                    found[name] = path
    found.update(named or {})
    return {HYDRA: logs_dir / f"{HYDRA}.log", **dict(sorted(found.items()))}


def pick(name: str, logs: Mapping[str, Path], where: str = "here") -> tuple[str, Path]:
    """The log `name` names among `logs` (current_logs): its full name (`demo.head`), or the
    part after the profile (`head`) when one process has it. HydraError naming the choices
    otherwise (`where`: whose logs they are, for the message)."""
    if name in logs:
        return name, logs[name]
    short = sorted(n for n in logs if "." in n and n.split(".", 1)[1] == name)
    if len(short) == 1:
        return short[0], logs[short[0]]
    if short:
        raise HydraError(f"'{name}' is ambiguous: {', '.join(short)}; name one")
    raise HydraError(f"no log for engine '{name}' {where}; its logs: {', '.join(logs)}",
                     hint="`hydra logs NAME` with one of them (`hydra` is hydra's own log)")


def copytruncate(fd: int, log: Path, keep: int) -> int:
    """Copy what `fd` holds to NAME.log.1 (shifting older ones) and truncate it to 0; returns
    the bytes moved. When `log` no longer names the file behind `fd` (a newer run took the
    name), the file is only truncated: its bytes have no place in the series any more."""
    try:
        same = os.stat(log).st_ino == os.fstat(fd).st_ino
    except OSError:
        same = False
    if not same:
        os.ftruncate(fd, 0)
        return 0
    for i in range(keep, 1, -1):
        older = rotated(log, i - 1)
        if older.exists():
            older.replace(rotated(log, i))
    tmp = log.with_name(f".{log.name}.rotating")
    done = 0
    tmp.unlink(missing_ok=True)
    out = filemodes.open_private(tmp, os.O_WRONLY | os.O_CREAT)
    try:
        while True:  # catch up with the writer, then truncate right after the last read
            chunk = os.pread(fd, CHUNK, done)
            if not chunk:
                break
            os.write(out, chunk)
            done += len(chunk)
        os.ftruncate(fd, 0)
    finally:
        os.close(out)
    os.replace(tmp, rotated(log, 1))
    return done


class Rotator:
    """Bounds one running child's log by size (copytruncate, see the module doc)."""

    def __init__(self, fd: int, log: Path, *, max_bytes: int, keep: int) -> None:
        self.fd, self.log, self.max_bytes, self.keep = fd, log, max_bytes, keep
        self.rotations = 0

    def check(self) -> bool:
        """Rotate if the file passed its bound; True if it did."""
        try:
            if os.fstat(self.fd).st_size < self.max_bytes:
                return False
            copytruncate(self.fd, self.log, self.keep)
        except OSError:
            return False  # a full disk must not stop the child (nor hydra)
        self.rotations += 1
        return True

    async def run(self, alive: Callable[[], bool], poll: float | None = None) -> None:
        """Check every `poll` seconds (POLL) while the child runs and once after it exited
        (the copy in a thread, so a slow disk never stalls the loop); then close the
        descriptor."""
        try:
            while alive():
                await asyncio.sleep(POLL if poll is None else poll)
                await asyncio.to_thread(self.check)
            await asyncio.to_thread(self.check)
        finally:
            with contextlib.suppress(OSError):
                os.close(self.fd)


# -- reading back --------------------------------------------------------------------------------


def _last_lines(path: Path, n: int, upto: int | None = None) -> list[str]:
    """The last `n` lines of a file (of its first `upto` bytes), read from the end."""
    if n <= 0:
        return []
    try:
        with path.open("rb") as fh:
            end = fh.seek(0, os.SEEK_END) if upto is None else min(upto,
                                                                   fh.seek(0, os.SEEK_END))
            block = b""
            pos = end
            while pos > 0 and block.count(b"\n") <= n:
                step = min(64 << 10, pos)
                pos -= step
                fh.seek(pos)
                block = fh.read(step) + block
    except OSError:
        return []
    return block.decode(errors="replace").splitlines()[-n:]


def tail(log: Path, n: int) -> list[str]:
    """The last `n` lines of the current run of a child (what a failed start or change
    quotes): the live file, topped up from NAME.log.1 when a size rotation has just emptied
    it; never a line of an earlier run (the run's marker, which is not shown, ends it)."""
    lines = _last_lines(log, n + 1)
    if len(lines) <= n and not (lines and RunMark.parse(lines[0])):
        # the whole live file, and it does not open a run: a size rotation moved the run's
        # start to NAME.log.1
        lines = _last_lines(rotated(log, 1), n + 1 - len(lines)) + lines
    cut = max((i + 1 for i, ln in enumerate(lines) if RunMark.parse(ln)), default=0)
    return lines[cut:][-n:]


Mark = tuple[int, int, int]  # (st_dev, st_ino, offset): where a reader of a file stopped


def tail_at(log: Path, n: int) -> tuple[list[str], Mark | None]:
    """`tail`, and where in the live file it stopped: `follow(start=...)` goes on from there,
    so `hydra logs -f` neither loses nor repeats a line written in between."""
    try:
        st = os.stat(log)
    except OSError:
        st = None
    lines = _last_lines(log, n, upto=st.st_size if st else None)
    if len(lines) < n:
        lines = _last_lines(rotated(log, 1), n - len(lines)) + lines
    return lines, (st.st_dev, st.st_ino, st.st_size) if st else None


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def follow(log: Path, *, poll: float = 0.2, stop: Callable[[], bool] = lambda: False,
           start: Mark | None = None) -> Iterator[str]:
    """Yield what is appended to `log` from now on (from `start`, where `tail_at` stopped, when
    that is still the file under the name), across rotations and restarts (tail -F).

    - a restart moves the file to NAME.log.1 and starts a new one: the old file (still open
      here) is read to its end, then the new one from its start;
    - a size rotation copies the file to a new NAME.log.1 and truncates it: what had not been
      shown yet is read from that copy, then the live file from its start;
    - no file (yet): wait for one.
    """
    fh: IO[bytes] | None = None
    ident: tuple[int, int] | None = None
    pos = 0
    first = True
    one = rotated(log, 1)
    one_ident = _ident(one)
    pending = b""

    def lines(data: bytes) -> Iterator[str]:
        nonlocal pending
        pending += data
        *done, pending = pending.split(b"\n")
        for line in done:
            yield line.decode(errors="replace") + "\n"

    try:
        while not stop():
            if fh is None:
                with contextlib.suppress(OSError):
                    fh = log.open("rb")
                    ident = (os.fstat(fh.fileno()).st_dev, os.fstat(fh.fileno()).st_ino)
                    pos = fh.seek(0, os.SEEK_END) if first else 0
                    if first and start is not None and start[:2] == ident:
                        pos = min(start[2], pos)
                    fh.seek(pos)
                first = False
                if fh is None:
                    time.sleep(poll)
                    continue
            data = fh.read()
            if data:
                pos += len(data)
                yield from lines(data)
                continue
            now = _ident(log)
            if now != ident:  # restarted (renamed away) or removed: drain, then reopen
                rest = fh.read()
                yield from lines(rest)
                fh.close()
                fh, ident, pos = None, None, 0
                one_ident = _ident(one)
                if now is None:
                    time.sleep(poll)
                continue
            size = os.fstat(fh.fileno()).st_size
            new_one = _ident(one)
            if new_one is not None and new_one != one_ident and new_one != ident:
                # A size rotation made a new NAME.log.1. Act once the truncate is done too
                # (the live file is then smaller than the copy).
                with contextlib.suppress(OSError):
                    if size < os.stat(one).st_size:
                        with one.open("rb") as src:
                            src.seek(pos)
                            yield from lines(src.read())
                        fh.seek(0)
                        pos = 0
                        one_ident = new_one
                        continue
            if size < pos:  # truncated by something else: start over, as tail -F does
                fh.seek(0)
                pos = 0
                continue
            time.sleep(poll)
    finally:
        if fh is not None:
            fh.close()
