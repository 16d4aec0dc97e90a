"""The scale-out recipe (docs/multi-host.md, "Scale-out"): two hydra hosts behind HAProxy with
active checks on /health, in network namespaces (testing/netns.py); the config tested is the one
in the doc. One host's hydra is killed while clients send completions through the balancer:
they keep being served (failures counted and printed), the dead host is marked down, and once
it is back the balancer sends it traffic again.

Skipped, with the reason printed, where namespaces cannot be made or haproxy is not installed
(scripts/test installs Debian's haproxy where it runs as root with apt).
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from hydra_supervisor.testing.harness import REPO, make_env, wait_until
from hydra_supervisor.testing.netns import Hosts, NsUp, why_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT, LB_PORT = 8080, 8000
LOAD_TIMEOUT_S = 120.0  # a client gives up on one completion after this
SOLO = ("model: gemma3-270m\nmode: solo\nhead: cpu\nhost: 0.0.0.0\n"
        f"port: {PORT}\nserver_args: {{ctx-size: 1024, parallel: 2, threads: 1,"
        " chat-template: gemma, no-jinja: true, n-predict: 8}\n")


def doc_config(servers: list[str], stats: Path) -> str:
    """The HAProxy config in docs/multi-host.md, its two servers replaced by ours, plus a
    runtime socket for the test to read the servers' states."""
    doc = (REPO / "docs" / "multi-host.md").read_text()
    section = doc.split("## Scale-out", 1)[1]
    cfg = re.search(r"```haproxy\n(.*?)```", section, re.S)
    assert cfg, "no ```haproxy block in docs/multi-host.md's Scale-out section"
    text = cfg.group(1)
    addrs = re.findall(r"^\s*server \S+ (\S+)$", text, re.M)
    assert len(addrs) == 2, addrs
    for old, new in zip(addrs, servers, strict=True):
        text = text.replace(f" {old}\n", f" {new}\n")
    text = text.replace("global\n", f"global\n    stats socket {stats} mode 600 level admin\n"
                        "    log stderr format raw local0 info\n", 1)
    return text.replace("defaults\n", "defaults\n    log global\n    option httplog\n", 1)


def skip_unless_ready() -> None:
    why = why_unavailable()
    if why is None and shutil.which("haproxy") is None:
        why = "haproxy is not installed (apt-get install haproxy; scripts/test does as root)"
    if why:
        print(f"\nSKIP tests/test_multihost_lb.py: {why}", file=sys.__stderr__)
        pytest.skip(why)


@pytest.fixture
def net() -> Iterator[Hosts]:
    skip_unless_ready()
    with Hosts(["a", "b", "lb"]) as hosts:
        yield hosts


def _server_states(net: Hosts, sock: Path, column: int = 17) -> dict[str, str]:
    """{server: UP|DOWN|...} from HAProxy's runtime API (`show stat`, CSV; column 17 is the
    status, 7 the sessions served)."""
    def ask() -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(sock))
            s.sendall(b"show stat\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()
    out = {}
    for line in ask().splitlines():
        cols = line.split(",")
        if len(cols) > 17 and cols[0] == "hydra_hosts" and cols[1] not in ("BACKEND",):
            out[cols[1]] = cols[column]
    return out


class Load:
    """Clients sending completions back to back through the balancer until stopped."""

    def __init__(self, net: Hosts, n: int) -> None:
        self.outcomes: list[tuple[float, str]] = []
        self.errors: list[tuple[float, str]] = []
        self.failed: list[tuple[float, str, float]] = []  # (start, error, end)
        self.answers: list[tuple[float, str]] = []  # non-200 answers, with their bodies
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [net.thread("lb", self._run, name=f"client{i}") for i in range(n)]

    def _run(self) -> None:
        s = requests.Session()
        while not self.stop.is_set():
            t = time.monotonic()
            try:
                r = s.post(f"http://127.0.0.1:{LB_PORT}/completion", timeout=LOAD_TIMEOUT_S,
                           json={"prompt": "Hello", "n_predict": 4})
                ok = r.status_code == 200 and r.json().get("tokens_predicted") == 4
                out = "ok" if ok else f"HTTP {r.status_code}"
                if not ok:  # who answered it, for the failure message
                    self.answers.append((t, f"{out} after {time.monotonic() - t:.2f}s: "
                                            f"{r.text[:200]!r}"))
            except requests.RequestException as exc:
                out = type(exc).__name__
                self.errors.append((t, f"after {time.monotonic() - t:.2f}s: {exc!r:.300}"))
                self.failed.append((t, type(exc).__name__, time.monotonic()))
                s = requests.Session()
            with self.lock:
                self.outcomes.append((t, out))

    def count(self, since: float = 0.0, until: float = float("inf")) -> Counter[str]:
        with self.lock:
            return Counter(o for t, o in self.outcomes if since <= t < until)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


@pytest.mark.parametrize("fault", ["kill", "crash"])
def test_two_hydra_hosts_behind_haproxy_one_lost(net: Hosts, tmp_path: Path, fault: str) -> None:
    """kill: host a's hydra SIGKILLed (its connections refused or closed), then started again;
    crash: host a's link cut (no RST, no FIN: power or cable), then restored."""
    ups: dict[str, NsUp] = {}
    for h in ("a", "b"):
        (tmp_path / h).mkdir()
    envs = {h: make_env(tmp_path / h) for h in ("a", "b")}
    prof = tmp_path / "solo.yaml"
    prof.write_text("profile: solo\n" + SOLO)
    stats = tmp_path / "haproxy.sock"
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(doc_config([f"{net.addr(h)}:{PORT}" for h in ("a", "b")], stats))
    check = subprocess.run(["haproxy", "-c", "-f", str(cfg)], capture_output=True, text=True,
                           timeout=30, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    lb: subprocess.Popen[bytes] | None = None
    load: Load | None = None
    try:
        for h in ("a", "b"):
            ups[h] = NsUp(net, h, envs[h], ["--profile", str(prof)], tmp_path / h)
        for h in ("a", "b"):
            ups[h].wait_ready(180)
        lb = net.popen("lb", ["haproxy", "-db", "-f", str(cfg)],
                       stdout=(tmp_path / "haproxy.log").open("w"), stderr=subprocess.STDOUT)
        wait_until(lambda: stats.exists() and _server_states(net, stats) == {
            "hydra1": "UP", "hydra2": "UP"}, 30, "both hosts UP at the balancer")

        load = Load(net, 2)
        wait_until(lambda: load is not None and load.count()["ok"] >= 6, 120,
                   "completions served through the balancer")
        t_kill = time.monotonic()
        if fault == "kill":
            ups["a"].proc.send_signal(signal.SIGKILL)  # hydra a gone; its guard stops its head
            ups["a"].proc.wait(10)
        else:
            net.cut("a")
        # A request sent between the signal and the process's end (its sockets close as it
        # exits) met host a still there: it was in flight at the fault, not sent after it.
        t_gone = time.monotonic()
        wait_until(lambda: _server_states(net, stats).get("hydra1") == "DOWN", 30,
                   "host a marked DOWN", interval=0.1)
        marked_down = time.monotonic() - t_kill
        served_after = load.count()["ok"]
        wait_until(lambda: load is not None and load.count()["ok"] >= served_after + 6, 120,
                   "completions served by host b alone")

        # host a back (its service manager restarts hydra, or its cable is plugged in again):
        # in rotation again once it serves
        t_back = time.monotonic()
        if fault == "kill":
            ups["a"].out.close()
            ups["a"].err.close()
            ups["a"] = NsUp(net, "a", envs["a"], ["--profile", str(prof)], tmp_path / "a")
            ups["a"].wait_ready(180)
        else:
            net.restore("a")
        wait_until(lambda: _server_states(net, stats).get("hydra1") == "UP", 60,
                   "host a UP again at the balancer", interval=0.1)
        back_up = time.monotonic() - t_back
        served_a = int(_server_states(net, stats, 7)["hydra1"])
        wait_until(lambda: int(_server_states(net, stats, 7)["hydra1"]) > served_a + 2, 60,
                   "host a taking requests again")
        load.finish()
        during = load.count(t_gone, t_back)
        total = load.count()
        log = (tmp_path / "haproxy.log").read_text(errors="replace")
        assert lb.poll() is None, log
        print(f"\nLB ({fault}): host a marked DOWN after {marked_down:.1f}s; outcomes while "
              f"it was away: {dict(during)}; whole run: {dict(total)}; host a back in rotation "
              f"{back_up:.1f}s after its {'hydra restarted' if fault == 'kill' else 'restore'}"
              f"; errors (s from the fault): "
              f"{[(round(t - t_kill, 2), e) for t, e in load.errors]}")
        # What HAProxy 2.6 gives (docs/multi-host.md): every request that started after the
        # fault is served (refused connects, connect timeouts and empty answers go to host b);
        # the one request in flight on host a when it went may come back as a closed
        # connection — after a crash within a few seconds (shutdown-sessions when the check
        # marks host a down), not after `timeout server`. After a crash, one request sent in the
        # seconds before the check fails may have every connect retry land on host a (leastconn
        # prefers the host with no connections; its SYNs go unanswered) and be closed by
        # shutdown-sessions when a is marked down: at most one such (once in 5 runs, CI).
        may_lose = 1 if fault == "crash" else 0
        late = [e for t, e in load.errors if t >= t_gone]
        assert len(late) <= may_lose, (late, log[-3000:])
        assert len(load.errors) <= 1, (load.errors, log[-3000:])
        assert all(t_end - t < marked_down + 5.0 for t, _, t_end in load.failed), load.errors
        assert during["ok"] > 0
        assert sum(n for o, n in during.items() if o != "ok") <= may_lose, (
            during, [(round(t - t_kill, 3), a) for t, a in load.answers],
            f"host a gone {t_gone - t_kill:.3f}s after the fault", log[-3000:])
        for h, up in ups.items():  # nothing left on either host once its hydra stops
            assert up.stop() == 0, up.output()[-2000:]
            wait_until(lambda h=h: not net.pids(h), 15,
                       f"no process left on host {h}")
    finally:
        if load is not None:
            load.finish()
        if lb is not None:
            lb.terminate()
            lb.wait(10)
        for up in ups.values():
            if up.proc.poll() is None:
                up.stop()
            up.kill_everything()
