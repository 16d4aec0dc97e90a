"""COMBINE on real processes: demo-combine (dense layer split) and demo-moe-combine (experts on
the peer), the peer-loss recovery, and the bad-input cases of multi-process layouts."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from pathlib import Path

import psutil
import pytest
import requests
from openai import OpenAI

from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.harness import free_port, run_hydra, status_json, wait_until
from tests.rpc_fakes import encode_hello_response

pytestmark = pytest.mark.slow


def _log(env: dict[str, str], engine: str) -> str:
    return (Path(env["HYDRA_STATE_DIR"]) / "logs" / f"{engine}.log").read_text(errors="replace")


def _chat(port: int) -> str:
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)
    reply = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Hello"}], max_tokens=8)
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    return reply.choices[0].message.content or ""


def test_demo_combine_splits_layers_onto_the_peer(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo-combine", "--port", str(port))
    st = up.wait_ready()
    peer, head = st["status"]["engines"]
    assert (peer["role"], head["role"]) == ("peer", "head")
    _chat(port)
    log = _log(hydra_env, f"{head['name']}")
    endpoint = f"127.0.0.1:{peer['port']}"
    # 9 blocks + the output layer on the peer, the other 9 blocks on the head's CPU.
    assert "offloaded 10/19 layers" in log
    assert re.search(rf"RPC0\[{re.escape(endpoint)}\] model buffer size = +\d", log)


def test_demo_moe_combine_puts_experts_on_the_peer(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo-moe-combine", "--port", str(port))
    st = up.wait_ready()
    peer = st["status"]["engines"][0]
    res = requests.post(f"http://127.0.0.1:{port}/completion",
                        json={"prompt": "Hello", "n_predict": 8}, timeout=60)
    assert res.status_code == 200 and res.json()["tokens_predicted"] == 8
    log = _log(hydra_env, "demo-moe-combine.head")
    m = re.search(rf"RPC0\[127\.0\.0\.1:{peer['port']}\] model buffer size = +([\d.]+) MiB", log)
    assert m, "no model buffer on the RPC device"
    # Exactly the expert tensors: 8 layers x 3 x (8 experts x 256 x 256) f16 = 24 MiB.
    assert float(m.group(1)) == pytest.approx(24.0, abs=0.1)
    assert "offloaded 0/9 layers" in log


def test_peer_killed_mid_stream_restarts_pair(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo-combine", "--port", str(port))
    st = up.wait_ready()
    peer_pid = st["status"]["engines"][0]["pid"]
    old_head = st["status"]["engines"][1]["pid"]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=30,
                    max_retries=0)
    got_first = threading.Event()

    def stream() -> None:
        try:
            for _ in client.chat.completions.create(
                    model="x", messages=[{"role": "user", "content": "Tell a story"}],
                    max_tokens=400, stream=True):
                got_first.set()
        except Exception:  # noqa: BLE001 - the stream is expected to break; we only drive it
            got_first.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert got_first.wait(30)
    os.kill(peer_pid, signal.SIGKILL)
    t.join(30)

    def recovered() -> bool:
        engines = status_json(hydra_env)["status"]["engines"]
        return all(e["state"] == "READY" for e in engines) and engines[0]["pid"] != peer_pid \
            and engines[1]["pid"] != old_head
    wait_until(recovered, 60, "peer and head restarted")
    assert not psutil.pid_exists(old_head) or \
        psutil.Process(old_head).status() == psutil.STATUS_ZOMBIE
    _chat(port)
    engines = status_json(hydra_env)["status"]["engines"]
    assert engines[0]["restarts"] == 1


def test_head_killed_restarts_head_only(hydra_up, hydra_env):
    port = free_port()
    up = hydra_up("--profile", "demo-combine", "--port", str(port))
    st = up.wait_ready()
    peer_pid, head_pid = (e["pid"] for e in st["status"]["engines"])
    os.kill(head_pid, signal.SIGKILL)

    def head_back() -> bool:
        peer, head = status_json(hydra_env)["status"]["engines"]
        return head["state"] == "READY" and head["pid"] != head_pid
    wait_until(head_back, 60, "head restarted")
    peer, head = status_json(hydra_env)["status"]["engines"]
    assert peer["pid"] == peer_pid and peer["restarts"] == 0
    _chat(port)


def _node_with_remote(hydra_env: dict[str, str], tmp_path: Path, endpoint: str) -> None:
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"devices:\n  far:\n    endpoint: {endpoint}\n")


def _remote_profile(tmp_path: Path) -> Path:
    path = tmp_path / "remote.yaml"
    path.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                    "split: [9, 9]\n")
    return path


def test_unreachable_remote_peer(hydra_env, tmp_path):
    dead = free_port()
    _node_with_remote(hydra_env, tmp_path, f"127.0.0.1:{dead}")
    res = run_hydra(hydra_env, "up", "--profile", str(_remote_profile(tmp_path)),
                    "--port", str(free_port()))
    assert res.returncode == 2
    assert f"remote peer far at 127.0.0.1:{dead} is unreachable" in res.stderr
    assert "ggml-rpc-server -H 0.0.0.0" in res.stderr


def test_rpc_protocol_mismatch_is_refused(hydra_env, tmp_path):
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def answer() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                conn.sendall(encode_hello_response(rpcproto.Version(6, 1, 0)))

    threading.Thread(target=answer, daemon=True).start()
    try:
        _node_with_remote(hydra_env, tmp_path, f"127.0.0.1:{port}")
        res = run_hydra(hydra_env, "up", "--profile", str(_remote_profile(tmp_path)),
                        "--port", str(free_port()))
    finally:
        srv.close()
    assert res.returncode == 2
    assert "speaks ggml-RPC protocol 6.1.0" in res.stderr and "7.0.x" in res.stderr


def test_head_killed_under_traffic_keeps_its_peer(hydra_up, hydra_env):
    """kill -9 of a COMBINE head while requests stream through it: its ggml-rpc-server (which
    used to die of SIGPIPE writing to the dead head, 5 of 8 kills) keeps its pid, the head
    alone restarts and reuses it, no request that had not started fails. Prints kill → READY
    and kill → the next answer (docs/supervision.md)."""
    import time

    from hydra_supervisor.testing.harness import snapshot
    from hydra_supervisor.testing.load import Load

    up = hydra_up("--profile", "demo-combine", "--port", "0")
    up.wait_ready()
    port = snapshot(hydra_env).ports[0].port
    peer_pid = up.engine("peer-cpu-peer")["pid"]
    took = []
    with Load(port) as load:
        wait_until(lambda: load.ok >= 2, 60, "first requests served")
        for phase in (0.8, 0.5, 0.2):
            head_pid = up.engine("head")["pid"]
            # kill it mid-token of a long stream: while its peer computes the next token and
            # is about to send the logits (the write that used to die of SIGPIPE)
            chunks = threading.Semaphore(0)
            times: list[float] = []

            def stream(chunks: threading.Semaphore = chunks, times: list[float] = times
                       ) -> None:
                client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                timeout=60, max_retries=0)
                try:
                    for _ in client.chat.completions.create(
                            model="x", messages=[{"role": "user", "content": "Tell a story"}],
                            max_tokens=200, stream=True):
                        times.append(time.monotonic())
                        chunks.release()
                except Exception:  # noqa: BLE001 - cut by the kill: expected
                    chunks.release()
            threading.Thread(target=stream, daemon=True).start()
            for _ in range(4):
                assert chunks.acquire(timeout=60), "the stream's first tokens"
            assert len(times) >= 4, "the stream ended early"
            time.sleep((times[3] - times[2]) * phase)  # into the next token, at its pace
            n = load.ok
            os.kill(head_pid, signal.SIGKILL)
            t0 = time.monotonic()
            wait_until(lambda p=head_pid: (e := up.engine("head"))["state"] == "READY"
                       and e["pid"] not in (None, p), 120, "head restarted", interval=0.05)
            ready = time.monotonic() - t0
            wait_until(lambda n=n: load.ok > n, 120, "a request served after the kill",
                       interval=0.05)
            took.append((ready, time.monotonic() - t0))
            peer = up.engine("peer-cpu-peer")
            assert peer["pid"] == peer_pid and peer["state"] == "READY", peer
            assert peer["restarts"] == 0 and psutil.pid_exists(peer_pid)
    assert load.failures == [], load.failures
    head = up.engine("head")
    assert head["restarts"] == 3 and head["last_exit"] == -signal.SIGKILL, head
    print("kill -9 head -> READY / next answer (s):",
          ", ".join(f"{r:.2f} / {a:.2f}" for r, a in took))
