"""What the dashboard shows, gathered off the event loop: the daemon's published snapshot, the
devices' memory, the heads' own token counters, and process logs read by offset.

Threads here never touch a Port, a Lane or a Supervisor. The snapshot is the frozen, typed
value the daemon publishes on every status change (serve/snapshot.py: the one status.json and
`hydra status --json` are built from); when the page asks for something fresher than
`max_age`, a new one is taken *on the loop* (asyncio.run_coroutine_threadsafe) and published,
so the HTTP thread only ever reads a finished, immutable value. Everything else read here is
outside hydra's objects: /proc/meminfo, NVML, a head's `/metrics` over HTTP, a log file.
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

import requests

from hydra_supervisor.jsontypes import JSONList, JSONObject
from hydra_supervisor.plan import devices
from hydra_supervisor.runtime.metrics_heads import heads_from_snapshot
from hydra_supervisor.serve.snapshot import Snapshot

log = logging.getLogger("hydra.dashboard")

# A head's llama-server counters the page turns into rates (its `/metrics`, with --metrics).
HEAD_COUNTERS = {
    "llamacpp:tokens_predicted_total": "predicted",
    "llamacpp:prompt_tokens_total": "prompt",
    "llamacpp:requests_processing": "processing",
}


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

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def put(self, snap: Snapshot) -> None:
        """Publish (the loop's thread: the daemon's status change)."""
        self._latest = (time.monotonic(), snap)

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
        if latest is not None and now - latest[0] <= max_age:
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
# The heads' own counters


class HeadTokens:
    """Each READY head's token counters from its own `/metrics` (llama-server --metrics).
    A head that answers 501 (no --metrics) is asked again only after a while."""

    def __init__(self, timeout: float = 1.0, retry_s: float = 30.0, every_s: float = 2.0
                 ) -> None:
        self._timeout = timeout
        self._retry_s = retry_s
        self._every_s = every_s  # a head logs every /metrics request: not at every poll
        self._last: tuple[float, dict[str, JSONObject]] = (-1e9, {})
        self._off: dict[str, float] = {}  # url -> when it said "no metrics"
        self._session = requests.Session()
        self._lock = threading.Lock()

    def get(self, snap: Snapshot) -> dict[str, JSONObject]:
        """{profile: {"metrics": bool, "predicted": n, "prompt": n, "processing": n}}"""
        out: dict[str, JSONObject] = {}
        with self._lock:
            heads = heads_from_snapshot(snap)
            at, last = self._last
            if time.monotonic() - at < self._every_s and set(last) == {
                    h.profile or h.engine for h in heads}:
                return last
            for head in heads:
                key = head.profile or head.engine
                off = self._off.get(head.url)
                if off is not None and time.monotonic() - off < self._retry_s:
                    out[key] = {"metrics": False}
                    continue
                out[key] = self._scrape(head.url, head.api_key)
            self._last = (time.monotonic(), out)
        return out

    def _scrape(self, url: str, api_key: str | None) -> JSONObject:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        try:
            r = self._session.get(f"{url}/metrics", timeout=self._timeout, headers=headers)
        except requests.RequestException as exc:
            return {"metrics": None, "error": type(exc).__name__}
        if r.status_code != 200:
            if r.status_code in (404, 501):
                self._off[url] = time.monotonic()
            return {"metrics": False, "error": f"HTTP {r.status_code}"}
        row: JSONObject = {"metrics": True}
        for line in r.text.splitlines():
            if not line or line[0] == "#":
                continue
            name, _, rest = line.partition(" ")
            name = name.split("{", 1)[0]
            if name in HEAD_COUNTERS:
                try:
                    row[HEAD_COUNTERS[name]] = float(rest.split()[0])
                except (ValueError, IndexError):
                    pass
        return row


# ---------------------------------------------------------------------------------------------
# Logs


def process_logs(snap: Snapshot | None) -> dict[str, tuple[Path, int | None]]:
    """Every process the snapshot names: its log file and pid (only these can be read)."""
    if snap is None:
        return {}
    return {p.name: (Path(p.log), p.pid) for _, _, p in snap.processes() if p.name and p.log}


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
