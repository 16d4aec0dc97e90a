"""The control API's client side: one request over the state dir's unix socket.

Kept apart from control.py (the server, on the daemon's loop) so that client commands such as
`hydra status` import only this: http.client and a socket.
"""

from __future__ import annotations

import http.client
import json
import socket
from pathlib import Path
from typing import Any

SOCKET_NAME = "control.sock"


class NotRunning(Exception):
    """Nothing answers on the control socket."""


def socket_path(state_root: Path) -> Path:
    """The control socket of the hydra that owns ``state_root``."""
    return state_root / SOCKET_NAME


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def call(path: Path, method: str, route: str, body: dict[str, Any] | None = None,
         timeout: float = 3600.0) -> tuple[int, dict[str, Any]]:
    """One control request; raises NotRunning when no hydra listens on `path`."""
    conn = _UnixConnection(str(path), timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, route, body=data, headers=headers)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NotRunning(str(exc)) from exc
        resp = conn.getresponse()
        raw = resp.read()
        try:
            reply = json.loads(raw) if raw else {}
        except ValueError:
            reply = {"error": raw.decode(errors="replace")}
        return resp.status, reply
    finally:
        conn.close()
