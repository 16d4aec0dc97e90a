"""The daemon wired to notify and metrics, end to end on a real `hydra up` (Gemma on the CPU):
READY=1 only once the external port's /health is 200, STATUS= lines, WATCHDOG=1 pings, a
RELOADING=1 ... READY=1 pair on SIGHUP, STOPPING=1 on SIGTERM; and one metrics scrape with
hydra's series, the router's per-request records and the head's llama-server series.

Runs once the daemon makes the calls (it imports `notify`) and serves metrics on
$HYDRA_METRICS_PORT (`hydra up --metrics-port`'s envvar); skipped before that.
"""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from hydra_supervisor.testing.harness import free_port, status_json

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
daemon = pytest.importorskip("hydra_supervisor.runtime.daemon")
if not hasattr(daemon, "notify"):
    pytest.skip("the daemon does not call hydra_supervisor.runtime.notify yet",
                allow_module_level=True)


class Notifications:
    """systemd's side of $NOTIFY_SOCKET: a datagram socket, messages as dicts."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)

    def next(self, timeout: float, skip_watchdog: bool = True) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no notification in time")
            self.sock.settimeout(left)
            msg = dict(line.split("=", 1)
                       for line in self.sock.recv(4096).decode().split("\n"))
            if not (skip_watchdog and msg == {"WATCHDOG": "1"}):
                return msg


def test_notify_and_metrics_on_a_real_hydra_up(hydra_up: Any, hydra_env: dict[str, str],
                                               tmp_path: Path) -> None:
    note = Notifications(str(tmp_path / "notify.sock"))
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    demo = (REPO / "profiles" / "demo.yaml").read_text().replace("profile: demo",
                                                                "profile: demo-ops")
    # --metrics for the head's own series
    (profiles / "demo-ops.yaml").write_text(demo + "  metrics: true\n")
    mport, port = free_port(), free_port()
    hydra_env.update(NOTIFY_SOCKET=note.sock.getsockname(), WATCHDOG_USEC="2000000",
                     HYDRA_METRICS_PORT=str(mport))
    up = hydra_up("--profile", "demo-ops", "--profiles-dir", str(profiles), "--port", str(port))

    msg = note.next(300)
    extended = []
    while msg.get("READY") != "1":
        if "EXTEND_TIMEOUT_USEC" in msg:
            extended.append(int(msg["EXTEND_TIMEOUT_USEC"]))
        msg = note.next(300)
    # before the load: more time than TimeoutStartSec may give (the demo's load timeout + 30 s)
    assert extended and extended[0] >= 60_000_000, extended
    # READY=1 only once the layout serves: the head is READY and the external port answers
    # /health 200 at once (a request held while the model loads would time out here)
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=3).status_code == 200
    st = status_json(hydra_env)
    assert all(p["state"] == "READY" for p in st["status"]["engines"]), st
    assert "demo-ops: serving at" in msg["STATUS"]

    client = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 4}, timeout=120)
    assert client.status_code == 200
    text = requests.get(f"http://127.0.0.1:{mport}/metrics", timeout=30).text
    series = [(s.name, s.labels, s.value)
              for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert any(n == "hydra_http_requests_total" and lv.get("endpoint") == "/v1/chat/completions"
               and v >= 1 for n, lv, v in series)
    assert any(n == "llamacpp:tokens_predicted_total" and lv.get("profile") == "demo-ops"
               and v >= 1 for n, lv, v in series)
    assert any(n == "hydra_process_up" and lv.get("role") == "head" and v == 1
               for n, lv, v in series)

    # the watchdog keeps pinging while the router's acceptor lives
    msg = note.next(5, skip_watchdog=False)
    while msg != {"WATCHDOG": "1"}:
        msg = note.next(5, skip_watchdog=False)

    up.proc.send_signal(signal.SIGHUP)  # systemctl reload
    msg = note.next(60)
    while "RELOADING" not in msg:
        msg = note.next(60)
    assert int(msg["MONOTONIC_USEC"]) > 0
    msg = note.next(300)
    while msg.get("READY") != "1":
        msg = note.next(300)

    up.proc.send_signal(signal.SIGTERM)
    msg = note.next(60)
    while msg.get("STOPPING") != "1":
        msg = note.next(60)
    assert up.proc.wait(60) == 0
