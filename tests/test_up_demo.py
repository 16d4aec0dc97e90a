"""`hydra up --profile demo` end to end on the real llama-server and the Gemma model."""

from __future__ import annotations

import signal
import time

import psutil
import pytest
import requests
from openai import OpenAI

from hydra_supervisor.testing.harness import (
    free_port,
    run_hydra,
    snapshot,
    status_json,
    wait_dead,
    wait_until,
)

pytestmark = pytest.mark.slow


def test_demo_serves_chat_status_and_down(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    st = up.wait_ready()
    head = st["status"]["engines"][0]
    assert head["name"] == "demo.head" and head["state"] == "READY"
    # The external port is hydra's router; llama-server listens on an internal loopback port.
    assert st["status"]["url"] == f"http://127.0.0.1:{port}" and head["port"] != port
    assert head["host"] == "127.0.0.1"
    assert f"http://127.0.0.1:{port}" in up.output()
    assert "curl" in up.output()

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8)
    assert reply.choices[0].message.content is not None
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    chunks = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Count"}], max_tokens=8,
        stream=True))
    assert len(chunks) >= 2
    assert any(c.choices and c.choices[0].delta.content for c in chunks)

    table = run_hydra(hydra_env, "status")
    assert table.returncode == 0
    assert "READY" in table.stdout and "head" in table.stdout and str(port) in table.stdout

    pid = head["pid"]
    res = run_hydra(hydra_env, "down")
    assert res.returncode == 0, res.stderr
    assert "stopped profile demo" in res.stdout
    assert up.proc.wait(30) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert run_hydra(hydra_env, "status").returncode == 3


def test_sigterm_stops_every_child(hydra_up):
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready()
    children = list(up.children)
    assert children, "hydra up started no child"
    assert up.stop(signal.SIGTERM) == 0
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive


def test_sigkill_of_hydra_leaves_no_orphan(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready()
    children = list(up.children)

    def is_guard(p: psutil.Process) -> bool:
        try:
            return "hydra_supervisor.proc.guard" in " ".join(p.cmdline())
        except psutil.Error:
            return False

    guards = [p for p in children if is_guard(p)]
    served = [p for p in children if p not in guards]
    assert guards and served
    up.proc.kill()
    up.proc.wait(5)
    t0 = time.monotonic()
    alive = wait_dead(served, timeout=2.0)
    assert not alive, f"orphans after SIGKILL of hydra up: {alive}"
    assert time.monotonic() - t0 <= 2.0
    # hydra's orphan guard stops what the death signal missed, then exits itself
    assert not wait_dead(guards, timeout=15.0)
    # The port is free again and a new hydra up starts cleanly on it.
    up2 = hydra_up("--profile", "demo", "--port", str(port))
    up2.wait_ready()
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    assert status_json(hydra_env)["status"]["engines"][0]["state"] == "READY"


def test_second_up_is_refused_while_running(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready()
    res = run_hydra(hydra_env, "up", "--profile", "demo", "--port", str(free_port()))
    assert res.returncode == 2
    assert "already running" in res.stderr and "hydra down" in res.stderr


def test_wait_until_has_deadline():
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(lambda: False, 0.2, "nothing")


def test_router_holds_requests_while_head_is_down_and_closes_rpc(hydra_up, hydra_env):
    import os
    import socket

    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    st = up.wait_ready()
    head = st["status"]["engines"][0]
    os.kill(head["pid"], signal.SIGKILL)
    # While the head is down and restarting, a new request is held by the router and served
    # once the head is back (not refused, not a 503).
    r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert up.engine("demo.head")["pid"] != head["pid"]
    wait_until(lambda: status_json(hydra_env)["status"]["engines"][0]["state"] == "READY"
               and status_json(hydra_env)["status"]["engines"][0]["pid"] != head["pid"], 60,
               "head back")
    # ggml-RPC on the external port: closed at once (no local peer is offered to outsiders).
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"\x0e" + bytes(32))
        s.settimeout(5)
        assert s.recv(16) == b""


def test_router_off_binds_llama_server_directly(hydra_up, hydra_env, tmp_path):
    from hydra_supervisor.config.paths import repo_root

    prof = tmp_path / "direct.yaml"
    prof.write_text((repo_root() / "profiles" / "demo.yaml").read_text() + "router: false\n")
    port = free_port()
    up = hydra_up("--profile", str(prof), "--port", str(port))
    st = up.wait_ready()
    assert st["status"]["engines"][0]["port"] == port
    assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200


def test_status_shows_memory_and_recent_requests(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo", "--port", str(port))
    up.wait_ready()
    status_json(hydra_env)  # a first sample of the request counter
    for _ in range(2):
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 2})
        assert r.status_code == 200
    time.sleep(1.1)
    port = snapshot(hydra_env).ports[0]
    lane = port.lanes[0]
    head = lane.processes[0]
    assert (head.rss_bytes or 0) > 10 * 2**20  # the model is mapped in
    assert port.router is not None and port.router.http["requests"] >= 2
    assert (lane.requests_last_min or 0) >= 2
    text = run_hydra(hydra_env, "status").stdout
    assert " MiB" in text and "in the last minute" in text, text
