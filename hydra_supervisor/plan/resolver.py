"""The resolver (pure): (profile, model info, devices, free ports) → Plan of stock command lines.

It implements the resolver's table (docs/profiles.md, docs/architecture.md) with stock flags
only:
  dense/solo     one llama-server pinned to its device
  dense/combine  ggml-rpc-server per peer device, then the head with --rpc and -ts / -ngl
  moe/solo       one llama-server, --n-cpu-moe when the profile asks
  moe/combine    one ggml-rpc-server, head with --rpc and -ot '<experts regex>=RPC0[host:port]'
plus transport `local`: one llama-server over all the profile's GPUs, no RPC -- a layer split
(`CUDA_VISIBLE_DEVICES=<peers>,<head> -sm layer -ts`) or, for MoE, the experts on the second GPU
(`CUDA_VISIBLE_DEVICES=<head>,<peer> -ts 1,0 -ot '<experts regex>=CUDA1'`). `transport: auto`
(the default) is `local` when every device is a GPU of this host, else `rpc`.

Device order in llama-server: RPC devices first, in --rpc order, then local GPUs; so `-ts` lists
the peers first and the head last. A local layer split keeps that order (peers' GPUs first in
CUDA_VISIBLE_DEVICES), so a profile's `split` puts the same layers on the same cards under either
transport. With a CPU head the CPU is not an offload device: `-ngl N` puts the *last* N blocks on
the RPC devices and the rest stays on the head's CPU.

This module is the table: resolve() checks a profile's devices and builds the head of each cell
(and resolve_peer_engine() a mode: peer host's one ggml-rpc-server). Its parts: placement.py (the
memory arithmetic and the layer split), peers.py (devices, peer engines, the choice of transport
and moe_split), combine.py (the COMBINE layouts' flags and placements, the expert pattern).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hydra_supervisor.config.profile import Mode, MoeSplit, Profile, Transport
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.argv import server_flags
from hydra_supervisor.plan.combine import (
    dense_combine,
    local_head,
    moe_combine,
)
from hydra_supervisor.plan.combine import (
    expert_pattern as expert_pattern,  # re-exported: tests/test_resolver_golden.py uses it here
)
from hydra_supervisor.plan.devices import Device, Kind
from hydra_supervisor.plan.peers import (
    PEER_BIND,
    base_env,
    choose_moe_split,
    choose_transport,
    device_named,
    peer_spec,
    pin_env,
)
from hydra_supervisor.plan.placement import (
    Model,
    check_fit,
    context_size,
    kv_type_bytes,
    solo_placements,
)
from hydra_supervisor.plan.plan import (
    Address,
    EngineSpec,
    ModelKind,
    Placement,
    Plan,
    PlanMeta,
    PlanMode,
    PlanTransport,
    Role,
    RouterSpec,
)

# ---------------------------------------------------------------------------------------------
# The four cells


def resolve_peer_engine(profile: Profile, devices: Mapping[str, Device],
                        rpc_ports: Sequence[int]) -> Plan:
    """mode: peer -- one ggml-rpc-server on the profile's device, reachable from other hosts
    only through the router (ggml-RPC has no authentication: the allow list guards it)."""
    dev = device_named(devices, profile.head, profile, "head")
    if dev.kind is Kind.REMOTE:
        raise HydraError(f"{profile.source}: head: mode: peer serves a device of this host; "
                         f"'{dev.name}' is a remote peer")
    if not profile.router:
        raise HydraError(f"{profile.source}: mode: peer needs router: true (the ggml-rpc-server "
                         "binds 127.0.0.1; the router's allow list is its only way in)")
    if not rpc_ports:
        raise HydraError("no free ggml-rpc-server port left in the node's rpc_ports range")
    peer = peer_spec(f"peer-{dev.name}", dev, rpc_ports[0], 0, profile)
    router = RouterSpec(http=None, rpc=(peer.host, peer.port), allow=tuple(profile.rpc_allow),
                        tls=profile.tls)
    return Plan(profile=profile.name, source=profile.source, model_path="",
                model_kind=ModelKind.NONE, mode=PlanMode(profile.mode.value),
                transport=PlanTransport.RPC, engines=(peer,), router=router)


def resolve(profile: Profile, model: Model, model_path: str, devices: Mapping[str, Device],
            rpc_ports: Sequence[int], internal_port: int | None = None,
            external: Address | None = None) -> Plan:
    """With `internal_port`, the head binds 127.0.0.1:internal_port and the Plan carries a
    RouterSpec (what the router on the external address relays to); without it (`router:
    false`), the head binds the external address itself: `external` (the Port's; default the
    profile's own host and port)."""
    head_dev = device_named(devices, profile.head, profile, "head")
    if head_dev.kind is Kind.REMOTE:
        raise HydraError(f"{profile.source}: head: '{head_dev.name}' is a remote peer; the head "
                         "runs on this host (a CPU or a local GPU)")
    peer_devs = [device_named(devices, p, profile, f"peers[{i}]")
                 for i, p in enumerate(profile.peers)]
    for p in peer_devs:
        if p.name == head_dev.name or (
                p.kind is Kind.CUDA and p.cuda_index == head_dev.cuda_index
                and head_dev.kind is Kind.CUDA):
            raise HydraError(f"{profile.source}: peers: '{p.name}' is the head's own device; "
                             "a peer must be another GPU (or the CPU, or a remote host)")
    if len({p.name for p in peer_devs}) != len(peer_devs):
        raise HydraError(f"{profile.source}: peers: a device is listed twice")
    if profile.mode is Mode.SOLO and peer_devs:
        raise HydraError(f"{profile.source}: peers are only used with mode: combine "
                         f"(this profile is mode: solo)")
    if profile.mode is Mode.COMBINE and not peer_devs:
        raise HydraError(f"{profile.source}: mode: combine needs at least one entry in peers")
    kind = ModelKind.MOE if model.is_moe else ModelKind.DENSE
    ctx = context_size(profile, model)
    kv_type = kv_type_bytes(profile)
    combine = profile.mode is Mode.COMBINE
    extra = server_flags(profile.server_args, combine=combine, source=profile.source)
    if profile.n_cpu_moe is not None and not model.is_moe:
        raise HydraError(f"{profile.source}: n_cpu_moe is for MoE models; {model_path} is dense")
    if profile.moe_split is not MoeSplit.AUTO and combine and not model.is_moe:
        # (SOLO ignores it: on_peer_loss: degrade re-plans a COMBINE profile as SOLO)
        raise HydraError(f"{profile.source}: moe_split is for mode: combine of an MoE model; "
                         f"{model_path} is dense")
    cpu_sharers = sum(1 for d in [head_dev, *peer_devs] if d.kind is Kind.CPU)
    ext = external or Address(profile.host, profile.port)
    head_host, head_port = (PEER_BIND, internal_port) if internal_port else (ext.host, ext.port)
    # --alias: the model name llama-server reports (/v1/models, every reply's `model`) is the
    # profile's name, the name clients ask for, not the GGUF's file name.
    base = ["-m", model_path, "--alias", profile.name, "--host", head_host, "--port",
            str(head_port)]
    if head_dev.kind is Kind.CUDA and not any(k.lstrip("-") in ("fit", "fitt", "fit-target")
                                              for k in profile.server_args):
        # hydra places the layers itself; llama.cpp's own fitting would only dry-run a load.
        extra = ["--fit", "off", *extra]
    notes: list[str] = []
    engines: list[EngineSpec] = []
    placements: list[Placement] = []
    transport = Transport.RPC
    meta: PlanMeta = {"ctx": ctx, "block_count": model.block_count}

    if not combine:
        dev_flags = (["-ngl", "99", "-sm", "none"] if head_dev.kind is Kind.CUDA else ["-ngl", "0"])
        if any(f in ("-ngl", "--n-gpu-layers", "--gpu-layers") for f in extra):
            dev_flags = dev_flags[2:]
        if profile.n_cpu_moe is not None:
            dev_flags += ["--n-cpu-moe", str(profile.n_cpu_moe)]
        placements = solo_placements(profile, model, head_dev, devices.get("cpu"), ctx,
                                      kv_type)
        check_fit(placements, profile)
        engines.append(EngineSpec(
            name="head", role=Role.HEAD, program="llama-server",
            args=tuple(base + dev_flags + extra), env=base_env(profile) + pin_env(head_dev),
            host=head_host, port=head_port, device=head_dev.name, start_order=0))
    else:
        transport, why = choose_transport(profile, head_dev, peer_devs)
        notes.append(why)
        meta["transport_requested"] = profile.transport.value
        split = choose_moe_split(profile, transport) if model.is_moe else None
        if split is not None:
            meta["moe_split"] = split.value
        if transport is Transport.LOCAL:
            engines.append(local_head(profile, model, head_dev, peer_devs, split, base, extra,
                                       ctx, kv_type, devices.get("cpu"), placements, notes,
                                       head_host, head_port))
        else:
            if profile.n_cpu_moe is not None:
                raise HydraError(f"{profile.source}: n_cpu_moe over transport rpc is not "
                                 "planned; use transport: local (same host) or mode: solo")
            managed = [d for d in peer_devs if d.kind is not Kind.REMOTE]
            if len(rpc_ports) < len(managed):
                raise HydraError(f"no free ggml-rpc-server port left for {len(managed)} "
                                 "peer(s) in the node's rpc_ports range")
            ports = iter(rpc_ports)
            peers = [peer_spec(f"peer-{d.name}", d,
                                None if d.kind is Kind.REMOTE else next(ports), i, profile)
                     for i, d in enumerate(peer_devs)]
            engines += peers
            rpc = ",".join(p.endpoint for p in peers)
            if split is MoeSplit.EXPERTS:
                if len(peers) != 1:
                    raise HydraError(f"{profile.source}: MoE combine puts the experts on one "
                                     f"peer; got {len(peers)} peers (or set moe_split: layers)")
                args, placements = moe_combine(profile, model, head_dev, peer_devs[0],
                                                f"RPC0[{peers[0].endpoint}]", ctx, kv_type,
                                                cpu_sharers)
            else:
                args, placements = dense_combine(profile, model, head_dev, peer_devs, ctx,
                                                  kv_type, cpu_sharers, notes)
            engines.append(EngineSpec(
                name="head", role=Role.HEAD, program="llama-server",
                args=tuple(base + ["--rpc", rpc] + args + extra),
                env=base_env(profile) + pin_env(head_dev), host=head_host,
                port=head_port, device=head_dev.name, start_order=len(peers)))
    router = None
    if internal_port:
        # ggml-RPC through the external port would reach a local peer, but every local peer
        # here already serves this profile's head, and a ggml-rpc-server serves one client at
        # a time: an outside client would hang in its backlog. So RPC is closed at once.
        router = RouterSpec(http=(head_host, head_port), rpc=None,
                            allow=tuple(profile.rpc_allow))
    return Plan(
        profile=profile.name, source=profile.source, model_path=model_path, model_kind=kind,
        mode=PlanMode(profile.mode.value),
        transport=PlanTransport(transport.value) if combine else PlanTransport.NONE,
        engines=tuple(engines), placements=tuple(placements), notes=tuple(notes),
        meta=meta, router=router)
