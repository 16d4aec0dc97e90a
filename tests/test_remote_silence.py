"""A remote peer that does not answer HELLO says why (issue 22: a head never sits in an
rpc-server's queue behind another head without saying so), on fake children: refused or closed
at once, or silent for the probe's timeout (its host gone, or busy with another head, or
frozen). The real cases across hosts are in tests/test_multihost.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hydra_supervisor.config.profile import TlsFiles
from hydra_supervisor.proc.managed import State
from hydra_supervisor.proc.rpcproto import HelloError, Version
from hydra_supervisor.tools.buildid import PeerInfo
from tests.fake_children import FakeWorld, Run, deployment, go

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("case", "expect"), [
    ("silent", "busy with another head: one at a time, this one waits in its queue"),
    ("refused", "refused or closed at once"),
])
def test_a_silent_remote_peer_is_told_apart(tmp_path: Path, case: str, expect: str) -> None:
    async def body(w: FakeWorld, tmp: Path) -> None:
        w.remote_up[50100] = True
        r = Run(w, deployment(1, remote=True), tmp).start()
        await r.all_ready()
        if case == "refused":
            del w.remote_up[50100]  # nothing on the port: HELLO fails at once
        else:
            w.remote_up[50100] = False  # HELLO waits its whole timeout
        w.live("head").kill(134)  # type: ignore[union-attr]   # aborts at its next RPC call
        await r.until(lambda: r.mp("peer-0").state is State.BACKOFF
                      and "no HELLO answer" in r.mp("peer-0").reason)
        assert expect in r.mp("peer-0").reason, r.mp("peer-0").reason
        w.remote_up[50100] = True
        await r.all_ready(30)
        await r.stop()
    go(tmp_path, body)


HOLDER = {"addr": "10.0.0.9:41000", "build": "b9999-cuda", "held_s": 12.0}


@pytest.mark.parametrize("host", ["hydra", "bare"])
def test_a_busy_peer_hydra_says_who_holds_it_on_a_re_probe(tmp_path: Path, host: str) -> None:
    """A peer lent by a peer host's hydra whose rpc-server another head holds: its router closes
    this head's HELLO after a brief hold (the HELLO reads "closed … after 0 bytes"), and the
    re-probe asks its INFO, as `hydra up` does, and says the holder — not "closed during HELLO".
    A bare ggml-rpc-server is never asked INFO (refused at once here: nothing listens)."""
    async def body(w: FakeWorld, tmp: Path) -> None:
        closing: set[int] = set()
        seams = w.seams()

        async def hello(host_: str, port: int, timeout: float = 3.0,
                        tls: TlsFiles | None = None) -> Version | None:
            if port in closing:  # the peer's router: held back 0.5 s, then closed
                await w.sleep(0.5)
                raise HelloError(f"{host_}:{port} closed the connection during HELLO after 0 "
                                 "bytes (not a ggml-rpc-server?)")
            return await seams.hello(host_, port, timeout, tls=tls)
        w.seams = lambda: replace(seams, hello=hello)  # type: ignore[method-assign]
        w.remote_up[50100] = True
        w.remote_info[50100] = PeerInfo(hydra=True) if host == "hydra" else \
            PeerInfo(hydra=False, note="not a hydra host: HELLO only")
        r = Run(w, deployment(1, remote=True), tmp).start()
        await r.all_ready()
        if host == "hydra":
            closing.add(50100)
            w.remote_info[50100] = PeerInfo(hydra=True, meta={"rpc_holder": HOLDER})
        else:
            del w.remote_up[50100]  # HELLO refused at once
        asked = dict(w.infos)
        w.live("head").kill(134)  # type: ignore[union-attr]
        await r.until(lambda: r.mp("peer-0").state is State.BACKOFF
                      and "probing again" in r.mp("peer-0").reason)
        reason = r.mp("peer-0").reason
        if host == "hydra":
            assert "127.0.0.1:50100: busy: its rpc-server is held by 10.0.0.9:41000 (build " \
                "b9999-cuda) for 12s; away" in reason, reason
        else:
            assert "refused or closed at once" in reason, reason
            assert w.infos == asked  # a bare rpc-server: no INFO
        closing.clear()
        w.remote_up[50100] = True
        w.remote_info[50100] = PeerInfo(hydra=host == "hydra")
        await r.all_ready(30)
        await r.stop()
    go(tmp_path, body)
