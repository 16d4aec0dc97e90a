"""The state dir: what a running `hydra up` tells other `hydra` commands, through files.

  hydra.lock        flock()ed by the one hydra that owns this state dir (its pid inside)
  supervisor.json   pid, start time and profile of the running `hydra up`
  status.json       one row per engine (state, pid, port, reason...), rewritten atomically on
                    every state change
  pids/NAME.json    pid, process group, start time, cmdline and hydra's pid for each child, to
                    find stale children of a crashed hydra and their whole process group (pid
                    reuse is ruled out by start time and cmdline)
  logs/NAME.log     each child's output; NAME.log.1 .. .N the output before it (an earlier run,
                    or the file's first part once it passed its size bound: logfiles.py)
  logs/hydra.log    hydra's own log (rotated at 10 MiB, 3 kept)

Only hydra's owner can read any of it (directories 0700, files 0600), or the group a node file
names in `state_group:` (filemodes.py); `hydra up` tightens what it finds looser.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import stat
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

import psutil

from hydra_supervisor.config.paths import state_dir
from hydra_supervisor.errors import HydraError
from hydra_supervisor.jsontypes import JSONObject, JSONValue
from hydra_supervisor.proc import filemodes


class SupervisorRecord(TypedDict, total=False):
    """supervisor.json: the running `hydra up` (`died`: stamped by its orphan guard)."""

    pid: int
    create_time: float
    profile: str
    source: str
    started: float
    died: float


class ChildRecord(TypedDict):
    """pids/NAME.json: one child hydra started."""

    pid: int
    pgid: int
    create_time: float
    cmdline: list[str]
    hydra_pid: int


def _write_json(path: Path, data: object) -> None:
    """Write `path` whole (a new file renamed over it), never through a link (filemodes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # one a killed run with this pid left
    fd = filemodes.open_private(tmp, os.O_WRONLY | os.O_CREAT)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


_READ_CAP = 16 << 20  # a state file is a few KiB; nothing hydra wrote is near this


def _read_json(path: Path) -> JSONValue:
    """A state file's JSON, or None (missing, unreadable, not hydra's regular file, bad JSON).
    Never through a link, never blocking on a FIFO, never more than _READ_CAP bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            data: JSONValue = json.loads(fh.read(_READ_CAP + 1)[:_READ_CAP])
            return data
    except (OSError, ValueError):
        return None


@dataclass
class StateDir:
    root: Path

    @classmethod
    def default(cls) -> StateDir:
        return cls(state_dir())

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_path(self, engine: str) -> Path:
        return self.logs / f"{engine}.log"

    def slots(self, make: bool = True) -> Path:
        """Where heads save KV slots (--slot-save-path): keep_slots and the wire protocol's
        STATE_* ops; made on first use (`make`; `hydra plan` only names it)."""
        path = self.root / "slots"
        if make:
            path.mkdir(parents=True, exist_ok=True)
        return path

    def ensure_writable(self) -> None:
        for d in (self.root, self.logs, self.root / "pids"):
            try:
                if not d.is_dir():  # made with the policy's mode (setgid too), not tightened
                    d.mkdir(parents=True, exist_ok=True)
                    os.chmod(d, filemodes.current().dir_mode)
            except OSError as exc:
                raise HydraError(f"state dir {d} cannot be created: {exc.strerror}",
                                 hint="set HYDRA_STATE_DIR to a writable directory") from exc
            if not os.access(d, os.W_OK):
                raise HydraError(f"state dir {d} is not writable",
                                 hint="set HYDRA_STATE_DIR to a writable directory")

    def secure(self, policy: filemodes.Policy) -> list[str]:
        """`hydra up`, before it writes anything: a state dir that is not hydra's own (another
        user's, or writable by others: filemodes.foreign) refused, the umask of the policy
        (children inherit it), the dirs created, and whatever an earlier run left looser
        tightened. Returns what was changed (for one log line)."""
        why = filemodes.foreign(self.root)
        if why:
            raise HydraError(
                f"state dir {self.root} is not hydra's own: {why}",
                hint="give hydra a state dir only its user can write (HYDRA_STATE_DIR): "
                     "`chmod go-w` and `chown` what is yours after checking it, or remove it "
                     "and let hydra create it")
        filemodes.configure(policy)
        os.umask(policy.umask)
        self.ensure_writable()
        return filemodes.tighten(self.root, policy)

    # -- one hydra per state dir ---------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the state dir's lock for the block; HydraError naming the holder if another
        hydra has it. flock() dies with its holder (a kill -9 frees it): no stale lock ever.
        The descriptor is not inherited by children (Python's default), so a child that
        outlives hydra cannot keep the lock either."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / "hydra.lock"
        with self.writing(path):
            fd = filemodes.open_private(path, os.O_RDWR | os.O_CREAT)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder_pid(fd)
                running = self.running_supervisor()
                what = f", profile '{running['profile']}'" if running and \
                    str(running.get("pid")) == holder else ""
                raise HydraError(
                    f"hydra is already running here: pid {holder}{what} holds the state dir "
                    f"{self.root} (lock {path})",
                    hint="`hydra down` first (`hydra status` shows it), `hydra switch PROFILE` to "
                         "change its layout, or set HYDRA_STATE_DIR for a second hydra") from None
            with self.writing(path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            try:
                yield
            finally:
                os.ftruncate(fd, 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    # -- the supervisor ---------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, path: Path) -> Iterator[None]:
        """A write into the state dir that `hydra up` cannot start without: an OSError (a
        full disk, a read-only mount) becomes a HydraError naming the file and the fix."""
        try:
            yield
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EPERM):  # filemodes.open_private: not ours
                raise HydraError(f"state dir {self.root}: {path} is {exc.strerror}",
                                 hint=f"remove {path} after checking what it is; hydra makes "
                                      "its own") from None
            raise HydraError(f"state dir {self.root}: cannot write {path}: "
                             f"{exc.strerror or exc}",
                             hint="free space on its filesystem, or set HYDRA_STATE_DIR to a "
                                  "writable directory") from None

    def write_supervisor(self, profile: str, source: str) -> None:
        me = psutil.Process()
        path = self.root / "supervisor.json"
        with self.writing(path):
            _write_json(path, {"pid": me.pid, "create_time": me.create_time(),
                               "profile": profile, "source": source, "started": time.time()})

    def running_supervisor(self) -> SupervisorRecord | None:
        """The live `hydra up` of this state dir, or None (a stale file is ignored)."""
        found = _read_json(self.root / "supervisor.json")
        if not found:
            return None
        data = cast(SupervisorRecord, found)  # what write_supervisor wrote
        try:
            proc = psutil.Process(int(data["pid"]))
            if abs(proc.create_time() - float(data["create_time"])) > 1.0:
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (psutil.Error, KeyError, ValueError):
            return None
        return data.copy()

    def abnormal_end(self) -> JSONObject | None:
        """The last run's record when it ended without a clean stop (kill -9, the OOM killer, a
        crash): its supervisor.json is still there but names no live hydra. None otherwise.
        `died` is when hydra's orphan guard saw it go (guard.py), else None: it ended at some
        point after `last_seen` (status.json's last update)."""
        data = _read_json(self.root / "supervisor.json")
        if not isinstance(data, dict) or "pid" not in data or self.running_supervisor():
            return None
        return self._abnormal(data)

    def _abnormal(self, sup: JSONObject) -> JSONObject:
        status = self.read_status() or {}
        if status.get("abnormal"):  # already marked (by the guard): its last live word
            last = cast(JSONObject, status["abnormal"])  # what _marked wrote
            return {**last, "died": sup.get("died") or last.get("died")}
        return {"pid": sup.get("pid"), "profile": status.get("profile") or sup.get("profile"),
                "started": sup.get("started"), "died": sup.get("died"),
                "last_seen": status.get("updated"), "last_state": status.get("state")}

    def abnormal_text(self, ab: JSONObject) -> str:
        when = f"at {_clock(ab['died'])}" if ab.get("died") else \
            f"after {_clock(ab['last_seen'])}" if ab.get("last_seen") else "at an unknown time"
        return (f"ended abnormally {when}: hydra pid {ab['pid']} (profile {ab['profile']}) died "
                "without a clean stop (kill -9, the OOM killer or a crash)")

    def read_status_checked(self) -> JSONObject | None:
        """status.json as a reader should take it: after an abnormal end, marked stopped with
        why (its `switching` or `serving` was the dead hydra's last word, not a live state)."""
        return self._marked(self.abnormal_end())

    def _marked(self, ab: JSONObject | None) -> JSONObject | None:
        data = self.read_status()
        if ab is None:
            return data
        data = dict(data or {})
        data.update(state="stopped", stopped=self.abnormal_text(ab), abnormal=ab)
        rows = data.get("engines")
        if isinstance(rows, list):  # none of its processes runs for it any more
            data["engines"] = [
                {**r, "state": "STOPPED", "pid": None, "last_pid": r.get("pid"),
                 "reason": f"hydra pid {ab['pid']} died; its orphan guard stops what it left"}
                if isinstance(r, dict) and r.get("pid") else r for r in rows]
        return data

    def clear_abnormal_end(self) -> JSONObject | None:
        """`hydra up` (holding the lock): turn a dead run's records into a stopped one (its
        supervisor.json goes; status.json says it stopped and how). Returns the record."""
        ab = self.abnormal_end()
        if ab is None:
            return None
        fixed = self.read_status_checked()
        with contextlib.suppress(OSError):
            if fixed is not None:
                self.write_status(fixed)
            (self.root / "supervisor.json").unlink(missing_ok=True)
        return ab

    def mark_died(self, hydra_pid: int) -> bool:
        """The orphan guard, when its hydra is gone: if that hydra did not clear its record (no
        clean stop), stamp the time it died and mark status.json stopped. True if it did."""
        path = self.root / "supervisor.json"
        data = _read_json(path)
        if not isinstance(data, dict) or data.get("pid") != hydra_pid:
            return False
        data["died"] = time.time()
        _write_json(path, data)
        fixed = self._marked(self._abnormal(data))  # not asking psutil: it may still be exiting
        if fixed is not None:
            _write_json(self.root / "status.json", fixed)
        return True

    def clear_supervisor(self) -> None:
        data = cast("SupervisorRecord | None", _read_json(self.root / "supervisor.json"))
        if data and data.get("pid") == os.getpid():
            (self.root / "supervisor.json").unlink(missing_ok=True)

    # -- status -----------------------------------------------------------------------------

    def write_status(self, status: Mapping[str, object]) -> None:
        _write_json(self.root / "status.json", status)

    def read_status(self) -> JSONObject | None:
        data = _read_json(self.root / "status.json")
        return data if isinstance(data, dict) else None

    # -- children ---------------------------------------------------------------------------

    def record_child(self, engine: str, pid: int) -> None:
        """The child leads its own process group (pgid = pid): stopping the group later also
        stops what a wrapper script forked, even after the wrapper itself died."""
        try:
            proc = psutil.Process(pid)
            info = {"pid": pid, "pgid": os.getpgid(pid), "create_time": proc.create_time(),
                    "cmdline": proc.cmdline(), "hydra_pid": os.getpid()}
        except (psutil.Error, OSError):
            return
        _write_json(self.root / "pids" / f"{engine}.json", info)

    def forget_child(self, engine: str) -> None:
        (self.root / "pids" / f"{engine}.json").unlink(missing_ok=True)

    def stale_children(self, hydra_pid: int | None = None) -> list[Stale]:
        """Recorded children of an earlier hydra (only `hydra_pid`'s, when given) that still
        run, each with the live members of its process group. A group whose leader is gone
        still counts (a wrapper script killed with hydra, its llama-server still running):
        Linux never reuses a pid while a process group of that id has members."""
        out = []
        groups = _process_groups()
        for f in sorted((self.root / "pids").glob("*.json")):
            data = _read_json(f)
            if not isinstance(data, dict):
                f.unlink(missing_ok=True)
                continue
            if hydra_pid is not None and data.get("hydra_pid") != hydra_pid:
                continue
            rec = cast(ChildRecord, data)  # what record_child wrote (checked below)
            try:
                pid = int(rec["pid"])
                pgid = int(rec.get("pgid", pid))
            except (TypeError, KeyError, ValueError):
                f.unlink(missing_ok=True)
                continue
            leader = _same_leader(pid, rec)
            if leader is None:  # the pid runs another program now: not ours
                f.unlink(missing_ok=True)
                continue
            live = [*leader, *(p for p in groups.get(pgid, []) if p.pid != pid)]
            if live:
                out.append(Stale(f.stem, pgid, live))
            else:
                f.unlink(missing_ok=True)
        return out

    def kill_stale(self, grace: float = 5.0, hydra_pid: int | None = None) -> list[str]:
        """Stop stale children's whole process groups (TERM, then KILL); say what was stopped."""
        stale = self.stale_children(hydra_pid)
        procs = [p for s in stale for p in s.procs]
        for s in stale:
            for sig in (signal.SIGTERM, signal.SIGCONT):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(s.pgid, sig)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        for s in stale:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(s.pgid, signal.SIGKILL)
        for p in alive:  # one that left the group (setsid) but was recorded in it
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
        for s in stale:
            self.forget_child(s.name)
        return [f"{s.name} (pid {', '.join(str(p.pid) for p in s.procs)})" for s in stale]


def _clock(t: object) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(cast(float, t))))
    except (TypeError, ValueError, OverflowError):
        return "?"


@dataclass(frozen=True)
class Stale:
    name: str
    pgid: int
    procs: list[psutil.Process]


def _same_leader(pid: int, data: ChildRecord) -> list[psutil.Process] | None:
    """[the recorded process] if it still runs; [] if gone; None if the pid was reused."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return []
        same = (abs(proc.create_time() - float(data["create_time"])) < 1.0
                and proc.cmdline() == data["cmdline"])
    except psutil.NoSuchProcess:
        return []
    except (psutil.Error, TypeError, KeyError, ValueError):
        return None
    return [proc] if same else None


def _process_groups() -> dict[int, list[psutil.Process]]:
    """Every live (non-zombie) process of this user, by process group."""
    groups: dict[int, list[psutil.Process]] = {}
    for p in psutil.process_iter():
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            groups.setdefault(os.getpgid(p.pid), []).append(p)
        except (psutil.Error, OSError):
            continue
    return groups


def _holder_pid(fd: int, wait_s: float = 2.0) -> str:
    """The pid the lock's holder wrote into the lock file. A hydra that has just taken the
    lock writes it a moment later (two started in the same instant): read again for up to
    `wait_s` before saying "?"."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
        if holder or time.monotonic() >= deadline:
            return holder or "?"
        time.sleep(0.02)

