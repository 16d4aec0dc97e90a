"""A head's load onto remote peers, as `hydra status` shows it (serve/progress.py), and the
bytes sent counted from the peer host's router (proc/sentwatch.py), on an injected INFO reader
and clock."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from hydra_supervisor.cli.status_view import remote_load_text
from hydra_supervisor.config.profile import RestartPolicy
from hydra_supervisor.plan.plan import EngineSpec, Placement, Plan, Role
from hydra_supervisor.proc import sentwatch
from hydra_supervisor.proc.managed import ManagedProcess
from hydra_supervisor.proc.seams import Seams
from hydra_supervisor.serve import progress
from hydra_supervisor.serve.snapshot import RemoteLoad
from hydra_supervisor.tools.buildid import PeerInfo

MIB = 1 << 20


def _head() -> EngineSpec:
    return EngineSpec(name="head", role=Role.HEAD, program="llama-server", args=(), env=(),
                      host="127.0.0.1", port=30200, device="cpu", start_order=1)


def _peer(remote: bool) -> EngineSpec:
    return EngineSpec(name="peer-far", role=Role.PEER, program="ggml-rpc-server", args=(),
                      env=(), host="10.0.0.2", port=8090, device="far", start_order=0,
                      managed=not remote)


def _plan(remote: bool) -> Plan:
    places = (Placement("far", 9, 300 * MIB, 0, 0, 0), Placement("cpu", 9, 100 * MIB, 0, 0, 0))
    return Plan(profile="p", source="p.yaml", model_path="m.gguf", model_kind="dense",  # type: ignore[arg-type]
                mode="combine", transport="rpc",  # type: ignore[arg-type]
                engines=(_peer(remote), _head()), placements=places)


def test_progress_sets_the_bytes_sent_against_the_remote_weights() -> None:
    plan = _plan(remote=True)
    assert progress.remote_weight_bytes(plan) == 300 * MIB
    assert progress.remote_load(plan, "STARTING", {"far": 120 * MIB}) == RemoteLoad(
        sent_bytes=120 * MIB, remote_bytes=300 * MIB)
    # never past the total (the router counts graphs and hashes too), nothing once READY
    assert progress.remote_load(plan, "STARTING", {"far": 900 * MIB}) == RemoteLoad(
        sent_bytes=300 * MIB, remote_bytes=300 * MIB)
    assert progress.remote_load(plan, "READY", {"far": 1}) is None
    # a peer whose count cannot be told: unknown, not 0 %
    for sent in ({"far": None}, {}):
        assert progress.remote_load(plan, "STARTING", sent) == RemoteLoad(
            sent_bytes=None, remote_bytes=300 * MIB)


def test_a_local_peer_shows_nothing() -> None:
    assert progress.remote_load(_plan(remote=False), "STARTING", {"far": 1}) is None


def test_hydra_status_says_it_in_the_reason() -> None:
    text = remote_load_text(RemoteLoad(sent_bytes=120 * MIB, remote_bytes=300 * MIB))
    assert text == "; sent 120 of 300 MiB to remote peers (40%; a warm peer cache sends less)"
    unknown = remote_load_text(RemoteLoad(sent_bytes=None, remote_bytes=300 * MIB))
    assert unknown.startswith("; sent ? of 300 MiB to remote peers (progress unknown")
    assert remote_load_text(None) == ""


def _info(holder: Mapping[str, object] | None, *, hydra: bool = True,
          key: bool = True) -> PeerInfo:
    return PeerInfo(hydra=hydra, meta={"rpc_holder": holder} if key else {})


def test_the_holders_bytes_are_this_heads_only_when_it_can_be_this_head() -> None:
    held = {"addr": "10.0.0.1:40000", "build": None, "held_s": 3.0, "bytes_up": 5 * MIB,
            "bytes_down": 10}
    assert sentwatch.sent_by_holder(_info(held), alive_s=4.0) == 5 * MIB
    assert sentwatch.sent_by_holder(_info(None), alive_s=4.0) == 0  # not connected yet
    # held long before this head started: another head's bytes
    assert sentwatch.sent_by_holder(_info({**held, "held_s": 60.0}), alive_s=4.0) is None
    # no answer, a bare rpc-server, an older hydra without rpc_holder: unknown
    assert sentwatch.sent_by_holder(None, alive_s=4.0) is None
    assert sentwatch.sent_by_holder(_info(None, hydra=False), alive_s=4.0) is None
    assert sentwatch.sent_by_holder(_info(None, key=False), alive_s=4.0) is None
    assert sentwatch.sent_by_holder(_info({**held, "bytes_up": "x"}), alive_s=4.0) is None


class _World:
    """An injected clock and INFO reader: the peer's router counts 40 MiB a second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.asked: list[tuple[str, int]] = []
        self.changes = 0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)

    async def peer_info(self, host: str, port: int, timeout: float,
                        tls: object = None) -> PeerInfo | None:
        self.asked.append((host, port))
        if self.now < 1.0:
            return _info(None)  # the head has not connected yet
        return _info({"addr": "10.0.0.1:1", "held_s": self.now - 1.0,
                      "bytes_up": int((self.now - 1.0) * 40 * MIB), "bytes_down": 0})


def _procs(w: _World) -> tuple[ManagedProcess, ManagedProcess]:
    def changed(mp: ManagedProcess, transition: bool) -> None:
        w.changes += 1
    pol = RestartPolicy()
    head = ManagedProcess(_head(), "llama-server", Path("/dev/null"), pol, changed,
                          clock=w.clock)
    peer = ManagedProcess(_peer(True), "-", Path("/dev/null"), pol, changed, clock=w.clock)
    return head, peer


def _watch(w: _World, routed: set[str], until: float) -> list[Mapping[str, int | None]]:
    head, peer = _procs(w)
    seen: list[Mapping[str, int | None]] = []

    async def main() -> None:
        seams = Seams(clock=w.clock, sleep=w.sleep, peer_info=w.peer_info)
        task = asyncio.create_task(sentwatch.watch_sent(head, [peer], seams, routed))
        while w.now < until:
            seen.append(dict(head.remote_sent))
            await asyncio.sleep(0)
        seen.append(dict(head.remote_sent))
        task.cancel()
        await asyncio.wait([task])
    asyncio.run(main())
    return seen


def test_the_watch_publishes_the_bytes_sent_as_they_grow() -> None:
    w = _World()
    seen = _watch(w, {"peer-far"}, until=5.0)
    values = [s["far"] for s in seen if s.get("far") is not None]
    assert values[0] == 0 and values[-1] == 3 * 40 * MIB  # asked at t = 0, 1, ... 4
    assert values == sorted(values) and len(set(values)) == 4
    assert w.asked and set(w.asked) == {("10.0.0.2", 8090)}
    assert len(w.asked) == 5  # one INFO a second (SENT_INTERVAL), never faster
    assert w.changes == 4  # published only when the figure changes


def test_a_bare_peer_is_never_asked_and_is_unknown() -> None:
    w = _World()
    seen = _watch(w, set(), until=3.0)
    assert w.asked == []  # a second connection would queue in its rpc-server
    assert seen[-1] == {"far": None}
