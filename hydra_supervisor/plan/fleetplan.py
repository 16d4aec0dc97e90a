"""Room on the devices for one more profile: pure decisions (tests/test_fleetplan.py).

A node serving several profiles knows, from each profile's plan, how many bytes it needs on each
physical device (two device names can be one device: `cpu` and `cpu-peer` are both host memory).
Before a profile loads, `make_room` says whether it fits beside the ones that run, which of them
to stop first (least recently used first, never one still inside its `min_resident` window, and
never one that is loading or already stopping), or why it has to wait or can never fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from hydra_supervisor.plan.devices import Device, Kind

MIB = 1024 * 1024
Needs = Mapping[str, int]  # physical device key -> bytes


def device_key(dev: Device) -> str:
    """One key per physical device: the host's memory, one GPU, one remote peer."""
    if dev.kind is Kind.CPU:
        return "host"
    if dev.kind is Kind.CUDA:
        return f"cuda{dev.cuda_index}"
    return f"remote:{dev.endpoint}"


def needs_of(placements: Sequence[tuple[str, int]],
             devices: Mapping[str, Device]) -> dict[str, int]:
    """Bytes per physical device from a plan's placements ((device name, bytes) pairs). A
    placement on a name the node does not know (the resolver's "cpu (host RAM)" row) is host
    memory."""
    out: dict[str, int] = {}
    for name, nbytes in placements:
        dev = devices.get(name)
        key = device_key(dev) if dev is not None else "host"
        out[key] = out.get(key, 0) + nbytes
    return out


def capacity_of(devices: Mapping[str, Device]) -> dict[str, int]:
    """What each physical device offers (its free bytes before hydra loads anything; a node
    file's memory_mib overrides). 0 means unknown: that device is not budgeted."""
    out: dict[str, int] = {}
    for dev in devices.values():
        key = device_key(dev)
        out[key] = max(out.get(key, 0), dev.free)
    return out


@dataclass(frozen=True)
class Occupant:
    """A profile that holds device memory now (running, loading or stopping)."""

    name: str
    needs: Needs
    last_used: float  # monotonic: its last request (or its load)
    evictable_at: float  # monotonic: loaded_at + min_resident
    movable: bool = True  # False while it loads or stops (it cannot be chosen)
    standby: bool = False  # a standby layout (serve/standby.py): evicted before any other


class Verdict(Enum):
    FITS = "fits"  # load now
    EVICT = "evict"  # stop `victims` (in order), then load
    WAIT = "wait"  # not now: `reason` says who is in the way and until when
    NEVER = "never"  # the profile alone is larger than the node


@dataclass(frozen=True)
class Room:
    verdict: Verdict
    victims: tuple[str, ...] = ()
    reason: str = ""
    retry_at: float | None = None  # WAIT: when the first blocker may move
    short: dict[str, int] = field(default_factory=dict)  # bytes missing per device


def _over(capacity: Mapping[str, int], used: Mapping[str, int],
          want: Needs) -> dict[str, int]:
    short = {}
    for key, n in want.items():
        cap = capacity.get(key, 0)
        if cap and n and used.get(key, 0) + n > cap:
            short[key] = used.get(key, 0) + n - cap
    return short


def shortfall(capacity: Mapping[str, int], occupants: Sequence[Occupant],
              want: Needs) -> dict[str, int]:
    """Bytes missing per device for `want` beside `occupants` (empty: it fits)."""
    return _over(capacity, _sum(occupants), want)


def _sum(occupants: Sequence[Occupant]) -> dict[str, int]:
    used: dict[str, int] = {}
    for o in occupants:
        for key, n in o.needs.items():
            used[key] = used.get(key, 0) + n
    return used


def make_room(capacity: Mapping[str, int], occupants: Sequence[Occupant], want: Needs,
              now: float, name: str = "the profile") -> Room:
    alone = _over(capacity, {}, want)
    if alone:
        what = ", ".join(f"{k}: needs {want[k] / MIB:,.0f} MiB of {capacity[k] / MIB:,.0f}"
                         for k in sorted(alone))
        return Room(Verdict.NEVER, reason=f"{name} does not fit this node even alone ({what})",
                    short=alone)
    short = _over(capacity, _sum(occupants), want)
    if not short:
        return Room(Verdict.FITS)
    # Only occupants on a short device free anything that helps.
    helpful = [o for o in occupants if any(o.needs.get(k, 0) for k in short)]
    ready = sorted((o for o in helpful if o.movable and (o.standby or o.evictable_at <= now)),
                   key=lambda o: (not o.standby, o.last_used, o.name))
    chosen: list[Occupant] = []
    rest = list(occupants)
    for o in ready:
        chosen.append(o)
        rest.remove(o)
        if not _over(capacity, _sum(rest), want):
            return Room(Verdict.EVICT, victims=tuple(c.name for c in chosen))
    blockers = [o for o in helpful if o not in ready]
    later = [o.evictable_at for o in blockers if o.movable]
    why = "; ".join(
        f"{o.name} is loading or stopping" if not o.movable
        else f"{o.name} stays loaded {o.evictable_at - now:.0f}s more (min_resident)"
        for o in sorted(blockers, key=lambda o: o.name))
    missing = ", ".join(f"{k} {v / MIB:,.0f} MiB" for k, v in sorted(short.items()))
    return Room(Verdict.WAIT, reason=f"waiting for room ({missing} short): {why or 'busy'}",
                retry_at=min(later) if later else None, short=short)
