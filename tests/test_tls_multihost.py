"""ggml-RPC across a network you do not trust (issue 32 item 7), with real binaries: a peer
hydra whose profile has tls: (its router takes TLS only) and a head hydra whose remote device
has tls: (its own probes speak TLS; its llama-server's --rpc goes through a local tunnel), two
hydras on loopback standing in for two hosts, certificates made by the openssl CLI.

- the COMBINE serves completions (200), its head's --rpc names the tunnel, not the peer;
- a plain ggml-RPC client to the TLS peer is closed without a byte;
- a head whose certificate another CA signed is refused at `hydra up` with error:/fix:;
- `hydra doctor --peers` speaks TLS to the peer (and says what TLS refused).
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest
import requests

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.harness import Up, free_port, make_env, run_hydra, status_json
from hydra_supervisor.testing.tlscerts import make_certs, openssl_missing
from hydra_supervisor.tools import buildid

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))]


def _tls_yaml(f: TlsFiles) -> str:
    return f"{{ca: '{f.ca}', cert: '{f.cert}', key: '{f.key}'}}"


def _peer(tmp: Path, files: TlsFiles) -> tuple[Up, int]:
    (tmp / "peer").mkdir()
    prof = tmp / "peer" / "lend.yaml"
    prof.write_text("profile: lend\nmode: peer\nhead: cpu-peer\nrpc_allow: [127.0.0.0/8]\n"
                    f"tls: {_tls_yaml(files)}\n")
    port = free_port()
    up = Up(make_env(tmp / "peer"), ["--profile", str(prof), "--port", str(port)], tmp / "peer")
    return up, port


def _head_env(tmp: Path, peer_port: int, files: TlsFiles) -> dict[str, str]:
    return make_env(tmp, f"devices:\n  far:\n    endpoint: 127.0.0.1:{peer_port}\n"
                    f"    tls: {_tls_yaml(files)}\n")


def _combine(tmp: Path) -> Path:
    prof = tmp / "remote.yaml"
    prof.write_text("model: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
                    "split: [9, 9]\nserver_args: {ctx-size: 2048, chat-template: gemma, "
                    "log-verbosity: 4}\n")
    return prof


def test_combine_over_tls_serves_and_plain_is_refused(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["peer", "head"])
    peer, peer_port = _peer(tmp_path, certs["peer"])
    head = None
    try:
        peer.wait_ready()
        # plain ggml-RPC to the TLS-only port: closed without a byte (a reset: its HELLO
        # was left unread)
        with socket.create_connection(("127.0.0.1", peer_port), timeout=5) as s:
            s.sendall(rpcproto.HELLO_REQUEST)
            s.settimeout(5)
            try:
                assert s.recv(64) == b""
            except ConnectionResetError:
                pass
        # hydra's own HELLO over TLS reaches the peer's ggml-rpc-server, and its INFO the
        # peer's wire server (handed the TLS socket by the router)
        assert rpcproto.probe("127.0.0.1", peer_port, timeout=5,
                              tls=certs["head"]).compatible()
        info = buildid.ask_info("127.0.0.1", peer_port, timeout=5, tls=certs["head"])
        assert info.hydra and info.identity is not None, info.note

        (tmp_path / "head").mkdir()
        env = _head_env(tmp_path / "head", peer_port, certs["head"])
        doc = run_hydra(env, "doctor", "--peers")  # INFO and HELLO over TLS, before the head
        assert doc.returncode == 0, doc.stdout + doc.stderr
        plan = run_hydra(env, "plan", "--profile", str(_combine(tmp_path / "head")))
        assert plan.returncode == 0 and "over TLS" in plan.stdout, plan.stdout + plan.stderr
        assert "TLS only" in peer.output()  # its ready line
        port = free_port()
        head = Up(env, ["--profile", str(_combine(tmp_path / "head")), "--port", str(port)],
                  tmp_path / "head")
        st = head.wait_ready(180)
        remote, _ = st["status"]["engines"]
        assert remote["port"] == peer_port and not remote["managed"]
        r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                          json={"messages": [{"role": "user", "content": "Hi"}],
                                "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        # both hosts' status say TLS: the head's remote peer, the peer's port (TLS only)
        (far,) = [x for pt in status_json(env)["daemon"]["ports"]  # type: ignore[typeddict-item]
                  for lane in pt["lanes"] for x in lane["processes"] if not x["managed"]]
        assert far["tls"] is True and far["endpoints"] == [], far
        shown = run_hydra(env, "status").stdout
        assert f"127.0.0.1:{peer_port} TLS" in shown, shown
        shown = run_hydra(peer.env, "status").stdout
        assert f"ggml-rpc://127.0.0.1:{peer_port} (TLS only)" in shown, shown
        log = "".join(p.read_text() for p in
                      sorted((Path(env["HYDRA_STATE_DIR"]) / "logs").glob("*.head.log")))
        # the head's llama-server reached the peer through the local tunnel
        m = re.search(r"RPC0\[127\.0\.0\.1:(\d+)\] model buffer size = +\d", log)
        assert m is not None and int(m.group(1)) != peer_port, log[-3000:]
        assert "offloaded 10/19 layers" in log
    finally:
        if head is not None:
            head.stop()
            head.kill_everything()
        peer.stop()
        peer.kill_everything()


def test_a_head_with_a_certificate_of_another_ca_is_refused(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["peer"])
    stranger = make_certs(tmp_path / "other", ["head"])["head"]
    # it trusts the peer (our CA), but its own certificate is the other CA's
    head_files = TlsFiles(ca=certs["peer"].ca, cert=stranger.cert, key=stranger.key)
    peer, peer_port = _peer(tmp_path, certs["peer"])
    try:
        peer.wait_ready()
        (tmp_path / "head").mkdir()
        env = _head_env(tmp_path / "head", peer_port, head_files)
        res = run_hydra(env, "up", "--profile", str(_combine(tmp_path / "head")), "--port",
                        str(free_port()), timeout=120)
        assert res.returncode == 2, res.stderr
        err = res.stderr
        assert re.search(r"^error: .*refused this host's certificate", err, re.M), err
        assert re.search(r"^\s*fix: sign this host's certificate with the CA", err, re.M), err
        assert "Traceback" not in err
        doc = run_hydra(env, "doctor", "--peers")
        assert doc.returncode != 0 and "refused this host's certificate" in doc.stdout, \
            doc.stdout + doc.stderr
    finally:
        peer.stop()
        peer.kill_everything()
