"""systemd's notify protocol, spoken directly on $NOTIFY_SOCKET: READY, STATUS, RELOADING,
STOPPING, WATCHDOG, and the watchdog interval systemd asks for.

Why by hand: the protocol is one datagram of newline-separated KEY=VALUE lines to a unix socket
(sd_notify(3)); a library would add a dependency for ten lines. Every call is a no-op when hydra
does not run under systemd (no $NOTIFY_SOCKET), and a send that fails is logged once and dropped:
a notify socket that went away must never take the supervisor down.

Who calls what (the daemon, on the event-loop thread or any other thread; sends are locked):
  READY=1 once every engine is health-gated (or at once for a model-less start);
  STATUS=... whenever the one-line state changes; RELOADING=1 on SIGHUP (then READY=1 again);
  STOPPING=1 when a stop begins; WATCHDOG=1 every watchdog_period() while the loop is healthy
  (see `watchdog_loop`: it stops pinging when `alive()` turns false, so systemd restarts hydra).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from hydra_supervisor.serve import states
from hydra_supervisor.serve.snapshot import Snapshot

log = logging.getLogger("hydra.notify")


def _address(raw: str) -> str | None:
    """$NOTIFY_SOCKET as an AF_UNIX address: a path, or '@name' for the abstract namespace."""
    if raw.startswith("@"):
        return "\0" + raw[1:]
    if raw.startswith("/"):
        return raw
    return None  # vsock ("vsock:CID:PORT") and relative paths: not supported, stay silent


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: what RELOADING=1's MONOTONIC_USEC= must carry."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """One process's notify channel. Build it with `from_env()` at startup."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self._addr = _address(socket_path) if socket_path else None
        if socket_path and self._addr is None:
            log.warning("NOTIFY_SOCKET=%r is not a unix socket path; not notifying systemd",
                        socket_path)
        self._watchdog_usec = watchdog_usec
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failed = False
        self._last_status: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, unset: bool = True
                 ) -> Notifier:
        """Read $NOTIFY_SOCKET, $WATCHDOG_USEC and $WATCHDOG_PID; by default remove them from
        os.environ so llama.cpp children (which inherit hydra's environment) never see them:
        only hydra, the main PID, may notify (NotifyAccess=main)."""
        env = os.environ if environ is None else environ
        sock = env.get("NOTIFY_SOCKET") or None
        usec: int | None = None
        raw = env.get("WATCHDOG_USEC")
        pid = env.get("WATCHDOG_PID")
        if raw:
            try:
                usec = int(raw)
            except ValueError:
                log.warning("WATCHDOG_USEC=%r is not a number; no watchdog", raw)
            # The watchdog is for WATCHDOG_PID only (systemd sets it to the main PID).
            if pid and pid.strip() != str(os.getpid()):
                usec = None
            if usec is not None and usec <= 0:
                usec = None
        if unset and environ is None:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        return cls(sock, usec)

    # ------------------------------------------------------------------ state

    @property
    def enabled(self) -> bool:
        """True when hydra runs under systemd with Type=notify."""
        return self._addr is not None

    def watchdog_interval(self) -> float | None:
        """Seconds systemd waits for a WATCHDOG=1 before it kills hydra (WatchdogSec=), or
        None when there is no watchdog for this process."""
        return None if self._watchdog_usec is None else self._watchdog_usec / 1e6

    def watchdog_period(self) -> float | None:
        """How often to ping: half the interval, as sd_watchdog_enabled(3) recommends."""
        interval = self.watchdog_interval()
        return None if interval is None else interval / 2

    # ------------------------------------------------------------------ messages

    def notify(self, *lines: str) -> bool:
        """Send one datagram of KEY=VALUE lines. Returns whether it was sent."""
        if self._addr is None:
            return False
        payload = "\n".join(lines).encode()
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX,
                                               socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.sendto(payload, self._addr)
            except OSError as exc:
                if not self._failed:  # once: a dead socket would otherwise log every ping
                    log.warning("systemd notify to %s failed: %s", self._addr.lstrip("\0"), exc)
                    self._failed = True
                return False
        self._failed = False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *self._status(status))

    def status(self, text: str) -> bool:
        """STATUS=text; the same text twice sends nothing (call it from every change
        listener)."""
        lines = self._status(text, dedupe=True)
        return self.notify(*lines) if lines else False

    def reloading(self, status: str | None = None) -> bool:
        """Begin a reload (SIGHUP). Send ready() when it has finished, failed or not."""
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}",
                           *self._status(status))

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *self._status(status))

    def _status(self, text: str | None, dedupe: bool = False) -> list[str]:
        if not text:
            return []
        line = " ".join(text.split())  # one line: a newline would end the field
        if dedupe and line == self._last_status:
            return []
        self._last_status = line
        return ["STATUS=" + line]

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for `seconds` more before systemd gives up on a start/stop in progress
        (EXTEND_TIMEOUT_USEC): a big model's load may outlast TimeoutStartSec."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def status_text(snap: Snapshot) -> str:
    """One STATUS= line from the daemon's status snapshot: per lane (or lane-less port) its
    profile, state and URL, and why when its port is down, or it is degraded or fatal.
    `systemctl status` shows it."""
    parts = []
    for p in snap.ports:
        if not p.lanes:
            parts.append(f"no profile: {p.word()}" + (f" ({p.down})" if p.down else ""))
        for lane in p.lanes:
            if lane.role == "standby":  # the other layout kept loaded (serve/standby.py)
                parts.append(f"standby {lane.profile}: {lane.state}"
                             + (f" ({lane.why})" if lane.why else ""))
                continue
            line = f"{lane.profile}: {lane.state}"
            if lane.state in states.ANSWERING:
                line += f" at {p.url}"
            why = p.down or lane.fatal or lane.degraded
            if why:
                line += f" ({why})"
            parts.append(line)
    return "; ".join(parts) or "no engines"


async def ready_when(notifier: Notifier, is_ready: Callable[[], bool],
                     status: Callable[[], str] | None = None,
                     stop: asyncio.Event | None = None, poll: float = 0.1) -> bool:
    """Send READY=1 (with the current STATUS=) once `is_ready()` holds; False, sending
    nothing, when `stop` is set first. Run it as a task right after the ports start (the
    daemon's `_ready`: every port's start-up over, and a port's one lane serving or degraded;
    a port with no lane is ready at once)."""
    stop = stop or asyncio.Event()
    while not is_ready():
        try:
            await asyncio.wait_for(stop.wait(), timeout=poll)
            return False
        except TimeoutError:
            pass
    notifier.ready(status() if status else None)
    return True


async def watchdog_loop(notifier: Notifier, alive: Callable[[], bool],
                        stop: asyncio.Event | None = None) -> None:
    """Ping WATCHDOG=1 every watchdog_period() while `alive()` holds; return at once when there
    is no watchdog, and when `stop` is set. Run it as a task on the supervisor's event loop:
    the pings then also prove the loop itself is not stuck.

    When `alive()` is false no ping is sent (it is checked again next period): systemd's
    WatchdogSec then runs out, it kills hydra (SIGABRT) and Restart=on-failure starts it again.
    The daemon's `alive` is e.g. `lambda: all(e.router is None or e.router.alive() for e in
    engines)`.
    """
    period = notifier.watchdog_period()
    if period is None or not notifier.enabled:
        return
    stop = stop or asyncio.Event()
    was_alive = True
    while not stop.is_set():
        ok = alive()
        if ok:
            notifier.watchdog()
        if ok != was_alive:  # log the change, not every period
            if ok:
                log.warning("watchdog: healthy again, pinging systemd")
            else:
                log.warning("watchdog: not pinging systemd (health condition false): systemd "
                            "restarts hydra when WatchdogSec runs out")
            was_alive = ok
        try:
            await asyncio.wait_for(stop.wait(), timeout=period)
        except TimeoutError:
            pass
