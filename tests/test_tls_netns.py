"""TLS between hydra hosts across network namespaces (issue 32 item 7): hosts on their own
addresses over a 1 Gbit link (testing/netns.py), a peer host bound to 0.0.0.0 with `tls:` and
an `rpc_allow` naming the head host only, a head host whose device has `tls:`:

- a completion from a third (client) host through the head's router is served (200);
- the client host, holding a certificate the same CA signed, is refused at the peer's router
  before any handshake (not in rpc_allow): a valid certificate is not an address check;
- `hydra down` on both hosts leaves nothing running in either namespace.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.harness import make_env, run_hydra, wait_until
from hydra_supervisor.testing.netns import Hosts, NsUp, why_unavailable
from hydra_supervisor.testing.tlscerts import make_certs, openssl_missing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))]

PEER_PORT, HEAD_PORT = 8090, 8080


@pytest.fixture
def net() -> Iterator[Hosts]:
    why = why_unavailable()
    if why:
        print(f"\nSKIP tests/test_tls_netns.py: {why}", file=sys.__stderr__)
        pytest.skip(why)
    with Hosts(["head", "peer", "client"]) as hosts:
        yield hosts


def _tls_yaml(f: TlsFiles) -> str:
    return f"{{ca: '{f.ca}', cert: '{f.cert}', key: '{f.key}'}}"


def test_combine_over_tls_between_namespaces(net: Hosts, tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs", ["peer", "head", "client"])
    for d in ("peer", "head"):
        (tmp_path / d).mkdir()
    peer_env = make_env(tmp_path / "peer")
    (tmp_path / "peer" / "lend.yaml").write_text(
        "profile: lend\nmode: peer\nhead: cpu-peer\nhost: 0.0.0.0\n"
        f"port: {PEER_PORT}\nrpc_allow: ['{net.addr('head')}/32']\n"
        f"server_args: {{threads: 1}}\ntls: {_tls_yaml(certs['peer'])}\n")
    head_env = make_env(tmp_path / "head", "devices:\n  far:\n"
                        f"    endpoint: '{net.addr('peer')}:{PEER_PORT}'\n"
                        f"    tls: {_tls_yaml(certs['head'])}\n")
    (tmp_path / "head" / "far.yaml").write_text(
        "profile: far\nmodel: gemma3-270m\nmode: combine\nhead: cpu\npeers: [far]\n"
        f"split: [9, 9]\nhost: 0.0.0.0\nport: {HEAD_PORT}\n"
        "server_args: {ctx-size: 2048, threads: 1, chat-template: gemma, no-jinja: true}\n")
    peer = head = None
    try:
        peer = NsUp(net, "peer", peer_env, ["--profile", str(tmp_path / "peer" / "lend.yaml")],
                    tmp_path / "peer")
        peer.wait_ready(60)
        head = NsUp(net, "head", head_env, ["--profile", str(tmp_path / "head" / "far.yaml")],
                    tmp_path / "head")
        head.wait_ready(240)
        url = f"http://{net.addr('head')}:{HEAD_PORT}/completion"
        r = net.call("client", lambda: requests.post(
            url, json={"prompt": "Once upon a time", "n_predict": 8}, timeout=180))
        assert r.status_code == 200 and r.json()["tokens_predicted"] > 0

        # a certificate of the right CA from a host rpc_allow leaves out: closed before the
        # handshake (which the client sees as a peer closing the handshake)
        peer_addr = net.addr("peer")

        def stranger() -> str:
            try:
                rpcproto.probe(peer_addr, PEER_PORT, timeout=5, tls=certs["client"])
            except (OSError, rpcproto.HelloError) as exc:
                return str(exc)
            return "answered"
        said = net.call("client", stranger)
        assert said != "answered" and "closed the connection during the TLS handshake" in said

        for up, env in ((head, head_env), (peer, peer_env)):
            res = run_hydra(env, "down", timeout=90)
            assert res.returncode == 0, res.stdout + res.stderr
            up.proc.wait(30)
        for host in ("head", "peer"):
            wait_until(lambda h=host: not net.pids(h), 15,
                       f"no process left in {host}'s namespace", interval=0.2)
    finally:
        for up in (head, peer):
            if up is not None:
                if up.proc.poll() is None:
                    up.stop()
                up.kill_everything()
