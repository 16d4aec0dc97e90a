"""Between llama-server and a ggml-rpc-server: a TCP relay that counts the bytes each way, and a
wait for the rpc-server to listen; for tests/test_rpccache.py and bench/rpccache.py."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from pathlib import Path

from hydra_supervisor.testing.synthhelp import log_tail

PORT_DEADLINE_S = 30.0


class CountingRelay:
    """A TCP relay that counts the bytes going each way (one connection at a time is enough:
    llama-server opens one to each rpc-server)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.up = 0  # client -> server
        self.down = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = int(self.sock.getsockname()[1])
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                client, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            server = socket.create_connection(self.target, timeout=10)
            for s in (client, server):
                s.settimeout(0.2)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for a, b, way in ((client, server, "up"), (server, client, "down")):
                t = threading.Thread(target=self._pump, args=(a, b, way), daemon=True)
                t.start()
                self.threads.append(t)

    def _pump(self, a: socket.socket, b: socket.socket, way: str) -> None:
        try:
            while not self.stop.is_set():
                try:
                    data = a.recv(1 << 20)
                except TimeoutError:
                    continue
                if not data:
                    break
                b.sendall(data)
                with self.lock:
                    if way == "up":
                        self.up += len(data)
                    else:
                        self.down += len(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=5)
        self.sock.close()


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path,
              timeout: float = PORT_DEADLINE_S) -> None:
    """Until the ggml-rpc-server `proc` listens on `port`; fails with its log if it exits first
    and after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ggml-rpc-server exited with {proc.returncode}:\n"
                                 f"{log_tail(log)}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"ggml-rpc-server not listening after {timeout}s")
