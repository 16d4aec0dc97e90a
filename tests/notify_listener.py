"""A stand-in for systemd's notify socket: a datagram socket bound where $NOTIFY_SOCKET points
(a path, or an abstract name with a leading NUL), from which a test reads the messages as
systemd would. Used by tests/test_notify.py and tests/test_port_down.py."""

from __future__ import annotations

import socket

DEADLINE = 10.0  # how long a recv waits for the next datagram


class Listener:
    """A datagram socket standing in for systemd's notify socket."""

    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(DEADLINE)

    def recv(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))

    def drain(self) -> list[dict[str, str]]:
        """Every datagram queued right now (no waiting)."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.recv())
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(DEADLINE)
        return out
