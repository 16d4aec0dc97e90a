"""Across hosts (issue 22): hosts are network namespaces joined by a bridge with 1 Gbit links
(testing/netns.py), each running its own `hydra up` with its own state dir.

- a head host uses a peer host's lent CPU (`mode: peer`, through the peer's router) for a dense
  COMBINE and for MoE experts, and serves real completions through its own router;
- a source off the peer's `rpc_allow` (a third host) is refused at the peer's router;
- faults, with requests sent during each: the peer host's hydra killed and brought back, the
  peer's rpc-server alone killed, the peer's link cut, its packets dropped (a blackhole route):
  detected within BOUND_S, the head back per `on_peer_loss`, every request that had not started
  served after recovery, nothing left running in any namespace after `hydra down` on both;
- a bare ggml-rpc-server on the peer host (an `endpoint:` hydra did not start) SIGSTOPped under
  steady traffic (issue 31: a request every 2 s from the client host): the stall rule notices
  it within stall_timeout + 5 s, and the head is back once the peer answers after SIGCONT.

Skipped, with the reason printed, where namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests

from hydra_supervisor.proc import rpcproto
from hydra_supervisor.testing.faults import Steady
from hydra_supervisor.testing.harness import (
    HYDRA,
    REPO,
    make_env,
    run_hydra,
    status_json,
    wait_until,
)
from hydra_supervisor.testing.netns import Hosts, NsUp, why_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PEER_PORT, HEAD_PORT = 8090, 8080
# Both hosts run this machine's one stamped build (build 11434, commit sdist-…): the
# build-identity check (issue 22) finds them equal, so no override is needed.
OVERRIDE = ""
INTERVAL, STALL = 0.5, 3.0
# Detection bound, from the fault to the head leaving READY (docs/multi-host.md): a peer that
# exits or refuses is seen at the head's next RPC call (it aborts) or at once; one that drops
# packets at the stall rule's connect: freeze grace (1 s) + 2 x interval + CONNECT_TIMEOUT (3 s)
# = 5 s; plus 3 s for this test's polling and a busy 2-core machine.
BOUND_S = 8.0
POLICY = f"""
restart: {{backoff_initial: 0.5, backoff_max: 2, max_failures: 8, window: 180, stable_after: 3}}
health: {{interval: {INTERVAL}, hang_timeout: 10, stall_timeout: {STALL}}}
"""


def skip_unless_netns() -> None:
    why = why_unavailable()
    if why:
        # printed past pytest's capture, so CI output says why these tests did not run
        print(f"\nSKIP tests/test_multihost.py: {why}", file=sys.__stderr__)
        pytest.skip(why)


@pytest.fixture
def net() -> Iterator[Hosts]:
    skip_unless_netns()
    with Hosts(["head", "peer", "client"]) as hosts:
        yield hosts


@dataclass
class Pair:
    """A peer host lending its CPU and a head host using it (the profiles below)."""

    net: Hosts
    tmp: Path
    peer_env: dict[str, str] = field(default_factory=dict)
    head_env: dict[str, str] = field(default_factory=dict)
    peer: NsUp | None = None
    head: NsUp | None = None

    def __post_init__(self) -> None:
        for host in ("peer", "head"):
            (self.tmp / host).mkdir(parents=True, exist_ok=True)
        self.peer_env = make_env(self.tmp / "peer")
        # the peer host's own rpc cache (-c): cold on its first load, warm after
        self.peer_env["LLAMA_CACHE"] = str(self.tmp / "peer" / "llama-cache")
        self.head_env = make_env(self.tmp / "head", "devices:\n  far: {endpoint: '"
                                 f"{self.net.addr('peer')}:{PEER_PORT}'{OVERRIDE}}}\n")
        self.allow([self.net.addr("head")])

    def allow(self, addrs: list[str]) -> None:
        """The peer host's lend profile, lending to these addresses only."""
        nets = ", ".join(f"'{a}/32'" for a in addrs)
        (self.tmp / "peer" / "lend.yaml").write_text(
            "profile: lend\nmode: peer\nhead: cpu-peer\nhost: 0.0.0.0\n"
            f"port: {PEER_PORT}\nrpc_allow: [{nets}]\nserver_args: {{threads: 1}}\n")

    def start_peer(self) -> dict[str, Any]:
        self.peer = NsUp(self.net, "peer", self.peer_env,
                         ["--profile", str(self.tmp / "peer" / "lend.yaml")], self.tmp / "peer")
        return self.peer.wait_ready(60)

    def start_rpc_server(self) -> subprocess.Popen[bytes]:
        """A bare ggml-rpc-server on the peer host at PEER_PORT (no hydra there: what a
        `endpoint:` device may be), once it answers the head host's HELLO."""
        from hydra_supervisor.tools import binaries

        proc = self.net.popen("peer", [str(binaries.find("ggml-rpc-server").path), "-H",
                                       "0.0.0.0", "-p", str(PEER_PORT), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        addr = self.net.addr("peer")

        def answers() -> bool:
            try:
                return self.net.call("head", lambda: rpcproto.probe(addr, PEER_PORT, 2.0)
                                     ).compatible()
            except (OSError, rpcproto.HelloError):
                return False
        wait_until(answers, 30, "the bare rpc-server to answer HELLO", interval=0.2)
        return proc

    def launch_head(self, body: str, name: str = "far", policy: str = "restart") -> NsUp:
        """`hydra up` on the head host with this profile body, not waited for."""
        prof = self.tmp / "head" / f"{name}.yaml"
        prof.write_text(f"profile: {name}\n{body}peers: [far]\nhost: 0.0.0.0\n"
                        f"port: {HEAD_PORT}\non_peer_loss: {policy}\n{POLICY}")
        self.head = NsUp(self.net, "head", self.head_env, ["--profile", str(prof)],
                         self.tmp / "head")
        return self.head

    def start_head(self, body: str, name: str = "far", policy: str = "restart",
                   timeout: float = 240) -> dict[str, Any]:
        return self.launch_head(body, name, policy).wait_ready(timeout)

    def url(self, path: str) -> str:
        return f"http://{self.net.addr('head')}:{HEAD_PORT}{path}"

    def complete(self, n: int = 8, timeout: float = 180) -> requests.Response:
        """One completion from the client host, through the head's router."""
        return self.net.call("client", lambda: requests.post(
            self.url("/completion"), json={"prompt": "Once upon a time", "n_predict": n},
            timeout=timeout))

    def engines(self, env: dict[str, str]) -> list[dict[str, Any]]:
        st = status_json(env)
        return list((st.get("status") or {}).get("engines") or [])

    def down_both(self) -> None:
        """`hydra down` on both hosts, then: nothing left running in any namespace."""
        for up, env in ((self.head, self.head_env), (self.peer, self.peer_env)):
            if up is not None and up.proc.poll() is None:
                res = run_hydra(env, "down", timeout=90)
                assert res.returncode == 0, res.stdout + res.stderr
                up.proc.wait(30)
        for host in ("head", "peer"):
            wait_until(lambda h=host: not self.net.pids(h), 15,
                       f"no process left in {host}'s namespace", interval=0.2)

    def cleanup(self) -> None:
        for up in (self.head, self.peer):
            if up is not None:
                if up.proc.poll() is None:
                    up.stop()
                up.kill_everything()


@pytest.fixture
def pair(net: Hosts, tmp_path: Path) -> Iterator[Pair]:
    p = Pair(net, tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


DENSE = ("model: gemma3-270m\nmode: combine\nhead: cpu\nsplit: [9, 9]\n"
         "server_args: {ctx-size: 2048, parallel: 4, log-verbosity: 4, threads: 1,"
         " chat-template: gemma, no-jinja: true, n-predict: 32}\n")
MOE = ("model: synth-moe\nmode: combine\nhead: cpu\nmoe_split: experts\n"
       "server_args: {ctx-size: 1024, parallel: 4, log-verbosity: 4, threads: 1, n-predict: 32}\n")


def _stall_line(log: str) -> str:
    """The stall rule's verdict in hydra.log (what it saw: how long a request was owed)."""
    return next((ln for ln in log.splitlines() if "without a byte" in ln), "(none)")[-240:]


def _head_log(pair: Pair) -> str:
    logs = Path(pair.head_env["HYDRA_STATE_DIR"]) / "logs"
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("*.head.log")))


def test_head_host_serves_dense_and_moe_on_a_peer_hosts_cpu(pair: Pair) -> None:
    net = pair.net
    st = pair.start_peer()
    assert st["status"]["url"].endswith(f":{PEER_PORT}")
    endpoint = f"{net.addr('peer')}:{PEER_PORT}"

    # A source off rpc_allow (the client host) is closed without a byte at the peer's router.
    def hello_from_client() -> bytes:
        with socket.create_connection((net.addr("peer"), PEER_PORT), timeout=5) as s:
            s.sendall(rpcproto.HELLO_REQUEST)
            s.settimeout(5)
            return s.recv(64)
    assert net.call("client", hello_from_client) == b""
    # ...while the head host's HELLO is answered through it (no head holds the peer yet).
    assert net.call("head", lambda: rpcproto.probe(net.addr("peer"), PEER_PORT)).compatible()

    pair.start_head(DENSE, "far-dense")
    remote, head = pair.engines(pair.head_env)
    assert not remote["managed"] and remote["port"] == PEER_PORT and remote["pid"] is None
    r = pair.complete(8)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 8, r.text
    log = _head_log(pair)
    assert "offloaded 10/19 layers" in log
    # 9 blocks (32.8 MiB) and not the 170 MiB output layer: with the peer remote, the planner's
    # -ot rule keeps the output layer (tied to token_embd here) on the head.
    dense = re.findall(rf"RPC0\[{re.escape(endpoint)}\] model buffer size = +([\d.]+) MiB", log)
    assert dense and float(dense[-1]) == pytest.approx(32.8, abs=0.5), dense

    # The same peer host, now for MoE experts (the head let go of it when it stopped).
    assert pair.head is not None
    pair.head.stop()
    pair.start_head(MOE, "far-moe")
    r = pair.complete(8)
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 8, r.text
    sizes = re.findall(rf"RPC0\[{re.escape(endpoint)}\] model buffer size = +([\d.]+) MiB",
                       _head_log(pair))
    # exactly the expert tensors: 8 layers x 3 x (8 experts x 256 x 256) f16 = 24 MiB
    assert sizes and float(sizes[-1]) == pytest.approx(24.0, abs=0.1), "experts not on the peer"
    pair.down_both()


# -- faults -----------------------------------------------------------------------------------


class Clients:
    """Requests sent from the client host while a fault lasts: each records its outcome."""

    def __init__(self, pair: Pair) -> None:
        self.pair = pair
        self.results: list[str] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, n: int = 1) -> None:
        for _ in range(n):
            def one() -> None:
                try:
                    r = requests.post(self.pair.url("/completion"), timeout=300,
                                      json={"prompt": "Hello", "n_predict": 4})
                    ok = r.status_code == 200 and r.json().get("tokens_predicted") == 4
                    out = "ok" if ok else f"HTTP {r.status_code} {r.text[:200]}"
                except requests.RequestException as exc:
                    out = type(exc).__name__
                with self.lock:
                    self.results.append(out)
            self.threads.append(self.pair.net.thread("client", one))

    def join(self, timeout: float) -> list[str]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a held request never finished"
        return list(self.results)


def _stream(pair: Pair, started: threading.Event, outcome: list[str]) -> threading.Thread:
    """A long streamed completion in flight when the fault hits (it had started: it may be
    cut; what matters is that it ends)."""
    def body() -> None:
        try:
            with requests.post(pair.url("/completion"), stream=True, timeout=120,
                               json={"prompt": "Once upon a time", "n_predict": 1000,
                                     "stream": True}) as r:
                for _ in r.iter_lines():
                    started.set()
                outcome.append(str(r.status_code))
        except requests.RequestException as exc:
            outcome.append(type(exc).__name__)
        started.set()
    return pair.net.thread("client", body)


def _rpc_server_pid(pair: Pair) -> int:
    (peer,) = pair.engines(pair.peer_env)
    return int(peer["pid"])


FAULTS = ["peer-hydra-killed", "rpc-server-killed", "link-cut", "blackhole"]
# busy: a stream in flight when the fault hits; idle: nothing in flight (the head's link to its
# peer is silent, so the fault shows only when the requests sent after it reach the head)
CASES = [(f, "busy") for f in FAULTS] + [("peer-hydra-killed", "idle"), ("link-cut", "idle"),
                                         ("long-link-cut", "busy")]
# A cut longer than the peer's hold on a silent ggml-RPC client (11-15 s, router/conn.py): the
# dead head's session is gone at the peer by the restore, so the next head gets in at once:
# 3.0-3.7 s after the restore (without that bound: 13.8 s after a 30 s cut, 31 s after a 60 s
# one, when the killed head's retransmitted FIN finally reached the peer).
LONG_CUT_S, AFTER_RESTORE_S = 30.0, 8.0


@pytest.mark.faults
@pytest.mark.parametrize(("fault", "load"), CASES)
def test_peer_host_fault_is_detected_and_recovered(pair: Pair, fault: str, load: str) -> None:
    net = pair.net
    pair.start_peer()
    pair.start_head(DENSE, "far-dense")
    head_pid = next(e for e in pair.engines(pair.head_env) if e["role"] == "head")["pid"]
    r = pair.complete(4)
    assert r.status_code == 200, r.text

    started, stream_out = threading.Event(), []  # type: ignore[var-annotated]
    stream = _stream(pair, started, stream_out) if load == "busy" else None
    assert stream is None or started.wait(60), "the stream did not start"
    clients = Clients(pair)

    t0 = time.monotonic()
    if fault == "peer-hydra-killed":
        assert pair.peer is not None
        pair.peer.proc.send_signal(signal.SIGKILL)
        pair.peer.proc.wait(10)
    elif fault == "rpc-server-killed":
        psutil.Process(_rpc_server_pid(pair)).kill()
    elif fault in ("link-cut", "long-link-cut"):
        net.cut("peer")
    elif fault == "blackhole":
        # the peer host stops answering: what it sends the head is dropped (silence, not a
        # refusal, seen from the head)
        net.blackhole("peer", "head")
    clients.send(2)  # sent during the fault, before it is noticed

    def noticed() -> bool:
        es = pair.engines(pair.head_env)
        return bool(es) and any(e["state"] != "READY" for e in es)
    wait_until(noticed, 60, "the head host to notice the fault", interval=0.05)
    detected = time.monotonic() - t0
    clients.send(2)  # sent while the head host is recovering: held by its router

    # the peer away a while (not the assertion's reason: that is below)
    time.sleep(LONG_CUT_S - (time.monotonic() - t0) if fault == "long-link-cut" else 1.0)
    if fault == "peer-hydra-killed":
        # the peer host's hydra, brought back (as its service manager would)
        assert pair.peer is not None
        pair.peer.out.close()
        pair.peer.err.close()
        pair.start_peer()
    elif fault in ("link-cut", "long-link-cut"):
        net.restore("peer")
    elif fault == "blackhole":
        net.unblackhole("peer", "head")
    t_restored = time.monotonic()

    def back() -> bool:
        es = pair.engines(pair.head_env)
        return bool(es) and all(e["state"] == "READY" for e in es) and \
            next(e for e in es if e["role"] == "head")["pid"] != head_pid
    wait_until(back, 240, "the head host serving again with a new head")
    recovered = time.monotonic() - t0
    back_after = time.monotonic() - t_restored
    results = clients.join(240)
    if stream is not None:
        stream.join(130)
    r = pair.complete(4)
    hydra_log = (Path(pair.head_env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
    print(f"\n{fault} ({load}): noticed after {detected:.1f}s; serving again {recovered:.1f}s "
          f"after the fault ({time.monotonic() - t_restored:.1f}s after the restore); "
          f"requests sent during the fault: {results}; the stream in flight: {stream_out}")
    assert detected <= BOUND_S, f"noticed after {detected:.1f}s (bound {BOUND_S}s)"
    if fault == "long-link-cut":
        assert back_after <= AFTER_RESTORE_S, f"serving {back_after:.1f}s after the restore"
    assert results == ["ok"] * 4, (results, hydra_log[-3000:])
    assert r.status_code == 200, r.text
    assert "peer loss" in hydra_log, hydra_log[-3000:]  # the peer's loss, not the head's
    pair.down_both()


# Issue 31's bound under steady traffic: a frozen peer noticed within stall_timeout + 5 s.
STEADY_EVERY, STEADY_TIMEOUT, STEADY_BOUND_S = 2.0, 30.0, STALL + 5.0


@pytest.mark.faults
def test_sigstopped_remote_rpc_server_under_steady_traffic_is_noticed_at_stall_timeout(
        pair: Pair) -> None:
    """A request every 2 s from the client host, each writing its body to the head, while the
    remote peer's ggml-rpc-server is SIGSTOPped (its kernel still completes the stall rule's
    one connect): the oldest request is owed a byte from the stop on, so the stall rule fires
    at stall_timeout; after SIGCONT the head comes back (a new one) and serves."""
    net = pair.net
    rpc = pair.start_rpc_server()
    try:
        pair.start_head(DENSE, "far-steady")
        head_pid = next(e for e in pair.engines(pair.head_env) if e["role"] == "head")["pid"]
        steady = Steady(pair.url("/completion"), STEADY_EVERY, STEADY_TIMEOUT,
                        spawn=lambda fn: net.thread("client", fn)).start()
        try:
            wait_until(lambda: steady.ok() >= 2, 60, "steady traffic served before the stop")
            rpc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            sent0 = steady.sent

            def noticed() -> bool:
                es = pair.engines(pair.head_env)
                return bool(es) and any(e["state"] != "READY" for e in es)
            wait_until(noticed, STEADY_BOUND_S + 30, "the head host to notice the stop",
                       interval=0.05)
            took = time.monotonic() - t0
            during, first = steady.sent - sent0, steady.first_after(t0)
            rpc.send_signal(signal.SIGCONT)
            # Resumed, ggml-rpc-server answers the head it was serving — whose socket is gone —
            # and may die of SIGPIPE (llama.cpp's own behaviour): its service manager's restart.
            try:
                fate = f"exited {rpc.wait(5)} after SIGCONT; restarted"
                rpc = pair.start_rpc_server()
            except subprocess.TimeoutExpired:
                fate = "survived SIGCONT"

            def back() -> bool:
                es = pair.engines(pair.head_env)
                return bool(es) and all(e["state"] == "READY" for e in es) and \
                    next(e for e in es if e["role"] == "head")["pid"] != head_pid
            wait_until(back, 120, "the head back once the peer answers HELLO")
            back_s = time.monotonic() - t0
            ok_before = steady.ok()
            wait_until(lambda: steady.ok() >= ok_before + 2, 60, "steady traffic served again")
        finally:
            rpc.send_signal(signal.SIGCONT)
            outcomes = steady.stop(STEADY_TIMEOUT + 30)
        hydra_log = (Path(pair.head_env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
        print(f"\nremote rpc-server SIGSTOPped under a request every {STEADY_EVERY:g}s: noticed "
              f"after {took:.1f}s (stall_timeout {STALL:g}s; {during} request(s) sent "
              f"meanwhile, the first after {first or 0:.1f}s); it {fate}; serving again after "
              f"{back_s:.1f}s; outcomes: {outcomes}"
              f"\n  {_stall_line(hydra_log)}")
        assert STALL - INTERVAL <= took <= STEADY_BOUND_S, \
            f"noticed after {took:.1f}s (bound {STEADY_BOUND_S:.1f}s)"
        assert during >= 1, "no request went up during the stop: not steady traffic"
        assert "without a byte" in hydra_log and "peer loss" in hydra_log, hydra_log[-3000:]
        # the head host down first, while its peer still serves it: a `hydra down` sent just
        # after the peer's kill (its head dying of it) once exited 0 while the head host's
        # hydra kept running (1 run in 26; not this test's subject, reported)
        res = run_hydra(pair.head_env, "down", timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
        assert pair.head is not None
        pair.head.proc.wait(30)
    finally:
        rpc.kill()
        rpc.wait(10)
    pair.down_both()  # (the bare rpc-server is gone: its host's namespace must end empty)


# The bound on a crashed head host's session at the peer: the peer's router drops a ggml-RPC
# client that stops acknowledging (TCP keepalive and TCP_USER_TIMEOUT, router/relay.py), so the
# rpc-server it held serves the next head.
CRASH_BOUND_S = 60.0


def test_head_host_crash_frees_the_peer_for_its_next_head(pair: Pair) -> None:
    """A head host that loses power sends no FIN and no RST: without a bound at the peer, its
    rpc-server (one client at a time) would wait on that dead session for ever, and every later
    head would sit in its backlog."""
    net = pair.net
    pair.start_peer()
    pair.start_head(DENSE, "far-dense")
    assert pair.complete(4).status_code == 200
    assert pair.head is not None
    pair.head.out.close()
    pair.head.err.close()
    net.crash("head")
    pair.head.proc.wait(10)
    net.boot("head")
    t0 = time.monotonic()
    tries = 0
    while True:
        # as systemd's Restart=on-failure would: `hydra up` refuses (exit 2) while the peer is
        # still busy with the dead head's session, and is started again a moment later
        tries += 1
        try:
            pair.start_head(DENSE, "far-dense", timeout=120)
            break
        except AssertionError as exc:
            # the peer's router still holds the dead head's session and names it
            assert "is busy: its rpc-server is held by" in str(exc), exc
            assert time.monotonic() - t0 < CRASH_BOUND_S, f"still refused after {tries} tries"
            assert pair.head is not None
            pair.head.out.close()
            pair.head.err.close()
            time.sleep(2.0)  # systemd's RestartSec (the loop's deadline is asserted above)
    took = time.monotonic() - t0
    r = pair.complete(4)
    print(f"\nhead host crashed and rebooted: its next hydra ready after {took:.1f}s "
          f"({tries} starts)")
    assert r.status_code == 200, r.text
    assert took <= CRASH_BOUND_S, f"the peer took {took:.1f}s to serve the next head"
    pair.down_both()


@pytest.mark.faults
def test_link_cut_degrades_to_solo_and_returns_to_combine(pair: Pair) -> None:
    """on_peer_loss: degrade across hosts: the head host serves SOLO on its own CPU while the
    peer host is unreachable, and COMBINE again once it has been back stable_after (3 s)."""
    net = pair.net
    pair.start_peer()
    pair.start_head(DENSE, "far-degrade", policy="degrade")
    head_pid = next(e for e in pair.engines(pair.head_env) if e["role"] == "head")["pid"]
    started, stream_out = threading.Event(), []  # type: ignore[var-annotated]
    stream = _stream(pair, started, stream_out)
    assert started.wait(60), "the stream did not start"
    clients = Clients(pair)
    t0 = time.monotonic()
    net.cut("peer")
    clients.send(2)

    def solo() -> int | None:
        st = status_json(pair.head_env).get("status") or {}
        head = next((e for e in st.get("engines") or [] if e["role"] == "head"), None)
        ok = st.get("degraded") and head and head["state"] == "READY" and head["pid"] != head_pid
        return int(head["pid"]) if ok and head else None
    solo_pid = wait_until(solo, 60, "the SOLO head serving", interval=0.05)
    degraded_after = time.monotonic() - t0
    clients.send(2)
    assert clients.join(120) == ["ok"] * 4  # served by the SOLO head, the peer still away
    net.restore("peer")
    t_restored = time.monotonic()

    def combine() -> bool:
        st = status_json(pair.head_env).get("status") or {}
        es = st.get("engines") or []
        return not st.get("degraded") and bool(es) and all(e["state"] == "READY" for e in es) \
            and next(e for e in es if e["role"] == "head")["pid"] != solo_pid
    wait_until(combine, 120, "the head back to COMBINE")
    back_after = time.monotonic() - t_restored
    r = pair.complete(4)
    stream.join(130)
    print(f"\ndegrade: SOLO serving {degraded_after:.1f}s after the cut; COMBINE again "
          f"{back_after:.1f}s after the restore; the stream in flight: {stream_out}")
    assert r.status_code == 200, r.text
    assert f"{net.addr('peer')}:{PEER_PORT}" in _head_log(pair).split("far-degrade")[-1]
    pair.down_both()


@pytest.mark.faults
def test_link_cut_with_on_peer_loss_fail_ends_the_head_host_cleanly(pair: Pair) -> None:
    """on_peer_loss: fail across hosts: the head host's hydra ends FATAL (exit 1) within the
    bound; requests waiting are answered (not left hanging); nothing is left running there."""
    net = pair.net
    pair.start_peer()
    pair.start_head(DENSE, "far-fail", policy="fail")
    started, stream_out = threading.Event(), []  # type: ignore[var-annotated]
    stream = _stream(pair, started, stream_out)
    assert started.wait(60), "the stream did not start"
    clients = Clients(pair)
    t0 = time.monotonic()
    net.cut("peer")
    clients.send(2)
    assert pair.head is not None
    head = pair.head
    code = wait_until(lambda: head.proc.poll() is not None, 60, "the head host's hydra to end")
    ended = time.monotonic() - t0
    results = clients.join(60)
    stream.join(60)
    wait_until(lambda: not net.pids("head"), 15, "nothing left in the head's namespace")
    print(f"\nfail: hydra up exited {head.proc.returncode} {ended:.1f}s after the cut; requests "
          f"sent during the fault: {results}; the stream: {stream_out}")
    assert code and head.proc.returncode == 1, head.output()[-2000:]
    assert ended <= BOUND_S + 2.0
    assert "on_peer_loss is fail" in head.output()
    assert all(r != "ok" for r in results)  # answered (503 or refused), none hung
    net.restore("peer")
    pair.down_both()


def test_a_second_head_host_is_told_the_peer_is_busy(pair: Pair, tmp_path: Path) -> None:
    """A peer's rpc-server serves one head at a time: a second head host (allowed too) that
    starts while the first holds it is refused at `hydra up`, four times in a row, each time
    naming the holder (the head host's address and build), by the peer's router: nothing
    reaches the rpc-server's queue, the first head keeps serving, and the peer stays usable."""
    net = pair.net
    pair.allow([net.addr("head"), net.addr("client")])
    pair.start_peer()
    pair.start_head(DENSE, "far-dense")
    (tmp_path / "second").mkdir()
    env = make_env(tmp_path / "second", "devices:\n  far: {endpoint: '"
                   f"{net.addr('peer')}:{PEER_PORT}'{OVERRIDE}}}\n")
    prof = tmp_path / "head" / "far-dense.yaml"
    for _ in range(4):
        t0 = time.monotonic()
        res = subprocess.run(net.argv("client", [*HYDRA, "up", "--profile", str(prof)]),
                             env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
        took = time.monotonic() - t0
        print(f"\nsecond head host: exit {res.returncode} after {took:.1f}s: "
              f"{res.stderr.strip().splitlines()[-2:]}")
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"is busy: its rpc-server is held by {net.addr('head')}:" in res.stderr, \
            res.stderr
        assert "(build b" in res.stderr, res.stderr
        assert not net.pids("client")
        assert pair.complete(4).status_code == 200  # the first head was not disturbed
    pair.down_both()


def _head_process(env: dict[str, str]) -> dict[str, Any] | None:
    """The head's process row in the live `hydra status --json` (docs/control.md), if any."""
    snap = status_json(env).get("daemon") or {}
    for port in snap.get("ports") or []:
        for lane in port.get("lanes") or []:
            for proc in lane.get("processes") or []:
                if proc.get("role") == "head":
                    return dict(proc)
    return None


def _slow_head_link(net: Hosts) -> None:
    """The head host's egress at 100 Mbit: a cold remote load of the demo model takes ~20 s."""
    net.run("head", ["tc", "qdisc", "change", "dev", "eth0", "root", "tbf", "rate", "100mbit",
                     "burst", "1mb", "latency", "50ms"])


@dataclass
class LoadSeen:
    """A head's remote load as `hydra status` showed it, polled until the head was READY."""

    took: float = 0.0  # s from `hydra up` to READY
    samples: list[tuple[float, int | None, int]] = field(default_factory=list)  # (s, sent, of)
    lines: list[str] = field(default_factory=list)  # `hydra status` lines saying it, once

    def __str__(self) -> str:
        return (f"head READY {self.took:.1f}s after `hydra up`; status while loading:\n  "
                + "\n  ".join(self.lines) + "\n  samples (s, sent MiB, of MiB): "
                + ", ".join(f"({t:.1f}, {'?' if s is None else f'{s / 2**20:.0f}'}, "
                            f"{r / 2**20:.0f})" for t, s, r in self.samples[::4]))


def _rows_saying(table: str, words: str) -> list[str]:
    """The rows of `hydra status`'s process table that say `words`, each with its last cell's
    wrapped lines joined on (a row may wrap within the piped output's width)."""
    lines, rows = table.splitlines(), []
    for i, ln in enumerate(lines):
        if words not in ln:
            continue
        row = ln.strip()
        for more in lines[i + 1:]:
            cells = more.split("│")
            if len(cells) < 2 or cells[0].strip():
                break  # the next row, or the table's end
            row += " " + cells[-1].strip()
        rows.append(row)
    return rows


def _watch_load(pair: Pair, head: NsUp, t0: float, show: Callable[[int | None, int], bool]
                ) -> LoadSeen:
    """Poll the head's `remote_load` until it is READY; run `hydra status` (a CLI start, once)
    the first time `show(sent, total)` holds, keeping its lines that say it."""
    got = LoadSeen()

    def ready() -> bool:
        if head.proc.poll() is not None:
            raise AssertionError(f"hydra up exited {head.proc.returncode}:\n{head.output()}")
        row = _head_process(pair.head_env)
        if row is None:
            return False
        rl = row.get("remote_load")
        if rl is not None:
            sent, total = rl["sent_bytes"], rl["remote_bytes"]
            got.samples.append((time.monotonic() - t0, sent, total))
            if not got.lines and show(sent, total):
                out = run_hydra(pair.head_env, "status").stdout
                got.lines.extend(_rows_saying(out, "MiB to remote"))
        return row.get("state") == "READY"

    wait_until(ready, 240, "the head READY", interval=0.25)
    got.took = time.monotonic() - t0
    head.wait_ready(60)
    print(f"\n{got}")
    return got


def test_remote_load_progress_moves_before_the_head_is_ready(pair: Pair) -> None:
    """Issue 32: a head loading onto a peer host shows, in `hydra status`, the bytes the peer
    host's router has relayed of the remote weights, moving above 0 % before the head is READY
    (the head host's link at 100 Mbit and the peer's tensor cache cold: the load takes seconds)."""
    _slow_head_link(pair.net)
    pair.start_peer()
    t0 = time.monotonic()
    got = _watch_load(pair, pair.launch_head(DENSE, "far-dense"), t0,
                      lambda sent, total: sent is not None and 0.2 < sent / total < 0.8)
    seen, lines = got.samples, got.lines
    mid = [s for _, s, r in seen if s is not None and 0 < s < r]
    assert mid, f"no progress between 0 and 100 % before READY: {seen}"
    assert len(set(mid)) >= 2, f"progress did not move: {seen}"
    assert all(s is not None for _, s, _ in seen), seen  # a hydra peer: never unknown
    assert mid[-1] > mid[0], f"progress did not grow: {seen}"
    assert lines and re.search(r"sent [1-9][\d,]* of [\d,]+ MiB to remote peers \(\d+%",
                               lines[0]), lines
    assert _head_process(pair.head_env) is not None
    assert (_head_process(pair.head_env) or {}).get("remote_load") is None  # READY: gone
    assert pair.complete(4).status_code == 200
    pair.down_both()


def test_remote_load_onto_a_bare_rpc_server_says_unknown(pair: Pair) -> None:
    """A bare ggml-rpc-server peer (no router counts for it): the head's load progress is said
    to be unknown, never 0 %, and the rpc-server is never asked (a second connection would wait
    in its queue behind the head's: the head still becomes READY)."""
    _slow_head_link(pair.net)
    rpc = pair.start_rpc_server()
    try:
        got = _watch_load(pair, pair.launch_head(DENSE, "far-dense"), time.monotonic(),
                          lambda sent, total: sent is None)
        assert got.samples and all(s is None for _, s, _ in got.samples), got
        assert got.lines and re.search(r"sent \? of [\d,]+ MiB to remote peers \(",
                                       got.lines[0]), got.lines
        assert pair.complete(4).status_code == 200
        res = run_hydra(pair.head_env, "down", timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        rpc.kill()
        rpc.wait(10)
    pair.down_both()  # (the bare rpc-server is gone: its host's namespace must end empty)


# -- spare peers (issue 32, item 6) ---------------------------------------------------------------

SPARE_RUNS = 3


def _lend(pair: Pair, host: str) -> NsUp:
    """`hydra up` of the lend profile on a peer host (`peer` or `spare`), READY."""
    tmp = pair.tmp / host
    env = pair.peer_env if host == "peer" else make_env(tmp)
    if host != "peer":
        env["LLAMA_CACHE"] = str(tmp / "llama-cache")
        (tmp / "lend.yaml").write_text((pair.tmp / "peer" / "lend.yaml").read_text())
    up = NsUp(pair.net, host, env, ["--profile", str(tmp / "lend.yaml")], tmp)
    up.wait_ready(60)
    return up


def _spare_pair(net: Hosts, tmp_path: Path) -> tuple[Pair, str, str]:
    """The head host's pair whose far device is peer host A with spares: [B] (the "spare"
    namespace): (the pair, A, B)."""
    (tmp_path / "spare").mkdir()
    pair = Pair(net, tmp_path)
    a, b = f"{net.addr('peer')}:{PEER_PORT}", f"{net.addr('spare')}:{PEER_PORT}"
    pair.head_env = make_env(tmp_path / "head", f"devices:\n  far: {{endpoint: '{a}', "
                             f"spares: ['{b}']}}\n")
    return pair, a, b


@pytest.mark.faults
@pytest.mark.parametrize("fault", ["hydra-killed", "link-cut"])
def test_a_lost_peer_moves_onto_its_spare(tmp_path: Path, fault: str) -> None:
    """Head host, peer host A and spare peer host B, each a `hydra up` (A and B lend their CPU);
    the head's far device is A with spares: [B], on_peer_loss: restart. The hydra of the host
    the head uses is SIGKILLed (its rpc-server goes with it), or that host's link cut, and a
    request sent at once: the head moves onto the other host (B; on the next run A again, the
    primary being the other endpoint of the device) and serves it. Measured per run: the fault
    → that request's 200, and `hydra status` naming the endpoint it serves on. The host is
    brought back (hydra started again, or its link restored) after each run."""
    skip_unless_netns()
    with Hosts(["head", "peer", "client", "spare"]) as net:
        pair, a, b = _spare_pair(net, tmp_path)
        ups: dict[str, NsUp] = {}
        try:
            ups["peer"], ups["spare"] = _lend(pair, "peer"), _lend(pair, "spare")
            pair.start_head(DENSE, "far-dense")
            assert pair.complete(4).status_code == 200
            far = next(e for e in pair.engines(pair.head_env) if e["role"] == "peer")
            assert f"{far['host']}:{far['port']}" == a, far
            on, figures = "peer", []
            for run in range(SPARE_RUNS):
                other = "spare" if on == "peer" else "peer"
                head_pid = next(e for e in pair.engines(pair.head_env)
                                if e["role"] == "head")["pid"]
                t0 = time.monotonic()
                if fault == "link-cut":
                    net.cut(on)
                else:
                    ups[on].proc.send_signal(signal.SIGKILL)
                    ups[on].proc.wait(10)
                r = pair.complete(4, timeout=240)  # sent at once: served on the other host
                served = time.monotonic() - t0
                assert r.status_code == 200, r.text
                es = pair.engines(pair.head_env)
                far = next(e for e in es if e["role"] == "peer")
                head = next(e for e in es if e["role"] == "head")
                figures.append(served)
                print(f"\nrun {run + 1}: {fault} on {on} -> serving on {other} after "
                      f"{served:.1f}s;"
                      f" status: {far['reason']}")
                want = b if other == "spare" else a
                assert f"{far['host']}:{far['port']}" == want, far
                assert head["pid"] != head_pid and head["state"] == "READY", head
                if other == "spare":
                    assert f"serving on spare {b} (primary {a}: " in far["reason"], far
                    if fault == "link-cut":  # the stall rule's failed connect found it lost:
                        # the spare tried at once, the lost endpoint not probed again
                        assert f"(primary {a}: TCP connect timed out" in far["reason"], far
                    assert pair.head is not None and re.search(
                        rf"far-dense\.peer-far restarted \(HELLO answered; far: serving on "
                        rf"spare {re.escape(b)} ", pair.head.output()), pair.head.output()[-2000:]
                else:
                    assert "spare" not in far["reason"], far
                hydra_log = (Path(pair.head_env["HYDRA_STATE_DIR"]) / "logs" /
                             "hydra.log").read_text()
                assert "lost" in hydra_log and (f"serving on spare {b}" in hydra_log), \
                    hydra_log[-3000:]
                if fault == "link-cut":
                    net.restore(on)
                else:
                    ups[on].out.close()
                    ups[on].err.close()
                    ups[on] = _lend(pair, on)  # the killed host back (its service manager)
                on = other
            print(f"\n{fault}: loss -> serving on the other endpoint over {SPARE_RUNS} runs: "
                  + ", ".join(f"{s:.1f}s" for s in figures))
            res = run_hydra(pair.head_env, "down", timeout=90)
            assert res.returncode == 0, res.stdout + res.stderr
        finally:
            pair.cleanup()
            for up in ups.values():
                if up.proc.poll() is None:
                    up.stop()
                up.kill_everything()


def test_hydra_up_plans_on_the_spare_when_the_primary_is_down(tmp_path: Path) -> None:
    """The head's far device is A with spares: [B]; only B's hydra runs: `hydra up` plans on B
    (its --rpc), serves, and `hydra status` and the log say why not A."""
    skip_unless_netns()
    with Hosts(["head", "peer", "client", "spare"]) as net:
        pair, a, b = _spare_pair(net, tmp_path)
        spare: NsUp | None = None
        try:
            spare = _lend(pair, "spare")
            pair.start_head(DENSE, "far-dense")
            assert pair.complete(4).status_code == 200
            far = next(e for e in pair.engines(pair.head_env) if e["role"] == "peer")
            assert f"{far['host']}:{far['port']}" == b, far
            said = f"far: serving on spare {b} (primary {a}: remote peer far at {a} is unreachable"
            assert said in far["reason"], far
            log = (Path(pair.head_env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
            assert said in log, log[-3000:]
            res = run_hydra(pair.head_env, "down", timeout=90)
            assert res.returncode == 0, res.stdout + res.stderr
        finally:
            pair.cleanup()
            if spare is not None:
                if spare.proc.poll() is None:
                    spare.stop()
                spare.kill_everything()
