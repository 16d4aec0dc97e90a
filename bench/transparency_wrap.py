"""A stand-in for llama-server that puts hydra's Router in front of the real one.

llama.cpp's server tests (tools/server/tests, run by bench/llama_suite.py) start the binary
named by LLAMA_SERVER_BIN_PATH with llama-server's own arguments. Pointed at a launcher that
runs this script, every test talks to hydra's first-byte router instead of llama-server:

    transparency_wrap.py --server /path/to/llama-server [--log FILE] -- ARGS...

- the real llama-server gets ARGS with ``--port`` replaced by a free internal port and
  ``--host`` by 127.0.0.1 (as hydra runs its head: internal, loopback only);
- a Router binds the host(s) and port the test asked for, built as ``hydra up`` builds a port
  with one profile (hydra_supervisor/serve/port.py Port.open, lane.py Lane.start/sync_gate):
  default knobs, the loopback allow list, ``name="port N"``, a table that sends every request
  to the lane's route without reading bodies (`one_route_table`), the route's requests
  held ("loading model ...") from the moment the port opens until the head answers /health
  200, then ``set_unavailable(None)`` + ``release()``; no metrics callback (``hydra up``
  without ``--metrics-port``), no request defaults;
- it looks like llama-server to the test: the port opens at once, SIGTERM/SIGINT/SIGHUP go to
  llama-server, the wrapper exits when llama-server exits, with its exit status (a signal death
  is re-raised), and SIGKILL of the wrapper takes llama-server with it (PR_SET_PDEATHSIG).

What ``hydra up`` adds beyond the router (the supervisor's periodic /health and completion
probes, restarts) is deliberately left out: those are requests of their own and would change
what llama-server's counters and slots show, so the comparison is of the router alone.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

import hydra_supervisor
from hydra_supervisor.plan.ports import free_port
from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.routes import Route, one_route_table

# What hydra's Port passes (serve/port.py DEFAULT_ALLOW; by value so that this script does not
# depend on serve/'s other imports).
DEFAULT_ALLOW = ("127.0.0.0/8", "::1/128")
INTERNAL_HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1


def split_args(args: Sequence[str]) -> tuple[list[str], int, list[str]]:
    """(llama-server args without --port/--host, the port asked for, the host(s) asked for).
    llama-server's defaults: port 8080, host 127.0.0.1; ``--host a,b`` binds both."""
    rest: list[str] = []
    port = 8080
    hosts = [INTERNAL_HOST]
    it = iter(range(len(args)))
    for i in it:
        a = args[i]
        name, eq, val = a.partition("=")
        if name in ("--port", "--host"):
            if not eq:
                if i + 1 >= len(args):
                    raise SystemExit(f"transparency_wrap: {a} needs a value")
                val = args[i + 1]
                next(it, None)
            if name == "--port":
                port = int(val)
            else:
                hosts = [h.strip() for h in val.split(",") if h.strip()]
            continue
        rest.append(a)
    return rest, port, hosts


# Looked up before any fork: the child runs as little as possible between fork and exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the wrapper dies (as a killed llama-server)."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def health(port: int, timeout: float = 2.0) -> int | None:
    conn = http.client.HTTPConnection(INTERNAL_HOST, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def gate_when_ready(routes: list[Route], proc: subprocess.Popen[bytes], port: int) -> None:
    """What the supervisor does for the head: /health every 50 ms (250 ms after 5 s) until 200,
    then the lane opens its route's gate (Lane.sync_gate on READY)."""
    started = time.monotonic()
    while proc.poll() is None:
        if health(port) == 200:
            for route in routes:
                route.set_unavailable(None)
                route.release()
            return
        time.sleep(0.05 if time.monotonic() - started < 5.0 else 0.25)


def _exit_like(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:  # llama-server died of a signal: so do we
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)
    os._exit(code if code >= 0 else 128 - code)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="the real llama-server binary")
    ap.add_argument("--log", help="append the router's DEBUG log (one line per request) here")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then llama-server's arguments")
    ns = ap.parse_args(argv)
    args = list(ns.args)
    if args[:1] == ["--"]:
        args = args[1:]
    if ns.log:
        handler = logging.FileHandler(ns.log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(message)s"))
        logging.getLogger("hydra.router").addHandler(handler)
        logging.getLogger("hydra.router").setLevel(logging.DEBUG)
        logging.getLogger("hydra.router").info("wrapper: hydra_supervisor from %s",
                                               os.path.dirname(hydra_supervisor.__file__))
    rest, port, hosts = split_args(args)
    internal = free_port(INTERNAL_HOST)

    # The port opens first and its lane holds requests while the model loads (Port.open,
    # Lane.start).
    routers: list[Router] = []
    routes: list[Route] = []
    for host in hosts:
        r = Router(host, port, Upstreams(), allow=DEFAULT_ALLOW, name=f"port {port}")
        route = r.new_route("suite", None, 32)
        route.where = f"port {port}"
        r.table = one_route_table(route)
        route.set_unavailable(None)
        route.hold("loading model for profile suite")
        route.http = (INTERNAL_HOST, internal)
        r.start()
        port = r.port
        routers.append(r)
        routes.append(route)

    env = dict(os.environ)
    if "AIP_HTTP_PORT" in env:  # llama-server's Vertex AI mode listens there instead
        env["AIP_HTTP_PORT"] = str(internal)
    cmd = [ns.server, *rest, "--host", INTERNAL_HOST, "--port", str(internal)]
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)

    def forward(signum: int, _frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    threading.Thread(target=gate_when_ready, args=(routes, proc, internal),
                     daemon=True).start()
    while True:
        try:
            code = proc.wait()
            break
        except InterruptedError:  # pragma: no cover (PEP 475 retries; belt and braces)
            continue

    # llama-server is gone: so is its port. Close ours (bounded) and leave with its status.
    def stop_all() -> None:
        for r in routers:
            r.stop()

    stopper = threading.Thread(target=stop_all, daemon=True)
    stopper.start()
    stopper.join(2.0)
    _exit_like(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
