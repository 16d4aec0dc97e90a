"""mode: peer -- one hydra lends its device over ggml-RPC through its router; another hydra's
head uses it as a remote peer (two hydras on loopback stand in for two hosts)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import requests

from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.harness import Up, free_port, make_env, run_hydra

pytestmark = pytest.mark.slow


def test_remote_head_uses_a_peer_engine_through_its_router(tmp_path: Path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    env_a = make_env(tmp_path / "a")
    peer_port = free_port()
    a = Up(env_a, ["--profile", "demo-peer", "--port", str(peer_port)], tmp_path / "a")
    b = None
    try:
        st = a.wait_ready()
        (peer,) = st["status"]["engines"]
        assert peer["role"] == "peer" and peer["port"] != peer_port
        assert st["status"]["url"] == f"ggml-rpc://127.0.0.1:{peer_port}"
        assert "llama-server -m MODEL --rpc 127.0.0.1:" in a.output()
        # HTTP on a peer engine: an immediate 503 with a JSON reason, not a hang.
        r = requests.get(f"http://127.0.0.1:{peer_port}/health", timeout=5)
        assert r.status_code == 503 and "error" in r.json()
        # The router passes a HELLO to the local ggml-rpc-server.
        assert rpcproto.probe("127.0.0.1", peer_port).compatible()

        env_b = make_env(tmp_path / "b", f"devices:\n  far:\n    endpoint: 127.0.0.1:{peer_port}\n")
        prof = tmp_path / "b" / "remote.yaml"
        prof.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                        "split: [9, 9]\nserver_args: {ctx-size: 2048, log-verbosity: 4}\n")
        head_port = free_port()
        b = Up(env_b, ["--profile", str(prof), "--port", str(head_port)], tmp_path / "b")
        st_b = b.wait_ready()
        remote, head = st_b["status"]["engines"]
        assert not remote["managed"] and remote["port"] == peer_port and remote["pid"] is None
        r = requests.post(f"http://127.0.0.1:{head_port}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        log = "".join(p.read_text() for p in
                      sorted((Path(env_b["HYDRA_STATE_DIR"]) / "logs").glob("*.head.log")))
        assert re.search(rf"RPC0\[127\.0\.0\.1:{peer_port}\] model buffer size = +\d", log)
        assert "offloaded 10/19 layers" in log
    finally:
        if b is not None:
            b.stop()
            b.kill_everything()
        a.stop()
        a.kill_everything()


def test_peer_engine_refuses_sources_off_its_allow_list(tmp_path: Path):
    env = make_env(tmp_path)
    prof = tmp_path / "closed.yaml"
    prof.write_text("mode: peer\nhead: cpu-peer\nrpc_allow: [10.0.0.0/8]\n")
    port = free_port()
    up = Up(env, ["--profile", str(prof), "--port", str(port)], tmp_path)
    try:
        up.wait_ready()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(rpcproto.HELLO_REQUEST)
            s.settimeout(5)
            assert s.recv(64) == b""  # closed without a byte: 127.0.0.1 is not allowed
    finally:
        up.stop()
        up.kill_everything()


def test_peer_mode_needs_the_router(tmp_path: Path):
    env = make_env(tmp_path)
    prof = tmp_path / "bare.yaml"
    prof.write_text("mode: peer\nhead: cpu-peer\nrouter: false\n")
    res = run_hydra(env, "up", "--profile", str(prof), "--port", str(free_port()))
    assert res.returncode == 2 and "mode: peer needs router: true" in res.stderr


def test_gpu_peer_example_plans_on_a_gpu_host(tmp_path: Path):
    import json

    env = make_env(tmp_path)
    inv = tmp_path / "devices.yaml"
    inv.write_text("gpus:\n  - {index: 0, name: Tesla P100, total_mib: 16384, free_mib: 16000}\n"
                   "cpu: {total_mib: 32768, free_mib: 30000, threads: 8}\n")
    env["HYDRA_DEVICES_FILE"] = str(inv)
    res = run_hydra(env, "plan", "--profile", "gpu-peer", "--json")
    assert res.returncode == 0, res.stderr
    plan = json.loads(res.stdout)
    (peer,) = plan["engines"]
    assert peer["program"] == "ggml-rpc-server" and peer["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert peer["host"] == "127.0.0.1" and "-c" in peer["args"]
    assert plan["router"]["host"] == "0.0.0.0" and plan["router"]["port"] == 30052
    assert plan["router"]["http"] is None
    assert plan["router"]["rpc"] == ["127.0.0.1", peer["port"]]
    assert "192.168.122.0/24" in plan["router"]["allow"]
