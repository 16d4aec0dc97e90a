"""The router's accept loop out of descriptors (router/acceptor.py): something else in hydra
holds every descriptor the process may open (as an unbounded side port once did, issue 31),
so accept() fails with EMFILE. The acceptor backs off, counts it (`events.accept_failed`) and
logs it, stays alive, and serves the connection that waited in the kernel's backlog once
descriptors are back. A real Router in a child process with RLIMIT_NOFILE 256 and a hog that
takes the rest; every wait has a deadline."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

CHILD = """
import logging, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
from hydra_supervisor.router import Router, Upstreams
r = Router("127.0.0.1", 0, Upstreams())
r.start()
print("port", r.port, flush=True)
hog = []
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("hogged", len(hog), flush=True)
sys.stdin.readline()
for fd in hog:
    os.close(fd)
print("freed", flush=True)
sys.stdin.readline()
print("events", r.stats()["events"], "alive", r.alive(), flush=True)
r.stop()
"""


def test_out_of_descriptors_the_router_waits_logs_and_serves_again() -> None:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    seen: list[str] = []

    def line(prefix: str) -> str:
        """The child's next line starting with `prefix` (its log lines kept in `seen`)."""
        assert proc.stdout is not None
        while text := proc.stdout.readline():
            seen.append(text)
            if text.startswith(prefix):
                return text
        raise AssertionError(f"the child ended before {prefix!r}: {''.join(seen)}")

    try:
        port = int(line("port ").split()[1])
        line("hogged ")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            s.settimeout(1.0)
            try:  # no descriptor to accept it with: it waits in the kernel's backlog
                early = s.recv(100)
            except TimeoutError:
                early = None
            assert early is None, early
            proc.stdin.write("\n")
            proc.stdin.flush()
            line("freed")
            s.settimeout(10)
            reply = s.recv(100)  # accepted now, and answered by the router itself
            assert reply.startswith(b"HTTP/1.1 "), reply
        proc.stdin.write("\n")
        proc.stdin.flush()
        out = "".join(seen) + proc.stdout.read()
        assert proc.wait(10) == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "accept_failed: Too many open files" in out, out
    assert "'accept_failed'" in out and "alive True" in out, out
