"""2,000 idle connections to a real `hydra up -p demo --metrics-port M` (issue 31: they took an
earlier hydra to 1,171 threads, out of descriptors, and to a quiet exit 0): hydra serves on
through them — a chat request through the router answers, `hydra status` answers — its threads
stay flat and its descriptors bounded (runtime/sideport.py), and once they are gone the
dashboard page loads and /metrics scrapes. hydra runs under `prlimit --nofile=1024` (systemd's
default soft limit), so an unbounded side port would run it out of descriptors. The figures
(threads and descriptors before, with and after) are printed; docs/dashboard.md quotes them.
Every wait has a deadline."""

from __future__ import annotations

import contextlib
import json
import resource
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import psutil
import pytest

from hydra_supervisor.testing.harness import Up, free_port, make_env, run_hydra, wait_until

pytestmark = pytest.mark.slow

N = 2000
NOFILE = 1024


def usage(pid: int) -> tuple[int, int]:
    p = psutil.Process(pid)
    return p.num_threads(), p.num_fds()


def chat(port: int) -> int:
    body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        json.load(r)
        return int(r.status)


def page(mport: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/", timeout=10) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def _end(up: Up, socks: list[socket.socket]) -> None:
    """A test's clients closed, its hydra stopped and nothing of it left running."""
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()
    if up.proc.poll() is None:
        up.stop()
    up.kill_everything()


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="no prlimit (util-linux)")
def test_two_thousand_idle_connections_leave_hydra_serving(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < N + 200:
        pytest.skip(f"the test needs {N + 200} descriptors for its clients (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, N + 200), hard))
    env = make_env(tmp_path)
    port, mport = free_port(), free_port()
    up = Up(env, ["-p", "demo", "--port", str(port), "--metrics-port", str(mport)], tmp_path,
            launcher=["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"])
    socks: list[socket.socket] = []
    try:
        up.wait_ready(180)
        pid = up.proc.pid
        assert chat(port) == 200
        assert page(mport) is not None
        before = usage(pid)
        refused = 0
        for _ in range(N):
            s = socket.socket()
            s.settimeout(10)
            try:
                s.connect(("127.0.0.1", mport))
            except OSError:  # the kernel's backlog full for a moment: counted, not a failure
                refused += 1
                s.close()
                continue
            socks.append(s)
        with_them = usage(pid)
        # serving through them
        assert chat(port) == 200
        st = run_hydra(env, "status", timeout=60)
        assert st.returncode == 0, st.stdout + st.stderr
        with_them = max(with_them, usage(pid))
        threads0, fds0 = before
        assert with_them[0] <= threads0 + 2, (before, with_them)
        # the side port's bound (sideport.py: 64 open + 16 told 503 + 64 in one accept batch,
        # + as many evicted by that batch whose sockets close on the loop's next turn)
        assert with_them[1] <= fds0 + 64 + 16 + 64 + 64 + 8, (before, with_them)
        for s in socks:
            s.close()
        socks = []
        html = wait_until(lambda: page(mport), 30, "the dashboard page after the connections")
        assert '<meta name="hydra-token"' in html and "__HYDRA_TOKEN__" not in html
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30) as r:
            assert b"hydra_info" in r.read()
        after = wait_until(lambda: (u := usage(pid))[1] <= fds0 + 4 and u, 30,
                           "hydra's descriptors back to where they were")
        print(f"\nhydra under nofile {NOFILE}, {N} idle connections to the metrics port "
              f"({len(socks) or N - refused} connected, {refused} not): threads/descriptors "
              f"before {before[0]}/{before[1]}, with them {with_them[0]}/{with_them[1]}, "
              f"after {after[0]}/{after[1]}")
        assert up.proc.poll() is None
        assert up.stop() == 0
        log = (Path(env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
        assert "Traceback" not in log, log[-3000:]
        assert "stopped: SIGTERM" in log
    finally:
        _end(up, socks)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="no prlimit (util-linux)")
def test_out_of_descriptors_hydra_degrades_logs_and_serves_on(tmp_path: Path) -> None:
    """A running hydra whose open-file limit is lowered (prlimit --pid) to a few above what
    it holds, then run out by connections to its metrics port: its supervisor's watch (which
    reads /proc) and both accept loops fail with EMFILE. hydra says so and waits; nothing
    stops, nothing exits; once the limit is back, the same connections gone, it serves a chat
    request, answers `hydra status` (serving) and stops with exit 0 when asked."""
    env = make_env(tmp_path)
    port, mport = free_port(), free_port()
    up = Up(env, ["-p", "demo", "--port", str(port), "--metrics-port", str(mport)], tmp_path)
    socks: list[socket.socket] = []
    log = Path(env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log"
    try:
        up.wait_ready(180)
        pid = up.proc.pid
        _, fds = usage(pid)
        subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={fds + 8}:{NOFILE}"], check=True)
        failed = 0
        while len(socks) < 200 and failed < 3:  # past the kernel's backlog connects time out
            try:
                socks.append(socket.create_connection(("127.0.0.1", mport), timeout=1))
            except OSError:
                failed += 1
        wait_until(lambda: "cannot accept connections (Too many open files)" in log.read_text(),
                   30, "hydra to say it is out of descriptors")
        wait_until(lambda: "watching failed" in log.read_text(), 60,
                   "the supervisor's watch to fail for want of descriptors, and say so")
        assert up.proc.poll() is None
        subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={NOFILE}:{NOFILE}"], check=True)
        for s in socks:
            s.close()
        socks = []
        assert chat(port) == 200
        st = run_hydra(env, "status", "--json", timeout=60)
        assert st.returncode == 0, st.stdout + st.stderr
        assert json.loads(st.stdout)["status"]["state"] == "serving"
        wait_until(lambda: page(mport), 30, "the dashboard page")
        assert up.proc.poll() is None
        assert up.stop() == 0
        text = log.read_text()
        assert "the processes serve on" in text and "stopped: SIGTERM" in text
        assert "FATAL" not in text, text[-3000:]
    finally:
        _end(up, socks)
