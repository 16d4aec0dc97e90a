"""TLS between hydra hosts (router/tls.py, router/tunnel.py, the peer router's TLS-only port):
real sockets on loopback, certificates made by the openssl CLI; config validation of tls:.

The end-to-end run with llama.cpp (a peer hydra with tls:, a head hydra with a tls device,
completions through a COMBINE) is tests/test_tls_multihost.py."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hydra_supervisor.config.config import load_node, load_profile
from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.errors import ConfigError, HydraError
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.router import Router, Upstreams, tls
from hydra_supervisor.router.tunnel import TlsTunnel, socket_owner
from hydra_supervisor.testing.routerhelp import (
    DEADLINE,
    HOST,
    EchoServer,
    recv_exact,
    recv_to_eof,
    wait_until,
)
from hydra_supervisor.testing.tlscerts import make_certs, openssl_missing

pytestmark = pytest.mark.skipif(openssl_missing() is not None, reason=str(openssl_missing()))


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    root = tmp_path_factory.mktemp("certs")
    files = make_certs(root / "ours", ["peer", "head"])
    files["stranger"] = make_certs(root / "theirs", ["stranger"])["stranger"]
    return files


@pytest.fixture
def tls_peer(certs: dict[str, TlsFiles]) -> Iterator[tuple[Router, EchoServer]]:
    """A TLS-only router (a peer host's) whose ggml-RPC upstream echoes."""
    echo = EchoServer(tag=b"rpc:")
    r = Router(HOST, 0, Upstreams(rpc=echo.addr), allow=["127.0.0.0/8"],
               tls_context=tls.server_context(certs["peer"]), first_byte_timeout=5.0)
    r.start()
    try:
        yield r, echo
    finally:
        r.stop()
        echo.close()


def _tls_client(port: int, files: TlsFiles) -> ssl.SSLSocket:
    return tls.connect(HOST, port, files, DEADLINE)


def _refused(r: Router, reason: str) -> int:
    return int(r.counters()["refused"].get(reason, 0))


def test_rpc_over_tls_is_relayed_and_counted(tls_peer: tuple[Router, EchoServer],
                                             certs: dict[str, TlsFiles]) -> None:
    r, echo = tls_peer
    with _tls_client(r.port, certs["head"]) as s:
        s.sendall(b"\x0e" + b"x" * 99)
        assert recv_exact(s, 104) == b"rpc:" + b"\x0e" + b"x" * 99
        big = bytes(range(256)) * 4096  # 1 MiB: many TLS records each way
        s.sendall(big)
        assert recv_exact(s, len(big)) == big
    wait_until(lambda: r.counters()["bytes_up"] >= 100 + len(big), what="bytes_up counted")
    assert echo.accepted == 1


def test_one_rpc_holder_at_a_time_over_tls(tls_peer: tuple[Router, EchoServer],
                                           certs: dict[str, TlsFiles]) -> None:
    r, echo = tls_peer
    with _tls_client(r.port, certs["head"]) as first:
        first.sendall(b"\x0e" + b"a" * 15)
        assert recv_exact(first, 20) == b"rpc:\x0e" + b"a" * 15
        with _tls_client(r.port, certs["head"]) as second:
            second.sendall(b"\x0e" + b"b" * 15)
            try:  # refused after the hold grace: EOF (or a reset), never the rpc-server
                assert recv_to_eof(second) == b""
            except (ConnectionResetError, ssl.SSLError):
                pass
        wait_until(lambda: _refused(r, "rpc_held") == 1, what="the second head refused")
        first.sendall(b"c")  # the holder is undisturbed
        assert recv_exact(first, 1) == b"c"
    assert echo.accepted == 1


def test_plain_connection_to_a_tls_port_is_refused(tls_peer: tuple[Router, EchoServer]
                                                   ) -> None:
    r, echo = tls_peer
    with socket.create_connection((HOST, r.port), timeout=DEADLINE) as s:
        s.sendall(b"\x0e" + b"\0" * 15)
        assert recv_to_eof(s) == b""
    wait_until(lambda: _refused(r, "tls_required") == 1, what="refused as plain")
    assert echo.accepted == 0
    # and hydra's own probe, told to speak plain TCP, learns nothing from it
    with pytest.raises((OSError, rpcproto.HelloError)):
        rpcproto.probe(HOST, r.port, timeout=2.0)


def test_a_certificate_of_another_ca_is_refused(tls_peer: tuple[Router, EchoServer],
                                                certs: dict[str, TlsFiles]) -> None:
    r, echo = tls_peer
    with pytest.raises(rpcproto.TlsFailed) as e:
        rpcproto.probe(HOST, r.port, timeout=DEADLINE, tls=certs["stranger"])
    # the stranger does not trust the peer's certificate either: it says so first
    assert "does not verify against the CA" in str(e.value)
    assert "fix: give the CA that signed the peer host's certificate" in str(e.value)
    # a head that trusts the peer but whose own certificate another CA signed
    wrong_cert = TlsFiles(ca=certs["head"].ca, cert=certs["stranger"].cert,
                          key=certs["stranger"].key)
    with pytest.raises(rpcproto.TlsFailed) as e:
        rpcproto.probe(HOST, r.port, timeout=DEADLINE, tls=wrong_cert)
    assert "refused this host's certificate" in str(e.value)
    assert "fix: sign this host's certificate with the CA" in str(e.value)
    wait_until(lambda: _refused(r, "tls_failed") >= 2, what="handshakes refused")
    assert echo.accepted == 0


def test_tls_to_a_plain_port_says_so(certs: dict[str, TlsFiles]) -> None:
    echo = EchoServer()
    r = Router(HOST, 0, Upstreams(rpc=echo.addr), allow=["127.0.0.0/8"],
               first_byte_timeout=2.0)
    r.start()
    try:
        with pytest.raises(rpcproto.TlsFailed) as e:  # closed, or reset, in the handshake
            rpcproto.probe(HOST, r.port, timeout=DEADLINE, tls=certs["head"])
        assert "does not speak TLS" in str(e.value)
        assert "fix: give the peer profile tls:" in str(e.value)
    finally:
        r.stop()
        echo.close()


def test_tls_from_a_source_not_allowed_is_closed_before_the_handshake(
        certs: dict[str, TlsFiles]) -> None:
    echo = EchoServer()
    r = Router(HOST, 0, Upstreams(rpc=echo.addr), allow=["10.99.0.0/16"],
               tls_context=tls.server_context(certs["peer"]))
    r.start()
    try:
        with pytest.raises(OSError):
            _tls_client(r.port, certs["head"])
        wait_until(lambda: _refused(r, "denied") == 1, what="denied")
        assert _refused(r, "tls_failed") == 0
    finally:
        r.stop()
        echo.close()


def test_tunnel_carries_plain_bytes_over_tls(tls_peer: tuple[Router, EchoServer],
                                             certs: dict[str, TlsFiles]) -> None:
    r, echo = tls_peer
    tunnel = TlsTunnel(f"{HOST}:{r.port}", certs["head"])
    local = tunnel.start()
    try:
        host, _, port = local.rpartition(":")
        assert host == "127.0.0.1"
        for _ in range(2):  # a head opens one connection after another
            with socket.create_connection((host, int(port)), timeout=DEADLINE) as s:
                s.sendall(b"\x0e" + b"y" * 20)
                assert recv_exact(s, 25) == b"rpc:\x0e" + b"y" * 20
        wait_until(lambda: echo.accepted == 2, what="two connections relayed")
        assert tunnel.last_error is None
    finally:
        tunnel.stop()
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1.0).close()


def test_socket_owner_reads_the_kernel_tcp_table(tmp_path: Path) -> None:
    table = tmp_path / "tcp"
    table.write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
        "timeout inode\n"
        "   0: 0100007F:9C41 0100007F:A001 01 00000000:00000000 00:00000000 00000000  1000 "
        "       0 1111 1 0000000000000000 20 4 30 10 -1\n"
        "   1: 0100007F:A001 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0 "
        "       0 2222 1 0000000000000000 20 4 30 10 -1\n")
    assert socket_owner(0x9C41, 0xA001, str(table)) == 1000
    assert socket_owner(0xA001, 0x9C41, str(table)) == 0
    assert socket_owner(0x9C42, 0xA001, str(table)) is None
    assert socket_owner(1, 2, str(tmp_path / "missing")) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_tunnel_refuses_a_connection_of_another_user(tls_peer: tuple[Router, EchoServer],
                                                     certs: dict[str, TlsFiles]) -> None:
    """The tunnel carries this host's certificate: a socket of another local user (nobody,
    here) is closed without a byte reaching the peer; hydra's own user still gets through."""
    r, echo = tls_peer
    tunnel = TlsTunnel(f"{HOST}:{r.port}", certs["head"])
    host, _, port = tunnel.start().rpartition(":")
    try:
        # bash's /dev/tcp: a client any user can run (hydra's venv may not be readable)
        script = ("exec 3<>/dev/tcp/$0/$1 || exit 3; printf '\\016zzzzzzzzzzzzzzzzzzzz' >&3; "
                  "cat <&3")
        out = subprocess.run(["bash", "-c", script, host, port], user=65534,
                             capture_output=True, timeout=DEADLINE)
        # connected (not exit 3), then closed without a byte (EOF, or a reset: its bytes unread)
        assert out.returncode != 3 and out.stdout == b"", out
        wait_until(lambda: tunnel.refused == 1, what="the stranger counted")
        assert echo.accepted == 0
        with socket.create_connection((host, int(port)), timeout=DEADLINE) as s:
            s.sendall(b"\x0e" + b"y" * 20)
            assert recv_exact(s, 25) == b"rpc:\x0e" + b"y" * 20
    finally:
        tunnel.stop()


def test_tunnel_with_a_wrong_certificate_closes_and_says_why(
        tls_peer: tuple[Router, EchoServer], certs: dict[str, TlsFiles]) -> None:
    r, echo = tls_peer
    tunnel = TlsTunnel(f"{HOST}:{r.port}", certs["stranger"])
    host, _, port = tunnel.start().rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=DEADLINE) as s:
            s.sendall(b"\x0e" + b"\0" * 15)
            assert recv_to_eof(s) == b""
        wait_until(lambda: tunnel.last_error is not None, what="the tunnel's TLS error")
        assert "does not verify against the CA" in str(tunnel.last_error)
        assert echo.accepted == 0
    finally:
        tunnel.stop()


def test_unloadable_files_are_one_error_with_a_fix(tmp_path: Path,
                                                   certs: dict[str, TlsFiles]) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(HydraError) as e:
        tls.server_context(TlsFiles(ca=certs["peer"].ca, cert=str(junk), key=str(junk)))
    assert "cannot load this host's certificate" in e.value.message
    assert e.value.hint and "openssl" in e.value.hint
    mismatched = TlsFiles(ca=certs["peer"].ca, cert=certs["peer"].cert, key=certs["head"].key)
    with pytest.raises(HydraError):
        tls.server_context(mismatched)


# ------------------------------------------------------------------ config


def _node(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "node.yaml"
    p.write_text(textwrap.dedent(body))
    return p


def test_device_tls_paths_resolve_next_to_the_node_file(tmp_path: Path,
                                                        certs: dict[str, TlsFiles]) -> None:
    d = Path(certs["head"].ca).parent
    for f in ("ca.crt", "head.crt", "head.key"):
        (tmp_path / f).write_bytes((d / f).read_bytes())
    node = load_node(_node(tmp_path, """\
        devices:
          far: {endpoint: 10.0.0.2:50052, tls: {ca: ca.crt, cert: head.crt, key: head.key}}
        """))
    assert node.devices["far"].tls == TlsFiles(ca=str(tmp_path / "ca.crt"),
                                               cert=str(tmp_path / "head.crt"),
                                               key=str(tmp_path / "head.key"))


@pytest.mark.parametrize(("tls_yaml", "line", "said"), [
    ("{ca: ca.crt, cert: head.crt}", 3, "missing 'key'"),
    ("{ca: ca.crt, cert: head.crt, key: head.key, psk: x}", 3, "unknown key 'psk'"),
    ("{ca: nowhere.crt, cert: head.crt, key: head.key}", 3, "no such file"),
    ("yes", 3, "expected {ca: PATH, cert: PATH, key: PATH}"),
])
def test_device_tls_errors_name_file_and_line(tmp_path: Path, tls_yaml: str, line: int,
                                              said: str) -> None:
    for f in ("ca.crt", "head.crt", "head.key"):
        (tmp_path / f).write_text("x")
    path = _node(tmp_path, f"""\
        devices:
          far:
            tls: {tls_yaml}
            endpoint: 10.0.0.2:50052
        """)
    with pytest.raises(ConfigError) as e:
        load_node(path)
    assert f"{path}:{line}" in str(e.value)
    assert said in str(e.value)


def test_device_tls_needs_an_endpoint(tmp_path: Path) -> None:
    path = _node(tmp_path, """\
        devices:
          gpu: {cuda: 0, tls: {ca: a, cert: b, key: c}}
        """)
    with pytest.raises(ConfigError, match="only for a remote peer"):
        load_node(path)


def test_profile_tls_only_for_a_peer(tmp_path: Path, certs: dict[str, TlsFiles]) -> None:
    node = load_node(None)
    peer = certs["peer"]
    ok = tmp_path / "lend.yaml"
    ok.write_text(f"mode: peer\nhead: cpu\nhost: 0.0.0.0\nrpc_allow: [10.0.0.0/8]\n"
                  f"tls: {{ca: {peer.ca}, cert: {peer.cert}, key: {peer.key}}}\n")
    assert load_profile(ok, node).tls == peer
    bad = tmp_path / "solo.yaml"
    bad.write_text(f"model: gemma3-270m\ntls: {{ca: {peer.ca}, cert: {peer.cert}, "
                   f"key: {peer.key}}}\n")
    with pytest.raises(ConfigError) as e:
        load_profile(bad, node)
    assert f"{bad}:2" in str(e.value) and "used only with mode: peer" in str(e.value)


def test_stopping_ends_tls_relays_and_tunnels(certs: dict[str, TlsFiles]) -> None:
    """Router.stop and TlsTunnel.stop end connections that are being relayed (their threads
    read EOF and close): nothing is left open, and the client sees the end."""
    echo = EchoServer(tag=b"rpc:")
    r = Router(HOST, 0, Upstreams(rpc=echo.addr), allow=["127.0.0.0/8"],
               tls_context=tls.server_context(certs["peer"]))
    r.start()
    tunnel = TlsTunnel(f"{HOST}:{r.port}", certs["head"])
    host, _, port = tunnel.start().rpartition(":")
    try:
        via_tunnel = socket.create_connection((host, int(port)), timeout=DEADLINE)
        via_tunnel.sendall(b"\x0e")
        assert recv_exact(via_tunnel, 5) == b"rpc:\x0e"
        tunnel.stop()
        assert recv_to_eof(via_tunnel) == b""
        via_tunnel.close()
        direct = _tls_client(r.port, certs["head"])
        wait_until(lambda: r.counters()["open"] == 0, what="the tunnel's connection closed")
        direct.sendall(b"\x0e")
        assert recv_exact(direct, 5) == b"rpc:\x0e"
        r.stop()
        try:
            assert direct.recv(16) == b""
        except (ConnectionResetError, ssl.SSLError):
            pass
        direct.close()
    finally:
        tunnel.stop()
        r.stop()
        echo.close()
