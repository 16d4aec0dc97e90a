"""How far a head's load onto remote peers has got, for `hydra status` (issue 22).

A head that loads layers or experts onto a ggml-RPC peer on another host sends their weights
over its sockets; the kernel counts every byte the process writes (`/proc/PID/io`, wchar). Set
against the weight bytes its plan puts on remote devices, that is the load's progress. A warm
or pre-filled peer cache (docs/multi-host.md) sends hashes instead of most weights, so such a
load finishes well short of the total: the figure is an upper bound on the time left, not a
promise. Log lines count too (a few KiB).
"""

from __future__ import annotations

from collections.abc import Callable

from hydra_supervisor.plan.plan import Plan


def remote_weight_bytes(plan: Plan) -> int:
    """Weight bytes the plan places on devices of other hosts (remote peers)."""
    remote = {e.device for e in plan.engines if not e.managed}
    return sum(p.weight_bytes for p in plan.placements if p.device in remote)


def _read_io(pid: int) -> str:
    with open(f"/proc/{pid}/io") as f:
        return f.read()


def written_bytes(pid: int, read: Callable[[int], str] = _read_io) -> int | None:
    """Bytes the process has written so far (any descriptor), or None when unreadable."""
    try:
        text = read(pid)
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "wchar":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def remote_load(plan: Plan, pid: int | None, state: str,
                read: Callable[[int], str] = _read_io) -> dict[str, int] | None:
    """{"sent_bytes", "remote_bytes"} while the head (`pid`, in process state `state`) is
    starting and its plan puts weights on remote peers; None otherwise."""
    total = remote_weight_bytes(plan)
    if total <= 0 or not pid or state != "STARTING":
        return None
    sent = written_bytes(int(pid), read)
    if sent is None:
        return None
    return {"sent_bytes": min(sent, total), "remote_bytes": total}
