"""The running hydra as client commands find it: its snapshot, read over the state dir's control
socket, and what a command needs from it (the port that serves a profile, its default profile,
the head's own address, what it serves now in words).

Client commands (`bench`, `configure`, `up`'s "already running", ...) ask here instead of
guessing from a profile's `port:` or 8080: the daemon knows the ports it bound (`--port`
overrides, several profiles on one port, `--port 0`). Nothing here imports the daemon.
"""

from __future__ import annotations

import http.client
from dataclasses import dataclass

from hydra_supervisor.plan.ports import client_host
from hydra_supervisor.proc.state import StateDir
from hydra_supervisor.runtime import control_client
from hydra_supervisor.serve import states
from hydra_supervisor.serve.snapshot import LaneStatus, PortStatus, Snapshot


def snapshot(state: StateDir | None = None, timeout: float = 10.0) -> Snapshot | None:
    """The running hydra's snapshot; None when no hydra answers in this state dir (not running,
    or still starting: its control socket opens with its ports)."""
    st = state or StateDir.default()
    try:
        code, reply = control_client.call(control_client.socket_path(st.root), "GET",
                                          "/status", timeout=timeout)
    except (control_client.NotRunning, OSError, http.client.HTTPException):
        return None  # not running, or it went away mid-reply
    if code != 200:
        return None
    return Snapshot.from_json(reply.get("daemon"))


@dataclass(frozen=True)
class Served:
    """A profile the running hydra serves: its port and its lane."""

    port: PortStatus
    lane: LaneStatus

    @property
    def url(self) -> str:
        return self.port.url.rstrip("/")

    def head_url(self) -> str | None:
        """The lane's head llama-server at its internal address, when it is ready (the
        router bypassed: `hydra bench --plot`'s direct leg)."""
        head = next((p for p in self.lane.processes
                     if p.role == "head" and p.state == "READY" and p.port), None)
        if head is None:
            return None
        host = client_host(head.host or "127.0.0.1")
        return f"http://{f'[{host}]' if ':' in host else host}:{head.port}"


def http_ports(snap: Snapshot) -> list[PortStatus]:
    """The ports that answer HTTP (not a peer's ggml-RPC port)."""
    return [p for p in snap.ports
            if not p.lanes or any(x.mode != "peer" for x in p.lanes)]


def port_named(snap: Snapshot, port: int) -> PortStatus | None:
    return next((p for p in snap.ports if p.port == port), None)


def find(snap: Snapshot, profile: str, port: int | None = None) -> Served | None:
    """The active lane that serves `profile` (its name or an alias), on `port` when given."""
    for p in snap.ports:
        if port is not None and p.port != port:
            continue
        for x in p.active():
            if profile == x.profile or profile in x.aliases:
                return Served(p, x)
    return None


def default_of(snap: Snapshot, port: int | None = None) -> Served | None:
    """What a request without a model reaches: the default lane of `port` (or of the only
    HTTP port; with several, the first). None when that port has no default profile."""
    ports = [p for p in http_ports(snap) if port is None or p.port == port]
    if not ports:
        return None
    p = ports[0]
    active = p.active()
    lane = next((x for x in active if x.profile == p.default), None) or \
        (active[0] if len(active) == 1 else None)
    return Served(p, lane) if lane is not None else None


def serving_words(snap: Snapshot) -> str:
    """What it serves now, in words: `profile demo`, `profiles demo, demo-moe`, or `no
    profile`; after a switch, the profile switched to, not the one it started with."""
    names = [x.profile for p in snap.ports for x in p.active()
             if x.state not in states.NOT_LOADED]
    if not names:
        return "no profile loaded"
    return f"profile{'s' if len(names) > 1 else ''} {', '.join(names)}"


def where(snap: Snapshot) -> str:
    """Its ports and what each serves, for an error message: `http://127.0.0.1:8080 (demo)`."""
    return "; ".join(f"{p.url} ({', '.join(p.profiles) or 'no profile'})" for p in snap.ports)
