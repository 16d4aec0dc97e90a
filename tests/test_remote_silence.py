"""A remote peer that does not answer HELLO says why (issue 22: a head never sits in an
rpc-server's queue behind another head without saying so), on fake children: refused or closed
at once, or silent for the probe's timeout (its host gone, or busy with another head, or
frozen). The real cases across hosts are in tests/test_multihost.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from hydra_supervisor.proc.managed import State
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
