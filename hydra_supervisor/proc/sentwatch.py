"""How many bytes a starting head has sent each remote peer: its load's progress (issue 32).

A head's llama-server sends a remote peer's weights over its ggml-RPC socket to the peer host's
router, which relays them to its rpc-server and counts what it relays for the head holding it
(INFO's `rpc_holder`: `bytes_up`, `held_s`; docs/protocol.md). While the head starts, hydra asks
each remote peer host's router for INFO about once a second (off the loop: `Seams.peer_info`
runs in a thread; the answer comes back to the loop, which alone sets the figure on the head).
The process's own counters cannot say it: `/proc/PID/io` wchar does not count socket sends.

What it cannot tell is said as unknown (None), never as 0: a bare ggml-rpc-server (no router
counts for it, and a second connection would take a place in its one-head queue, so it is never
asked), a peer host that does not answer INFO or whose INFO has no `rpc_holder` (an older
hydra), and a holder that has held the peer longer than this head has existed (another head).
No holder yet is 0: the head has not connected. A same-host peer (an internal port, no router)
is not counted: nothing of the load crosses a network.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from hydra_supervisor.proc.managed import ManagedProcess
from hydra_supervisor.proc.seams import Seams
from hydra_supervisor.tools.buildid import PeerInfo

# How often a starting head's remote peers are asked (one INFO each: a connection to the peer
# host's router; its figure comes from a snapshot at most 0.5 s old).
SENT_INTERVAL = 1.0
INFO_TIMEOUT = 2.0
# A holder may have connected this much before the head's start was seen here (clock skew
# between the spawn and the first INFO): more than that is another head.
HELD_SLACK = 2.0


def sent_by_holder(info: PeerInfo | None, alive_s: float) -> int | None:
    """Bytes a head alive for `alive_s` seconds has sent the peer that answered `info`
    (its router's count for the head holding it); None when that cannot be told."""
    if info is None or not info.hydra or "rpc_holder" not in info.meta:
        return None
    raw = info.meta.get("rpc_holder")
    if raw is None:
        return 0  # nothing holds it yet: this head has not connected
    holder = info.holder
    if holder is None:
        return None
    held, up = holder.get("held_s"), holder.get("bytes_up")
    if not isinstance(up, int) or not isinstance(held, (int, float)):
        return None
    if held > alive_s + HELD_SLACK:
        return None  # held since before this head started: not this head
    return up


async def watch_sent(head: ManagedProcess, peers: Sequence[ManagedProcess], seams: Seams,
                     routed: Collection[str]) -> None:
    """Until cancelled (the head's start is over): set on `head` the bytes sent to each remote
    peer's device. Only peers in `routed` (hydra hosts: INFO answered by a router) are asked."""
    remote = [p for p in peers if not p.spec.managed]
    if not remote:
        return
    started = seams.clock()
    head.sent_to_peers({})
    while True:
        sent: dict[str, int | None] = {}
        for p in remote:
            if p.name not in routed:
                sent[p.spec.device] = None
                continue
            info = await seams.peer_info(p.spec.host, p.spec.port, INFO_TIMEOUT, tls=p.spec.tls)
            sent[p.spec.device] = sent_by_holder(info, seams.clock() - started)
        head.sent_to_peers(sent)
        await seams.sleep(SENT_INTERVAL)
