"""What the dashboard shows, gathered off the event loop: the daemon's published snapshot, the
devices' memory, and logs (hydra's own and its processes') read by offset.

Threads here never touch a Port, a Lane or a Supervisor. The snapshot is the frozen, typed
value the daemon publishes on every status change (serve/snapshot.py: the one status.json and
`hydra status --json` are built from); when the page asks for something fresher than
`max_age`, a new one is taken *on the loop* (asyncio.run_coroutine_threadsafe) and published,
so the HTTP thread only ever reads a finished, immutable value. Everything else read here is
outside hydra's objects: /proc/meminfo, NVML, a log file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

from hydra_supervisor.jsontypes import JSONList, JSONObject
from hydra_supervisor.plan import devices
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.serve.snapshot import Snapshot

log = logging.getLogger("hydra.dashboard")

class Publisher:
    """The last published snapshot, and a fresh one on request (taken on the loop)."""

    def __init__(self, take: Callable[[], Snapshot]) -> None:
        """`take` builds the snapshot to publish (on the loop's thread only); readers share
        it (it is immutable)."""
        self._take = take
        self._loop: asyncio.AbstractEventLoop | None = None
        self._latest: tuple[float, Snapshot] | None = None
        self._lock = threading.Lock()
        self._pending: concurrent.futures.Future[Snapshot] | None = None
        self._expired = False  # a change not published yet: readers ask for a fresh one

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def put(self, snap: Snapshot) -> None:
        """Publish (the loop's thread: the daemon's status change)."""
        self._latest = (time.monotonic(), snap)
        self._expired = False

    def expire(self) -> None:
        """The status changed and its snapshot comes a moment later (the loop's thread: the
        daemon answers a switch first): until then readers get a fresh one, not the last."""
        self._expired = True

    async def _refresh(self) -> Snapshot:
        snap = self._take()
        self.put(snap)
        return snap

    def get(self, max_age: float = 0.8, wait: float = 3.0) -> tuple[Snapshot | None, float]:
        """(snapshot, its age in seconds). Older than max_age: ask the loop for a new one and
        wait up to `wait`; a loop that does not answer in time gets the last one (its age
        says so)."""
        latest = self._latest
        now = time.monotonic()
        if latest is not None and not self._expired and now - latest[0] <= max_age:
            return latest[1], now - latest[0]
        loop = self._loop
        if loop is not None and _running_loop() is loop:
            # asked on the loop's own thread (a start-up check): take it here; waiting for
            # the loop from its own thread would only time out
            snap = self._take()
            self.put(snap)
            return snap, 0.0
        if loop is not None and not loop.is_closed():
            with self._lock:  # one refresh at a time, shared by every waiting request
                fut = self._pending
                if fut is None or fut.done():
                    fut = self._pending = asyncio.run_coroutine_threadsafe(self._refresh(),
                                                                           loop)
            try:
                fut.result(wait)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                pass
            except Exception:  # noqa: BLE001 - a failed snapshot: serve the last one
                log.exception("dashboard: taking a snapshot failed")
        latest = self._latest
        if latest is None:
            return None, float("inf")
        return latest[1], time.monotonic() - latest[0]


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# ---------------------------------------------------------------------------------------------
# Devices


class DeviceMemory:
    """Totals and use of every device (NVML for GPUs, /proc/meminfo for the host), cached for
    a few seconds: an NVML session per page poll would be wasteful."""

    def __init__(self, ttl: float = 3.0) -> None:
        self._ttl = ttl
        self._at = -1e9
        self._cached: JSONObject = {}
        self._lock = threading.Lock()

    def get(self) -> JSONObject:
        with self._lock:
            if time.monotonic() - self._at > self._ttl:
                self._cached = self._read()
                self._at = time.monotonic()
            return self._cached

    @staticmethod
    def _read() -> JSONObject:
        try:
            inv = devices.inventory()
        except Exception as exc:  # noqa: BLE001 - a bad devices file must not end the page
            return {"source": f"unknown ({exc})", "host": None, "gpus": []}
        host: JSONObject = {"total": inv.cpu_total, "used": max(0, inv.cpu_total - inv.cpu_free),
                "cores": inv.cpu_count}
        gpus: JSONList = [{"index": g.index, "model": g.model, "total": g.total,
                 "used": max(0, g.total - g.free)} for g in inv.gpus]
        return {"source": inv.source, "host": host, "gpus": gpus}


# ---------------------------------------------------------------------------------------------
# Logs


HYDRA_LOG = "hydra"  # hydra's own log's name in the picker (`hydra logs hydra`)


def process_logs(snap: Snapshot | None) -> dict[str, tuple[Path, int | None]]:
    """Every log the page may read, by name: hydra's own (logs/hydra.log in its state dir,
    its pid hydra's) and every process the snapshot names (its log file and pid). Nothing
    else can be read."""
    if snap is None:
        return {}
    own = StateDir(Path(snap.daemon.state_dir)).log_path(HYDRA_LOG)
    return {HYDRA_LOG: (own, snap.daemon.pid),
            **{p.name: (Path(p.log), p.pid) for _, _, p in snap.processes()
               if p.name and p.log}}


class LogChunk(TypedDict):
    """A log read by offset (/api/log): the text past the cursor and the next cursor."""

    text: str
    cursor: str | None  # "inode:offset"
    restarted: bool  # a new file (a restart) or a shorter one: read from its start
    skipped: bool  # far behind: only the last `limit` bytes
    missing: bool


def read_log(path: Path, cursor: str | None, limit: int = 64 * 1024) -> LogChunk:
    """What the file holds past `cursor` ("inode:offset" from the last read), at most `limit`
    bytes. A new inode (a restart gives the child a new file) or a shorter file (a size
    rotation truncated it) starts over from the file's start, and the reply says so
    (`restarted`). No cursor: the file's last `limit` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return LogChunk(text="", cursor=None, restarted=False, skipped=False, missing=True)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        inode, size = st.st_ino, st.st_size
        start, restarted = None, False
        if cursor:
            ino_s, _, off_s = cursor.partition(":")
            try:
                ino, off = int(ino_s), int(off_s)
            except ValueError:
                ino, off = -1, 0
            if ino == inode and off <= size:
                start = off
            else:
                start, restarted = 0, True
        if start is None:
            start = max(0, size - limit)
        truncated = size - start > limit
        if truncated:
            start = size - limit  # far behind: skip to the last `limit` bytes
        f.seek(start)
        data = f.read(limit)
    end = start + len(data)
    if start and not cursor:  # began mid-file: drop the partial first line
        nl = data.find(b"\n")
        data = data[nl + 1:] if nl >= 0 else data
    return {"text": data.decode("utf-8", errors="replace"),
            "cursor": f"{inode}:{end}",
            "restarted": restarted, "skipped": truncated, "missing": False}
