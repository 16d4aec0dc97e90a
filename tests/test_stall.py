"""Every frozen peer noticed (issues 20 item 7, 31 item 1): the stall rule judges from what
hydra sees without asking the frozen process — the router's requests in flight and how long the
head has owed them a byte (the oldest one waiting, new requests going up meanwhile or not), CPU
progress over a trailing window and D state of the head and its local peers, a remote peer's
TCP connect — then on_peer_loss runs. Fake children on the policy clock (tests/fake_children.py)
for the rule; the router gate's measure on real sockets and on injected clocks (Wires); the
real binaries frozen under traffic are in tests/test_stall_freezer.py and test_multihost.py."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from hydra_supervisor.config.profile import HealthPolicy, PeerLoss
from hydra_supervisor.proc.managed import State
from hydra_supervisor.router.gate import Flight, Gate, Wire
from hydra_supervisor.testing.harness import wait_until
from tests.fake_children import Behaviour, FakeChild, FakeWorld, Run, deployment

# FAST_HEALTH: interval 0.5, hang_timeout 5 → stall_timeout 5 (its default is hang_timeout).
STALL = 5.0
INTERVAL = 0.5
# Detection bound (docs/supervision.md): stall_timeout + 2 × (interval + /health's timeout),
# plus JITTER: 2 policy seconds are 40 ms of real time at SCALE 50, what a busy machine's
# scheduler can add to the fake clock's ticks.
JITTER = 2.0
BOUND = STALL + 4 * INTERVAL + JITTER


def go(tmp: Path, body: Callable[[FakeWorld, Path], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(FakeWorld(), tmp), 50))


def live(w: FakeWorld, name: str) -> FakeChild:
    c = w.live(name)
    assert c is not None, name
    return c


def reasons(r: Run, name: str) -> list[str]:
    return [why for n, _, why in r.transitions if n == name]


def watch_loss(w: FakeWorld, r: Run, words: str) -> list[float]:
    """The policy time at which the head was stopped for a reason containing `words`."""
    seen: list[float] = []
    r.sup.listeners.append(lambda mp: seen.append(w.clock()) if mp.is_head and words in
                           mp.reason and mp.state is State.STOPPING else None)
    return seen


async def freeze_peer_with_requests(w: FakeWorld, r: Run, n: int = 3) -> tuple[FakeChild, float]:
    """All READY; then n requests go in flight, and the peer freezes in S (as the cgroup v2
    freezer leaves it): its head waits on it, so no byte moves and no CPU is used."""
    await r.all_ready()
    peer = live(w, "peer-0")
    w.inflight, w.owed_since = n, w.clock()
    peer.hung = True
    return peer, w.clock()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", [PeerLoss.RESTART, PeerLoss.DEGRADE, PeerLoss.FAIL])
def test_frozen_peer_with_silent_requests_is_lost_then_policy_runs(
        tmp_path: Path, policy: PeerLoss) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1, on_peer_loss=policy), tmp)
        seen = watch_loss(w, r, "without a byte")
        r.start()
        peer, t0 = await freeze_peer_with_requests(w, r)
        await r.until(lambda: seen, 30)
        assert STALL - INTERVAL <= seen[0] - t0 <= BOUND, seen[0] - t0
        await r.until(lambda: signal.SIGKILL in peer.signals, 10)
        w.inflight = 0  # the pair's requests end with it
        lost = [x for x in reasons(r, "head") if "without a byte" in x]
        assert lost and "frozen peer" in lost[0], reasons(r, "head")
        if policy is PeerLoss.RESTART:
            await r.all_ready()
            assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        elif policy is PeerLoss.DEGRADE:
            await r.until(lambda: r.sup.degraded and r.mp("head").state is State.READY
                          and "--rpc" not in r.mp("head").spec.args)
        else:
            assert r.task is not None
            await w.wait_for(r.task.done, 20)
            assert r.sup.fatal and "on_peer_loss is fail" in r.sup.fatal
            return
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_a_frozen_pairs_request_handling_is_not_cpu_progress(tmp_path: Path) -> None:
    """Under steady traffic a frozen pair's head still takes requests and /health on its HTTP
    threads: /proc shows that as a 10 ms step of CPU time now and then (here one every 2 s:
    2 % of one 0.5 s sample, which once reset the rule's no-progress clock each time). Judged
    over 2 s it stays under 1 %: no progress, and the stall is seen within the bound."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp)
        seen = watch_loss(w, r, "without a byte")
        r.start()
        peer, t0 = await freeze_peer_with_requests(w, r)
        head = live(w, "head")

        async def http_thread() -> None:
            while True:
                await w.sleep(2.0)
                head.charge(0.01)
        steps = asyncio.ensure_future(http_thread())
        try:
            await r.until(lambda: seen, 30)
        finally:
            steps.cancel()
        assert STALL - INTERVAL <= seen[0] - t0 <= BOUND, seen[0] - t0
        await r.until(lambda: signal.SIGKILL in peer.signals, 10)
        w.inflight = 0
        await r.all_ready()
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_d_state_peer_with_silent_requests_is_lost(tmp_path: Path) -> None:
    """A peer in D state (a wedged driver) with requests in flight: the stall rule or the
    D-state rule, whichever sees it first — within the bound either way."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp)
        seen = watch_loss(w, r, "")
        r.start()
        await r.all_ready()
        peer = live(w, "peer-0")
        w.inflight, w.owed_since = 2, w.clock()
        peer.dsleep = True
        t0 = w.clock()
        await r.until(lambda: seen, 30)
        assert STALL - INTERVAL <= seen[0] - t0 <= BOUND, (seen[0] - t0, reasons(r, "head"))
        w.inflight = 0
        await r.all_ready()
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        assert any("without a byte" in x or "state D" in x for x in reasons(r, "head"))
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_idle_pair_with_d_state_peer_is_lost_but_not_while_the_head_loads(
        tmp_path: Path) -> None:
    """Nothing in flight: a peer in D with no CPU progress for stall_timeout while its head
    serves is frozen (an idle ggml-rpc-server waits in S). While its head loads it is not
    judged (a peer may read its tensor cache from a slow disk then)."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.behaviours["head"] = [Behaviour(load=4 * STALL), Behaviour(load=1)]
        r = Run(w, deployment(1), tmp)
        seen = watch_loss(w, r, "state D")
        r.start()
        await r.until(lambda: w.live("head") is not None)
        peer = live(w, "peer-0")
        peer.dsleep = True
        await r.until(lambda: r.mp("head").state is State.READY, 40)
        ready = w.clock()
        assert not peer.signals and w.spawned() == ["peer-0", "head"]
        await r.until(lambda: seen, 30)
        assert STALL <= seen[0] - ready <= STALL + 2 * INTERVAL + JITTER, seen[0] - ready
        await r.all_ready()
        assert w.spawned() == ["peer-0", "head", "peer-0", "head"]
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_long_prefill_without_bytes_is_not_a_stall(tmp_path: Path) -> None:
    """A non-streaming request in a long prefill: no byte for 4× stall_timeout, but the head's
    CPU advances — left alone. Then the same with the peer doing the work (its CPU advances)."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        head, peer = live(w, "head"), live(w, "peer-0")
        w.inflight, w.owed_since = 1, w.clock()
        head.working = True
        await w.sleep(4 * STALL)
        head.working, peer.working = False, True
        await w.sleep(4 * STALL)
        assert w.spawned() == ["peer-0", "head"]
        assert r.mp("head").state is State.READY and r.mp("peer-0").state is State.READY
        assert not peer.signals and not head.signals
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_bytes_flowing_or_nothing_in_flight_is_not_a_stall(tmp_path: Path) -> None:
    """No CPU progress anywhere (fake children use none unless told), yet: requests whose
    bytes keep moving (a stream), then an idle pair with nothing in flight — neither is a
    stall, and nothing probes anyone."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(1), tmp).start()
        await r.all_ready()
        w.inflight = 2
        for _ in range(int(3 * STALL / INTERVAL)):
            w.owed_since = w.clock()
            await w.sleep(INTERVAL)
        w.inflight = 0
        await w.sleep(3 * STALL)
        assert w.spawned() == ["peer-0", "head"] and r.mp("head").state is State.READY
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_d_state_solo_head_with_silent_requests_is_hung(tmp_path: Path) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        r = Run(w, deployment(0), tmp)
        seen: list[float] = []
        r.sup.listeners.append(lambda mp: seen.append(w.clock())
                               if mp.state is State.BACKOFF else None)
        r.start()
        await r.all_ready()
        head = live(w, "head")
        w.inflight, w.owed_since = 1, w.clock()
        head.dsleep = True
        t0 = w.clock()
        await r.until(lambda: seen, 30)
        assert STALL - INTERVAL <= seen[0] - t0 <= BOUND, seen[0] - t0
        assert signal.SIGKILL in head.signals
        w.inflight = 0
        await r.all_ready()
        assert w.spawned() == ["head", "head"]
        assert any("without a byte" in x and "hung" in x for x in reasons(r, "head"))
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_remote_peer_whose_connect_times_out_is_lost(tmp_path: Path) -> None:
    """A remote peer's host gone (a black hole): the head's requests fall silent, and once they
    have been for the freeze grace (1 s here) a TCP connect to the endpoint times out (3 s):
    lost then — long before stall_timeout (30 s here) — the head is stopped once, and the peer
    is re-probed with HELLO until it is back."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.remote_up[50100] = True
        dep = deployment(1, remote=True,
                         health=HealthPolicy(interval=INTERVAL, hang_timeout=5,
                                             stall_timeout=30))
        r = Run(w, dep, tmp)
        seen = watch_loss(w, r, "is gone")
        r.start()
        await r.all_ready()
        head = live(w, "head")
        w.inflight, w.owed_since = 2, w.clock()
        w.remote_up[50100] = False
        w.connect_fails[50100] = "timeout"
        t0 = w.clock()
        await r.until(lambda: seen, 30)
        # the freeze grace (1 s), one sample (2 × interval at most), the connect's 3 s
        assert 1.0 + 3.0 <= seen[0] - t0 <= 1.0 + 2 * INTERVAL + 3.0 + JITTER, \
            seen[0] - t0
        await r.until(lambda: r.mp("peer-0").state is State.BACKOFF, 10)
        assert w.connects == [50100]
        assert head.returncode is not None  # stopped once, not crash-looped
        assert any("is gone (TCP connect timed out" in x for x in reasons(r, "head"))
        w.inflight = 0
        await w.sleep(5)
        assert len(w.spawned("head")) == 1 and r.sup.fatal is None
        w.remote_up[50100] = True
        del w.connect_fails[50100]
        await r.all_ready(30)
        assert len(w.spawned("head")) == 2
        await r.stop()
    go(tmp_path, body)


@pytest.mark.timeout(60)
def test_frozen_remote_peer_is_lost_at_stall_timeout_with_one_connect(tmp_path: Path) -> None:
    """A remote ggml-rpc-server frozen (its kernel still completes a connect: the listener's
    backlog): one connect probe, which succeeds, then the stall rule at stall_timeout."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.remote_up[50100] = True
        r = Run(w, deployment(1, remote=True), tmp)
        seen = watch_loss(w, r, "without a byte")
        r.start()
        await r.all_ready()
        w.inflight, w.owed_since = 1, w.clock()
        t0 = w.clock()
        await r.until(lambda: seen, 30)
        assert STALL - INTERVAL <= seen[0] - t0 <= BOUND, seen[0] - t0
        assert w.connects == [50100]  # one per head run: the rpc-server's backlog holds two
        w.inflight = 0
        await r.all_ready(30)
        assert len(w.spawned("head")) == 2
        await r.stop()
    go(tmp_path, body)


# -- the router's byte clock: what the head owes, from the kernel --------------------------------


def test_gate_owed_for_reads_the_kernels_clocks() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    cli = socket.create_connection(srv.getsockname())
    up, _ = srv.accept()
    try:
        g = Gate(1, 1)
        assert g.owed_for() is None
        f = g.begin()
        assert g.owed_for() is None  # no upstream socket yet: nothing to judge by
        g.attach(f, cli)
        cli.sendall(b"GET / HTTP/1.1\r\n\r\n")
        time.sleep(0.4)
        q = g.owed_for()
        assert q is not None and 0.3 <= q < 2.0, q
        up.sendall(b"x")  # a byte from the head, not read yet: owed nothing
        wait_until(lambda: g.owed_for() == 0.0, 5, "the unread byte seen")
        assert cli.recv(1) == b"x"
        q = g.owed_for()
        assert q is not None and q < 0.3, q
        time.sleep(0.4)
        q = g.owed_for()
        assert q is not None and q >= 0.3, q  # owed again since that byte
        g.end(f)
        assert g.owed_for() is None
    finally:
        for s in (cli, up, srv):
            s.close()


class Wires:
    """Injected seams for the gate: a clock the test moves, and each upstream socket's byte
    clocks (when a byte last went up, last came back; unread bytes) as the kernel would say."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sent: dict[socket.socket, float] = {}
        self.recv: dict[socket.socket, float] = {}
        self.unread: dict[socket.socket, int] = {}
        self.socks: list[socket.socket] = []
        self.gate = Gate(1, 10, clock=lambda: self.now, wire=self.wire)

    def wire(self, sock: socket.socket) -> Wire | None:
        return Wire(self.now - self.sent[sock], self.now - self.recv[sock],
                    self.unread.get(sock, 0))

    def request(self, connected_at: float | None = None) -> tuple[Flight, socket.socket]:
        """A request sent upstream now, on a new connection (or one made at `connected_at`
        and last used then: a pooled one)."""
        sock = socket.socket()
        self.socks.append(sock)
        f = self.gate.begin()
        self.sent[sock] = self.recv[sock] = self.now if connected_at is None else connected_at
        self.gate.attach(f, sock)
        self.sent[sock] = self.now  # the request goes up
        return f, sock

    def close(self) -> None:
        for s in self.socks:
            s.close()


def test_owed_for_is_the_oldest_request_owed_while_new_ones_go_up() -> None:
    """The issue 31 case: one request every 2 s writes its body upstream, and the head answers
    none of them. The oldest has been owed since the freeze: the new bodies going up do not
    hide it (they did when the quietest socket, either way, was the measure)."""
    w = Wires()
    try:
        w.request()
        for _ in range(10):
            w.now += 2.0
            w.request()
            w.now += 0.001
        assert w.gate.owed_for() == pytest.approx(20.01)
        # all of them answered (streams: a byte each just now) → owed nothing much
        for s in w.socks:
            w.recv[s] = w.now
        w.now += 0.3
        assert w.gate.owed_for() == pytest.approx(0.3)
    finally:
        w.close()


def test_owed_for_requests_without_a_socket_uploads_unread_bytes_and_pooled_connections() -> None:
    w = Wires()
    try:
        g = w.gate
        g.begin()
        assert g.owed_for() is None  # in flight, no upstream socket yet: nothing to judge by
        w.now += 50
        f, s = w.request(connected_at=w.now - 100)  # a pooled connection, idle 100 s
        w.now += 1.0
        assert g.owed_for() == pytest.approx(1.0)  # owed since its request, not the pool's
        for _ in range(5):  # a slow upload: the request's body still going up
            w.now += 3.0
            w.sent[s] = w.now - 0.5
        assert g.owed_for() == pytest.approx(0.5)
        w.now += 10
        w.unread[s] = 100  # the head answered; the router (a slow client) has not read it
        assert g.owed_for() == 0.0
        g.end(f)
    finally:
        w.close()
