"""How far a head's load onto remote peers has got, for `hydra status` (issues 22, 32).

A head that loads layers or experts onto a ggml-RPC peer on another host sends their weights
over its socket to the peer host's router, which counts what it relays; while the head starts,
hydra asks that router about once a second (proc/sentwatch.py) and keeps the figure on the head
(`ManagedProcess.remote_sent`). Set against the weight bytes its plan puts on remote devices,
that is the load's progress. A warm or pre-filled peer cache (docs/multi-host.md) sends hashes
instead of most weights, so such a load finishes well short of the total: the figure is an
upper bound on the time left, not a promise. Where a remote peer's count cannot be told (a bare
ggml-rpc-server, an older hydra, no INFO answer) the progress is unknown, said so, never 0 %.
"""

from __future__ import annotations

from collections.abc import Mapping

from hydra_supervisor.plan.plan import Plan
from hydra_supervisor.serve.snapshot import RemoteLoad


def remote_weight_bytes(plan: Plan) -> int:
    """Weight bytes the plan places on devices of other hosts (remote peers)."""
    remote = {e.device for e in plan.engines if not e.managed}
    return sum(p.weight_bytes for p in plan.placements if p.device in remote)


def remote_load(plan: Plan, state: str, sent: Mapping[str, int | None]) -> RemoteLoad | None:
    """How much of the remote weights a head has sent, while it (in process state `state`) is
    starting and its plan puts weights on remote peers; None otherwise. `sent`: bytes sent so
    far to each remote device (None or missing: unknown); `sent_bytes` None: any is unknown."""
    total = remote_weight_bytes(plan)
    if total <= 0 or state != "STARTING":
        return None
    remote = {e.device for e in plan.engines if not e.managed}
    counts = [sent.get(d) for d in sorted(remote)]
    if any(c is None for c in counts):
        return RemoteLoad(sent_bytes=None, remote_bytes=total)
    return RemoteLoad(sent_bytes=min(sum(c or 0 for c in counts), total), remote_bytes=total)
