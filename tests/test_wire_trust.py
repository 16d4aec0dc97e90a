"""Only hydra's owner drives the wire protocol (issue 20, item 2): the peer-uid lookup on real
loopback connections, a second local user refused where it would change something (and still
answered INFO), the owner's token, no wire port of its own in a running hydra, CONFIGURE range
checks, file-valued keys refused, and the rpc_allow-vs-bind warning."""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from hydra_supervisor.router import Router, Upstreams
from hydra_supervisor.router.conn import allow_mismatch
from hydra_supervisor.wire import tier_diff, tiers, trust
from hydra_supervisor.wire.server import WireServer
from hydra_supervisor.wire.trust import Trust, peer_uid
from tests import wire_client as wc
from tests.wire_fakes import StubControl

HOST = "127.0.0.1"
OTHER_USER = "hydrat20"  # the second local user the root-only tests create

# A client that imports nothing (the second user runs it with the system Python): one
# connection, the given requests in order, [[status, meta], …] on stdout.
CLIENT = r"""
import json, socket, struct, sys
host, port, reqs = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
s = socket.create_connection((host, port), timeout=10)
def recvn(n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError("closed")
        b += c
    return b
out = []
for op, key, payload, trace in reqs:
    p, k, t = payload.encode(), key.encode(), trace.encode()
    s.sendall(struct.pack("<HBBHQH", 0x4859, op, 0, len(k), len(p), len(t)) + k + t + p)
    h = recvn(12)
    meta = recvn(int.from_bytes(h[1:4], "little"))
    recvn(int.from_bytes(h[4:12], "little"))
    out.append([h[0], json.loads(meta) if meta else {}])
print(json.dumps(out))
"""


# ------------------------------------------------------------------------ the uid lookup


def test_peer_uid_of_a_real_loopback_connection() -> None:
    families = [(socket.AF_INET, "127.0.0.1")]
    if socket.has_ipv6:
        try:
            socket.socket(socket.AF_INET6).bind(("::1", 0))
            families.append((socket.AF_INET6, "::1"))
        except OSError:
            pass
    for family, host in families:
        with socket.create_server((host, 0), family=family) as srv, \
                socket.create_connection((host, srv.getsockname()[1])) as cli:
            conn, peer = srv.accept()
            with conn:
                assert peer_uid(peer, conn.getsockname()) == os.geteuid(), host
                # the other direction: the server's own socket, also ours
                assert peer_uid(conn.getsockname(), peer) == os.geteuid()
                assert trust.socket_peer_uid(conn, peer) == os.geteuid()
                # no such connection: unknown, never a guess
                assert peer_uid((host, 1), conn.getsockname()) is None
                assert peer_uid(("10.255.255.1", cli.getsockname()[1]),
                                conn.getsockname()) is None
    a, b = socket.socketpair()
    with a, b:
        assert trust.socket_peer_uid(a) == os.geteuid()  # a unix socket: SO_PEERCRED


def test_dual_stack_listener_sees_ipv4_clients_as_ipv4() -> None:
    try:
        srv = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError):
        pytest.skip("no dual-stack IPv6 here")
    with srv, socket.create_connection(("127.0.0.1", srv.getsockname()[1])):
        conn, peer = srv.accept()
        with conn:
            assert str(peer[0]).startswith("::ffff:")
            assert peer_uid(peer, conn.getsockname()) == os.geteuid()


def test_proc_net_parsing_and_orphans(tmp_path: Path) -> None:
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  " \
           "timeout inode\n"
    little = sys.byteorder == "little"
    lo = "0100007F" if little else "7F000001"
    row = "   0: {l}:A000 {l}:1F90 {st} 00000000:00000000 00:00000000 00000000  {uid}  0 {ino}\n"
    (tmp_path / "tcp").write_text(
        head + row.format(l=lo, st="01", uid=1234, ino=999)
        + row.format(l=lo, st="06", uid=0, ino=0).replace(":A000", ":A001"))
    (tmp_path / "tcp6").write_text(head)
    assert peer_uid(("127.0.0.1", 0xA000), ("127.0.0.1", 8080), tmp_path) == 1234
    # an orphaned/TIME_WAIT entry reads uid 0 with no inode: never trusted (not root!)
    assert peer_uid(("127.0.0.1", 0xA001), ("127.0.0.1", 8080), tmp_path) is None
    assert peer_uid(("127.0.0.1", 0xA000), ("127.0.0.1", 8081), tmp_path) is None
    assert trust._parse_hex_endpoint(f"{lo}:1F90")[1] == 8080


# ---------------------------------------------------------------------------------- the token


def test_token_file_is_private_and_kept(tmp_path: Path) -> None:
    path, tok = trust.ensure_token(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(tok) == 64
    assert trust.ensure_token(tmp_path) == (path, tok)  # kept across restarts
    path.chmod(0o644)  # someone else may have read it: a new one
    path2, tok2 = trust.ensure_token(tmp_path)
    assert tok2 != tok and stat.S_IMODE(path2.stat().st_mode) == 0o600
    assert trust.split_trace(trust.with_token(tok2, "t-1")) == (tok2, "t-1")
    assert trust.split_trace("plain-trace") == (None, "plain-trace")


# --------------------------------------------------------- refusals (any user, any machine)


def _stack(control: StubControl, policy: Trust,
           reads: str | None = None) -> tuple[WireServer, Router]:
    server = WireServer(control=control, trust=policy,
                        reads=(lambda: reads) if reads else None)  # type: ignore[return-value]
    server.start()
    router = Router(HOST, 0, Upstreams(hydra=server), name="trust")
    router.start()
    return server, router


def test_a_client_that_is_not_the_owner_is_refused_changes(control: StubControl) -> None:
    """Run anywhere: hydra's owner uid set to one nobody has, so this process is 'another
    user'; its reads are answered, its changes refused, the token lets it in."""
    tok = "ab" * 32
    server, router = _stack(control, Trust(token=tok, owner_uids=(2**31 - 7,)))
    try:
        with wc.WireClient(HOST, router.port, timeout=10) as c:
            assert c.info().status == wc.OK
            r = c.configure({"temperature": 0.3})
            assert r.status == wc.ERROR and r.meta["unauthenticated"] is True
            assert "authenticated" in r.meta["error"] and "wire.token" in r.meta["error"]
            greet = c.configure({"state_chunk_size": 1 << 20})  # Hydra.Core's greeting
            assert greet.status == wc.OK and greet.meta["state_chunk_size_applied"] == 2 << 20
            assert "not_applied" in greet.meta
            for op, payload in ((wc.SET_EXPERT_MODE, b"solo"), (wc.STATE_PUT, b"x" * 100),
                                (wc.PREFILL, b'{"prompt": "hi"}')):
                r = c.request(op, "0", payload)
                assert r.status == wc.ERROR and r.meta.get("unauthenticated"), op
            assert c.request(wc.STATE_META, "0").status == wc.OK  # a read
            r = c.request(wc.CONFIGURE, "", b'{"top_k": 5}', trace="hydra-token:" + "cd" * 32)
            assert r.status == wc.ERROR  # a wrong token
            assert c.info().status == wc.OK  # in step throughout
        assert control.configured == [] and control.modes == []
        with wc.WireClient(HOST, router.port, timeout=10) as c:
            r = c.request(wc.CONFIGURE, "", b'{"top_k": 5}', trace=trust.with_token(tok, "t"))
            assert r.status == wc.OK and r.meta["tier"] == "T1"
            # the connection stays authenticated once it presented the token
            assert c.configure({"top_k": 6}).status == wc.OK
        assert control.configured == [{"top_k": 5}, {"top_k": 6}]
        st = server.stats()
        assert st["auth_refused_not_owner"] >= 4 and st["auth_refused_bad_token"] == 1
    finally:
        router.stop()
        server.stop()


def test_reads_policy_owner(control: StubControl) -> None:
    server, router = _stack(control, Trust(owner_uids=(2**31 - 7,)), reads="owner")
    try:
        with wc.WireClient(HOST, router.port, timeout=10) as c:
            assert c.info().status == wc.ERROR
            assert c.request(wc.STATE_GET, "0").status == wc.ERROR
    finally:
        router.stop()
        server.stop()
    server, router = _stack(control, Trust(), reads="owner")  # we are the owner here
    try:
        with wc.WireClient(HOST, router.port, timeout=10) as c:
            assert c.info().status == wc.OK
            assert c.configure({"temperature": 0.5}).status == wc.OK
    finally:
        router.stop()
        server.stop()


# ------------------------------------------------------------- a second local user (root)


@pytest.fixture(scope="module")
def other_user() -> Iterator[tuple[int, int]]:
    if os.geteuid() != 0:
        pytest.skip("needs root: creates a second local user (useradd) and runs a client as it")
    if not (shutil.which("useradd") and shutil.which("setpriv") and Path("/usr/bin/python3")
            .exists()):
        pytest.skip("needs useradd, setpriv and /usr/bin/python3")
    import pwd

    created = False
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", OTHER_USER], check=True, capture_output=True)
        created = True
        pw = pwd.getpwnam(OTHER_USER)
    yield pw.pw_uid, pw.pw_gid
    if created:
        subprocess.run(["userdel", OTHER_USER], check=False, capture_output=True)


def run_as(user: tuple[int, int], port: int, reqs: list[tuple[int, str, str, str]]
           ) -> list[list[Any]]:
    uid, gid = user
    res = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                          "/usr/bin/python3", "-c", CLIENT, HOST, str(port), json.dumps(reqs)],
                         capture_output=True, text=True, timeout=60, cwd="/", check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def test_second_local_user_refused_owner_served(control: StubControl,
                                                other_user: tuple[int, int]) -> None:
    tok = secrets.token_hex(32)
    server, router = _stack(control, Trust(token=tok))
    try:
        got = run_as(other_user, router.port, [
            (wc.INFO, "", "", ""),
            (wc.CONFIGURE, "", '{"temperature": 0.01}', ""),
            (wc.CONFIGURE, "", '{"chat_template_file": "/etc/shadow"}', ""),
            (wc.SET_EXPERT_MODE, "", "combined", ""),
            (wc.CONFIGURE, "", '{"state_chunk_size": 65536}', ""),
            (wc.INFO, "", "", ""),
        ])
        assert [s for s, _ in got] == [wc.OK, wc.ERROR, wc.ERROR, wc.ERROR, wc.OK, wc.OK]
        assert f"uid {other_user[0]}" in got[1][1]["error"]
        assert control.configured == [] and control.modes == []
        # the owner (this process) through the same router
        with wc.WireClient(HOST, router.port, timeout=10) as c:
            assert c.configure({"temperature": 0.2}).status == wc.OK
        # the second user holding the owner's token (a coordinator it was given to)
        got = run_as(other_user, router.port, [
            (wc.CONFIGURE, "", '{"temperature": 0.3}', trust.with_token(tok))])
        assert got[0][0] == wc.OK
        assert control.configured == [{"temperature": 0.2}, {"temperature": 0.3}]
    finally:
        router.stop()
        server.stop()


# ------------------------------------------------------------------ a running hydra (no model)


def test_hydra_has_no_wire_port_and_the_owner_configures(tmp_path: Path,
                                                        hydra_env: dict[str, str]) -> None:
    from hydra_supervisor.plan.ports import free_port
    from hydra_supervisor.testing.harness import HYDRA, REPO, run_hydra, wait_until

    port = free_port()
    log = (tmp_path / "up.log").open("w")
    proc = subprocess.Popen([*HYDRA, "up", "--no-profile", "--port", str(port)], env=hydra_env,
                            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        def info() -> Any:
            try:
                with wc.WireClient(HOST, port, timeout=5) as c:
                    r = c.info()
                    return r if r.status == wc.OK else None
            except (OSError, EOFError):
                return None

        wait_until(info, 60, "hydra's router answering INFO")
        p = psutil.Process(proc.pid)
        listening = {c.laddr.port for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {port}, f"listening sockets besides the router's: {listening}"
        token = Path(hydra_env["HYDRA_STATE_DIR"]) / trust.TOKEN_FILE
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        res = run_hydra(hydra_env, "configure", "temperature=0.25", "-p", str(port))
        assert res.returncode == 0 and "applied (T1)" in res.stdout, res.stdout + res.stderr
        res = run_hydra(hydra_env, "configure", "threads=-3", "-p", str(port))
        assert res.returncode == 1 and "threads" in res.stderr and "1024" in res.stderr
        if os.geteuid() == 0 and shutil.which("setpriv") and shutil.which("useradd"):
            import pwd

            try:
                pw = pwd.getpwnam(OTHER_USER)
            except KeyError:
                return  # the second-user test above covers it where the user exists
            got = run_as((pw.pw_uid, pw.pw_gid), port, [
                (wc.INFO, "", "", ""), (wc.CONFIGURE, "", '{"temperature": 1.5}', "")])
            assert [s for s, _ in got] == [wc.OK, wc.ERROR]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


# ------------------------------------------------------------------- range and file checks


@pytest.mark.parametrize("key, value, says", [
    ("threads", -3, "-1 (auto) or from 1 to 1024"),
    ("ctx_size", 0, "from 1 to"),
    ("temperature", float("nan"), "finite"),
    ("temperature", "inf", "finite"),
    ("temperature", -0.5, "from 0 to 100"),
    ("top_p", 1.5, "from 0 to 1"),
    ("min_p", -0.1, "from 0 to 1"),
    ("n_predict", -7, "-1 (no limit)"),
    ("seed", 2**33, "-1 (random)"),
    ("batch_size", 0, "from 1 to"),
    ("parallel", 0, "-1 (auto) or from 1"),
    ("mirostat", 3, "from 0 to 2"),
    ("cache_type_k", "bogus", "q8_0"),
    ("flash_attn", "maybe", "on/off/auto"),
    ("split_mode", "row", "none, layer"),
    ("tensor_split", [0, 0], "not all zero"),
    ("override_tensor", "no-equals-sign", "PATTERN=BUFFER"),
    ("n_gpu_layers", -2, "-1 (all)"),
    ("ctx_size", True, "integer"),
])
def test_configure_range_checks(key: str, value: Any, says: str) -> None:
    d = tier_diff.classify({key: value}, {})
    assert not d.ok and key in d.invalid and says in d.invalid[key], d.invalid
    assert key in d.error() and "nothing applied" in d.error()


def test_every_key_has_a_type_and_range() -> None:
    for spec in tiers.KEYS:
        if spec.tier is tiers.Tier.T4:
            continue
        assert spec.valid, f"{spec.name}: no range, choices or type check"


def test_range_refusal_over_the_wire_is_bad_request(control: StubControl) -> None:
    server = WireServer(control=control, port=0)
    server.start()
    try:
        with wc.WireClient(HOST, server.port, timeout=10) as c:
            r = c.configure({"threads": -3, "temperature": 0.2})
            assert r.status == wc.BAD_REQUEST and "threads" in r.meta["invalid"]
            assert "1024" in r.meta["error"]
            r = c.request(wc.CONFIGURE, "", b'{"temperature": NaN}')
            assert r.status == wc.BAD_REQUEST and "finite" in r.meta["error"]
            assert c.configure({"temperature": 0.2, "threads": 4}).status == wc.OK
        assert control.configured == [{"temperature": 0.2, "threads": 4}]
    finally:
        server.stop()


@pytest.mark.parametrize("params", [
    {"chat_template_file": "/etc/shadow"}, {"chat-template-file": "x.jinja"},
    {"model": "/etc/passwd"}, {"model": "../../x.gguf"}, {"model": "~/m.gguf"},
    {"m": "model.gguf"}, {"lora": ["/tmp/a.gguf"]}, {"mmproj": "/tmp/p.gguf"},
    {"control_vector": "/tmp/v.gguf"}, {"model_draft": "/tmp/d.gguf"},
])
def test_file_keys_refused(params: dict[str, Any], control: StubControl) -> None:
    d = tier_diff.classify({**params, "temperature": 0.1}, {})
    assert not d.ok and d.refused
    server = WireServer(control=control, port=0)
    server.start()
    try:
        with wc.WireClient(HOST, server.port, timeout=10) as c:
            r = c.configure({**params, "temperature": 0.1})
            assert r.status == wc.ERROR and "refused over the wire" in r.meta["error"]
        assert control.configured == []  # nothing applied, not even the T1 key
    finally:
        server.stop()


def test_model_alias_allowed_and_checked_against_the_node(tmp_path: Path) -> None:
    from hydra_supervisor.serve.engine_wire import EngineWire
    from hydra_supervisor.wire.control import ConfigureRefused

    assert tier_diff.classify({"model": "my-model"}, {}).ok  # an alias passes the wire check
    node = tmp_path / "node.yaml"
    node.write_text("models:\n  my-model: /nonexistent/m.gguf\n")
    ew = EngineWire.__new__(EngineWire)
    ew.node_file = str(node)
    ew._check_model("my-model")
    ew._check_model("gemma3-270m")
    with pytest.raises(ConfigureRefused, match="not an alias"):
        ew._check_model("shadow")  # a bare name would be looked up in the working directory


# ----------------------------------------------------------------- rpc_allow vs bind address


@pytest.mark.parametrize("bind, allow, bad", [
    ("0.0.0.0", ["::1/128"], "lists no IPv4 network"),
    ("127.0.0.1", ["10.0.0.0/8"], "no loopback network"),
    ("::1", ["127.0.0.0/8"], "lists no IPv6 network"),
    ("10.1.2.3", ["127.0.0.0/8"], "never from loopback"),
    ("127.0.0.1", [], "empty"),
    ("127.0.0.1", ["127.0.0.0/8", "::1/128"], None),
    ("0.0.0.0", ["127.0.0.0/8", "::1/128"], None),
    ("::", ["10.0.0.0/8"], None),
    ("10.1.2.3", ["10.0.0.0/8"], None),
    ("127.0.0.1", ["0.0.0.0/0"], None),
])
def test_allow_mismatch(bind: str, allow: list[str], bad: str | None) -> None:
    why = allow_mismatch(bind, allow)
    assert (why is None) if bad is None else (why is not None and bad in why), why


def test_router_warns_at_start_when_allow_cannot_match(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    caplog.set_level(logging.WARNING, logger="hydra.router")
    r = Router("127.0.0.1", 0, Upstreams(), allow=["10.0.0.0/8"], name="w")
    r.start()
    r.stop()
    assert any("can ever be let in" in m and "10.0.0.0/8" in m for m in caplog.messages)
    caplog.clear()
    r = Router("127.0.0.1", 0, Upstreams(), name="ok")
    r.start()
    r.stop()
    assert not any("can ever be let in" in m for m in caplog.messages)



def test_hydra_configure_token_file(control: StubControl, tmp_path: Path) -> None:
    """`hydra configure --token-file`: the owner from elsewhere (here: a uid that is not the
    owner's) presents the token; without it the same command is refused (exit 1)."""
    from click.testing import CliRunner

    from hydra_supervisor.cli.configure_cmd import configure_command

    path, tok = trust.ensure_token(tmp_path / "state")
    server, router = _stack(control, Trust(token=tok, owner_uids=(2**31 - 7,)))
    try:
        port = str(router.port)
        r = CliRunner().invoke(configure_command, ["temperature=0.4", "-p", port])
        assert r.exit_code == 1 and "authenticated" in r.output, r.output
        r = CliRunner().invoke(configure_command, ["temperature=0.4", "-p", port,
                                                   "--token-file", str(path)])
        assert r.exit_code == 0 and "applied (T1)" in r.output, r.output
        assert control.configured == [{"temperature": 0.4}]
    finally:
        router.stop()
        server.stop()
