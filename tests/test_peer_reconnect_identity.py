"""A remote peer's build identity is checked on every (re)connect (issue 32, item 2), not only
at `hydra up`: before each start of its head (the first, after a crash, after the peer's loss)
hydra asks the peer host's router Hydra INFO again. A peer host back with another build is
refused with `hydra up`'s message (both builds, the fix) and the lane ends FATAL; with
`allow_build_mismatch: true` it is used, with the warning logged once. Fake children and a fake
INFO answer (tests/fake_children.py); the real peer hydra is in tests/test_peer_identity.py."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hydra_supervisor.config.profile import DeviceDecl, Node, PeerLoss
from hydra_supervisor.plan.deployment import Deployment
from hydra_supervisor.proc.managed import State
from hydra_supervisor.tools.buildid import BuildIdentity, PeerInfo
from tests.fake_children import FakeWorld, Run, deployment, go

pytestmark = pytest.mark.timeout(60)

HERE = BuildIdentity(11434, "sdist-b0a2feb64c6f", "0.6.0-dev", "7.0.0", ("CPU", "RPC"))
OTHER = BuildIdentity(11433, "sdist-000000000000", "0.6.0-dev", "7.0.0", ("CPU", "RPC"))
PORT = 50100  # the fake remote peer-0 (device gpu1)
REFUSAL = ("build identity mismatch (different builds): remote peer gpu1 at 127.0.0.1:50100 "
           f"runs {OTHER}; this host runs {HERE}; fix: run `hydra install-llama` of the same pin")


def with_node(dep: Deployment, allow: bool) -> Deployment:
    """The node file's remote device, as the layout a real `hydra up` builds carries it."""
    node = Node(source="node.yaml", devices={"gpu1": DeviceDecl(
        name="gpu1", endpoint=f"127.0.0.1:{PORT}", allow_build_mismatch=allow)})
    lay: Any = SimpleNamespace(node=node)
    return replace(dep, layout=lay)


def world(w: FakeWorld) -> None:
    w.identity = HERE
    w.remote_up[PORT] = True
    w.remote_info[PORT] = PeerInfo(hydra=True, identity=HERE)


@pytest.mark.parametrize("how", ["head-crash", "peer-lost"])
def test_a_peer_back_with_another_build_is_refused_on_reconnect(tmp_path: Path, how: str):
    async def body(w: FakeWorld, tmp: Path) -> None:
        world(w)
        r = Run(w, with_node(deployment(1, remote=True), allow=False), tmp).start()
        await r.all_ready()
        asked = w.infos[PORT]
        assert asked >= 1  # checked before the first start too
        w.remote_info[PORT] = PeerInfo(hydra=True, identity=OTHER)  # its host reinstalled
        if how == "peer-lost":
            del w.remote_up[PORT]  # gone for a while (HELLO refused)...
            w.live("head").kill(134)  # type: ignore[union-attr]   # its next RPC call aborts
            await r.until(lambda: r.mp("peer-0").state is State.BACKOFF)
            w.remote_up[PORT] = True  # ...and back, with another build
        else:  # back at once: the head's restart finds it answering HELLO
            w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.sup.fatal is not None)
        assert r.task is not None
        await r.task
        assert w.infos[PORT] > asked
        peer = r.mp("peer-0")
        assert peer.state is State.FATAL
        assert peer.reason.startswith(REFUSAL), peer.reason
        assert "allow_build_mismatch: true" in peer.reason
        assert r.sup.fatal is not None and REFUSAL in r.sup.fatal
        assert r.mp("head").state is not State.READY
        assert [c for c in w.children if c.returncode is None] == []
    go(tmp_path, body)


def test_the_override_serves_on_and_warns_once(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture):
    async def body(w: FakeWorld, tmp: Path) -> None:
        world(w)
        w.remote_info[PORT] = PeerInfo(hydra=True, identity=OTHER)
        r = Run(w, with_node(deployment(1, remote=True), allow=True), tmp).start()
        await r.all_ready()
        for _ in range(2):  # two head restarts: checked each time, said once
            asked, restarts = w.infos[PORT], r.mp("head").restarts
            w.live("head").kill(134)  # type: ignore[union-attr]
            await r.until(lambda n=restarts: r.mp("head").restarts > n
                          and r.mp("head").state is State.READY)
            assert w.infos[PORT] > asked
        await r.stop()
    with caplog.at_level(logging.WARNING, logger="hydra"):
        go(tmp_path, body)
    said = [r.getMessage() for r in caplog.records if "build identity mismatch" in r.getMessage()]
    assert len(said) == 1, said
    assert "(allowed: allow_build_mismatch: true on device 'gpu1')" in said[0]


def test_a_peer_back_with_another_build_leaves_a_degraded_head_solo(tmp_path: Path):
    async def body(w: FakeWorld, tmp: Path) -> None:
        world(w)
        dep = deployment(1, remote=True, on_peer_loss=PeerLoss.DEGRADE)
        r = Run(w, with_node(dep, allow=False), tmp).start()
        await r.all_ready()
        del w.remote_up[PORT]
        w.remote_info[PORT] = PeerInfo(hydra=True, identity=OTHER)
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.sup.degraded is not None)
        w.remote_up[PORT] = True
        await r.until(lambda: "DEGRADED for good" in (r.sup.degraded or ""))
        assert REFUSAL in (r.sup.degraded or "")
        await r.until(lambda: r.mp("head").state is State.READY)
        await r.stop()
    go(tmp_path, body)


def test_a_bare_peer_is_asked_info_only_after_a_hello(tmp_path: Path):
    """A bare ggml-rpc-server (no INFO) is not asked again before each head start: a connection
    that is not a HELLO would wait in its queue behind a head it serves."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        world(w)
        w.remote_info[PORT] = PeerInfo(hydra=False, note="not a hydra host: HELLO only")
        r = Run(w, with_node(deployment(1, remote=True), allow=False), tmp).start()
        await r.all_ready()
        assert w.infos[PORT] == 1  # asked once, when it answered HELLO
        restarts = r.mp("head").restarts
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.mp("head").restarts > restarts
                      and r.mp("head").state is State.READY)
        assert w.infos[PORT] == 1
        await r.stop()
    go(tmp_path, body)
