"""What to run for one layout: the Deployment, built and checked before anything starts.

A Deployment bundles everything a Supervisor needs to run one profile's layout (the Plan, the
binaries' paths, the restart / health / peer-loss policies, the timeouts, the SOLO fallback for
on_peer_loss: degrade, and how to move a peer whose port was taken). It is plain frozen data:
`hydra up`, `hydra switch` and `hydra reload` all build one with `prepare()` (which has no side
effects beyond reading files and probing ports) and hand it to a Lane, which runs it under a
Supervisor.

It describes the processes and their internal ports, never the external address: that is the
Port's (serve/port.py), given to `prepare` as a value (`external`) it hands to no process (a
`router: false` head binds it itself). A Port bound to port 0 keeps what the kernel gave it;
nothing is written back into a plan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from hydra_supervisor.config.config import find_node_file, load_node
from hydra_supervisor.config.profile import HealthPolicy, Node, PeerLoss, Profile, RestartPolicy
from hydra_supervisor.plan import layout, spares
from hydra_supervisor.plan.plan import Address, EngineSpec, Plan, Role
from hydra_supervisor.plan.spares import PeerChoice

log = logging.getLogger("hydra")

PortPicker = Callable[[set[int]], int | None]


@dataclass(frozen=True)
class Timeouts:
    load: float  # head: spawn to /health 200
    peer: float = 30.0  # peer: spawn to HELLO
    stop_grace: float = 10.0
    health: HealthPolicy = field(default_factory=HealthPolicy)


def load_timeout_for(model_bytes: int, configured: float | None) -> float:
    """Loads scale with size: 60 s plus 15 s per GiB (a 20 GB model on a slow disk: ~6 min)."""
    if configured:
        return configured
    return 60.0 + 15.0 * model_bytes / (1 << 30)


@dataclass(frozen=True)
class Deployment:
    plan: Plan
    binaries: dict[str, str]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    on_peer_loss: PeerLoss = PeerLoss.RESTART
    timeouts: Timeouts = field(default_factory=lambda: Timeouts(load=60.0))
    model_label: str = "-"
    solo_head: EngineSpec | None = None  # the head as SOLO, for on_peer_loss: degrade
    pick_port: PortPicker | None = None  # a free rpc_ports port, for a peer whose port was taken
    pick_internal_port: PortPicker | None = None  # a free internal_ports port, for the head
    layout: layout.Layout | None = None  # what it was built from (None in policy tests)
    keep_slots: bool = False  # save the head's KV slots before it stops, restore after
    # Each remote device with spares: which of its endpoints the plan runs on, and why not its
    # primary (plan/spares.py); the supervisor moves a lost peer onto a spare (on_spare).
    peer_choices: tuple[PeerChoice, ...] = ()
    slot_dir: Path | None = None  # as given to prepare (a re-plan onto a spare keeps it)

    @property
    def profile(self) -> str:
        return self.plan.profile


def prepare(profile_ref: str, *, node_file: str | None = None,
            profiles_dir: str | None = None, overrides: Mapping[str, object] | None = None,
            keep: Plan | None = None, external: Address | None = None,
            profile: Profile | None = None, slot_dir: Path | None = None,
            reserved: frozenset[int] = frozenset()) -> Deployment:
    """Read, resolve and check a profile into a Deployment; raises HydraError on bad input.

    `external`: the address of the Port it is for, bound already (a switch, a reload,
    CONFIGURE, the standby): its port is given to no process and not checked (its router, or
    the running `router: false` head, holds it). None: the profile's own address (`hydra up`,
    before anything is bound), checked free. For a running engine, `keep` is its current plan
    (whose ports are reused)."""
    def attempt(node: Node) -> layout.Layout:
        lay = layout.build(profile_ref, node_file=node_file, profiles_dir=profiles_dir,
                           overrides=overrides, keep=keep, profile=profile, reserved=reserved,
                           need_binaries=True, external=external, read_node=node)
        layout.check_remote_peers(lay.plan, node=lay.node)
        return lay

    # each remote device on its endpoint, or on the first of its spares that serves (spares.py)
    lay, choices = spares.choose(attempt, load_node(find_node_file(node_file)), remote_devices)
    for c in choices:
        if c.on_spare:
            log.warning("%s", c.says())
    bins = layout.find_binaries(lay)
    ours: set[int] = {external.port} if external is not None else set()
    if keep is not None:
        ours |= {e.port for e in keep.engines if e.managed}
    layout.check_ports(lay.plan, lay.external, ours)
    return _deployment(lay, bins, slot_dir, choices)


def remote_devices(lay: layout.Layout) -> set[str]:
    return {e.device for e in lay.plan.peers if not e.managed}


def on_spare(dep: Deployment, device: str, endpoint: str, why: str) -> Deployment:
    """`dep` re-planned with `device`'s peer at `endpoint` (one of its spares, or its primary
    again): the fit made against what that host reports free, the head's `--rpc`/`-ot` on it,
    the ports kept. `why`: what the endpoint it leaves did (said in status). Reads the model's
    header and asks the spare's router INFO: the supervisor runs it off its loop (seams.py).
    Raises HydraError (DoesNotFit: the spare is short of memory)."""
    lay = dep.layout
    if lay is None:
        raise ValueError("on_spare needs a deployment prepared from a layout")
    # its ports kept; nothing of it is held on the spare (the running head's share of the
    # primary is not counted free there: layout.held_back)
    keep = replace(dep.plan, placements=tuple(p for p in dep.plan.placements
                                              if p.device != device))
    new = layout.build(lay.profile.source, profile=lay.profile, keep=keep,
                       external=lay.external, inventory=lay.inventory,
                       read_node=spares.on_endpoint(lay.node, device, endpoint))
    choices = tuple(c.moved(endpoint, why) if c.device == device else c
                    for c in dep.peer_choices)
    return _deployment(new, dep.binaries, dep.slot_dir, choices)


def _deployment(lay: layout.Layout, bins: dict[str, str], slot_dir: Path | None,
                choices: tuple[PeerChoice, ...]) -> Deployment:
    prof = lay.profile
    plan = final_plan(lay, slot_dir)
    # mode: peer has no model; its `prefill:` GGUFs are hashed and copied before its
    # rpc-server starts (rpccache.py), within the same budget (60 s + 15 s per GiB).
    model_bytes = lay.model.file_size if lay.model else sum(
        Path(p).stat().st_size for p in plan.meta.get("prefill", ()))
    avoid = frozenset({lay.external.port} - {0})  # a moved process never takes it
    timeouts = Timeouts(load=load_timeout_for(model_bytes, prof.load_timeout),
                        stop_grace=prof.stop_grace, health=prof.health)
    return Deployment(plan=plan, binaries=bins, policy=prof.restart,
                      on_peer_loss=prof.on_peer_loss, timeouts=timeouts,
                      model_label=prof.model or "-", solo_head=layout.solo_fallback(lay),
                      pick_port=layout.port_picker(lay.node, avoid=avoid),
                      pick_internal_port=layout.port_picker(lay.node, lay.node.internal_ports,
                                                            avoid=avoid),
                      layout=lay, keep_slots=prof.keep_slots, peer_choices=choices,
                      slot_dir=slot_dir)


def final_plan(lay: layout.Layout, slot_dir: Path | None) -> Plan:
    """The layout's plan exactly as its processes run: with what every started head gets
    from the state dir (`--slot-save-path`, and `--swa-full` with keep_slots). `prepare` runs
    this and `hydra plan` prints it (one function: the plan shown is what runs; a head's argv
    is `EngineSpec.argv`). `slot_dir` None: the layout's plan as resolved."""
    if slot_dir is None:
        return lay.plan
    return with_slot_dir(lay.plan, slot_dir, swa_full=lay.profile.keep_slots)


def with_slot_dir(plan: Plan, slot_dir: Path, swa_full: bool = False) -> Plan:
    """The head saves and restores KV slots under `slot_dir` (the wire protocol's STATE_* ops
    and keep_slots use llama-server's /slots save/restore, which needs --slot-save-path).
    `swa_full`: a sliding-window model (Gemma 3) serves a restored slot from cache only with a
    full-size SWA cache; llama.cpp ignores the flag for other models."""
    engines = []
    for e in plan.engines:
        if e.role is Role.HEAD and e.managed:
            if "--slot-save-path" not in e.args:
                e = replace(e, args=(*e.args, "--slot-save-path", str(slot_dir)))
            if swa_full and "--swa-full" not in e.args:
                e = replace(e, args=(*e.args, "--swa-full"))
        engines.append(e)
    return replace(plan, engines=tuple(engines))
