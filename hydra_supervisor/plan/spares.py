"""Spare peers: a remote device of the node file may name alternates for its endpoint
(`far: {endpoint: A, spares: [B, C]}`). At `hydra up` (and every prepare: switch, reload) the
device's endpoint is the first of A, B, C, in that order, that answers HELLO, passes the build
identity check and whose reported free memory fits the plan; the plan is made on it (its `--rpc`
argv, its fit). The supervisor moves a lost peer onto a spare the same way (proc/starting.py).
`memory_mib` and `allow_build_mismatch` of the device apply to each of its endpoints.

This module is the choice, pure but for the `attempt` it is given (build and check a layout on a
node file whose devices point where the choice says): which endpoint each device uses, why its
primary is not used, and the node file as if each device's endpoint were the one chosen.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from hydra_supervisor.config.profile import Node
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.layout import PeerRefused
from hydra_supervisor.plan.placement import DoesNotFit

T = TypeVar("T")


@dataclass(frozen=True)
class PeerChoice:
    """Which of a remote device's endpoints its plan runs on."""

    device: str
    endpoints: tuple[str, ...]  # the node file's endpoint first, then its spares, in order
    using: str  # the one in force
    why: str = ""  # why the primary is not used (empty: it is)

    @property
    def on_spare(self) -> bool:
        return self.using != self.endpoints[0]

    def says(self) -> str:
        """The line log and status give: on which endpoint, and why not the primary."""
        if not self.on_spare:
            return f"{self.device}: serving on its endpoint {self.using}"
        return (f"{self.device}: serving on spare {self.using} (primary {self.endpoints[0]}: "
                f"{self.why})")

    def moved(self, endpoint: str, why: str) -> PeerChoice:
        """The same device, now on `endpoint` (`why`: what the one it leaves did)."""
        if endpoint == self.endpoints[0]:
            return replace(self, using=endpoint, why="")
        return replace(self, using=endpoint, why=why if self.using == self.endpoints[0]
                       else f"{self.why}; spare {self.using}: {why}")


def alternates(node: Node) -> dict[str, tuple[str, ...]]:
    """Every remote device with spares: its endpoints, the primary first."""
    return {name: (d.endpoint, *d.spares) for name, d in node.devices.items()
            if d.endpoint and d.spares}


def on_endpoint(node: Node, device: str, endpoint: str) -> Node:
    """The node file as if `device`'s endpoint were `endpoint` (one of its spares)."""
    decl = node.devices[device]
    return replace(node, devices={**node.devices, device: replace(decl, endpoint=endpoint)})


def first_line(exc: HydraError, device: str | None = None) -> str:
    """An error in one line: a fit's row for `device` (what it needs, what it has), else the
    message's first line."""
    lines = exc.message.splitlines() or [type(exc).__name__]
    if isinstance(exc, DoesNotFit) and device is not None:
        row = next((ln.strip() for ln in lines[1:] if ln.strip().startswith(f"{device}:")),
                   None)
        if row is not None:
            return f"does not fit: {row}"
    return lines[0]


def about(exc: HydraError) -> tuple[str, ...]:
    """The devices `exc` is about: a peer refused at its check (PeerRefused names it), or the
    devices short of memory in the fit; none for any other error."""
    if isinstance(exc, PeerRefused):
        return (exc.device,)
    if isinstance(exc, DoesNotFit):
        return exc.devices
    return ()


def choose(attempt: Callable[[Node], T], node: Node, used: Callable[[T], set[str]]
           ) -> tuple[T, tuple[PeerChoice, ...]]:
    """`attempt(node)` on the primaries; where it fails for a device with spares, again with
    that device on its next spare, until one passes or the device has none left (then the
    primary's error is raised, with what each spare said). `used(result)`: the devices the
    result runs on (a choice is returned only for those)."""
    endpoints = alternates(node)
    index = dict.fromkeys(endpoints, 0)
    said: dict[str, list[str]] = {d: [] for d in endpoints}
    first: dict[str, HydraError] = {}
    current = node
    while True:
        left = {d: index[d] + 1 < len(eps) for d, eps in endpoints.items()}
        try:
            result = attempt(current)
        except HydraError as exc:
            blamed = about(exc)
            # the first device it is about with a spare left to try: tried on that one
            device = next((d for d in blamed if left.get(d)), None)
            if device is None:
                # else, one already moved and out of spares: its primary's error, with what
                # each spare said; any other error is raised as it is
                dev = next((d for d in blamed if d in first), None)
                if dev is None:
                    raise
                said[dev].append(f"spare {endpoints[dev][index[dev]]}: {first_line(exc, dev)}")
                primary = first[dev]
                raise HydraError(f"{primary.message}\n  " + "\n  ".join(said[dev]),
                                 hint=primary.hint) from exc
            eps = endpoints[device]
            if index[device] == 0:
                first[device] = exc
            else:
                said[device].append(f"spare {eps[index[device]]}: {first_line(exc, device)}")
            index[device] += 1
            current = on_endpoint(current, device, eps[index[device]])
            continue
        in_use = used(result)
        choices = tuple(
            PeerChoice(d, eps, eps[index[d]], "; ".join(
                [first_line(first[d], d)] + said[d]) if index[d] else "")
            for d, eps in endpoints.items() if d in in_use)
        return result, choices
