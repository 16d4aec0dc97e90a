"""The resolver (pure): (profile, model info, devices, free ports) → Plan of stock command lines.

It implements the four-cell table of design.md with stock flags only:
  dense/solo     one llama-server pinned to its device
  dense/combine  ggml-rpc-server per peer device, then the head with --rpc and -ts / -ngl
  moe/solo       one llama-server, --n-cpu-moe when the profile asks
  moe/combine    one ggml-rpc-server, head with --rpc and -ot '<experts regex>=RPC0[host:port]'
plus transport `local` (one llama-server over all the profile's GPUs, no RPC).

Device order in llama-server: RPC devices first, in --rpc order, then local GPUs; so `-ts` lists
the peers first and the head last. With a CPU head the CPU is not an offload device: `-ngl N`
puts the *last* N blocks on the RPC devices and the rest stays on the head's CPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Protocol

from hydra_supervisor.argv import server_flags
from hydra_supervisor.config import Mode, Profile, Transport
from hydra_supervisor.devices import MIB, Device, Kind
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import EngineSpec, Placement, Plan, Role, RouterSpec

PEER_BIND = "127.0.0.1"
# Compute buffers and CUDA context are not in the GGUF; these estimates are deliberately high.
GPU_OVERHEAD = 768 * MIB
CPU_OVERHEAD = 256 * MIB
SAFETY = 0.05  # keep 5% of each device's free memory unplanned
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_([a-z_]+?)_exps\.weight$")


class Model(Protocol):
    """What the resolver needs from hydra_supervisor.modelinfo.ModelInfo."""

    @property
    def block_count(self) -> int: ...
    @property
    def context_length(self) -> int: ...
    @property
    def expert_count(self) -> int: ...
    @property
    def is_moe(self) -> bool: ...
    def layer_bytes(self) -> list[int]: ...
    def expert_bytes_per_layer(self) -> list[int]: ...
    def non_layer_bytes(self) -> int: ...
    def output_bytes(self) -> int: ...
    def tensor_names(self) -> list[str]: ...
    def kv_bytes_per_token(self, type_bytes: float = 2.0) -> int: ...


def _pin_env(dev: Device | Sequence[Device]) -> tuple[tuple[str, str], ...]:
    devs = [dev] if isinstance(dev, Device) else list(dev)
    cuda = [str(d.cuda_index) for d in devs if d.kind is Kind.CUDA]
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so a CPU engine of a CUDA build stays on CPU.
    return (("CUDA_VISIBLE_DEVICES", ",".join(cuda)),)


def _base_env(profile: Profile) -> tuple[tuple[str, str], ...]:
    # ggml runs gdb for a backtrace on abort when gdb exists; that delays a dead head's exit.
    env = {"GGML_NO_BACKTRACE": "1", **profile.env}
    return tuple(env.items())


def _ctx(profile: Profile, model: Model) -> int:
    for key in ("ctx-size", "c"):
        val = profile.server_args.get(key)
        if isinstance(val, int) and val > 0:
            return val
    return model.context_length or 4096


def _kv_type_bytes(profile: Profile) -> float:
    sizes = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.0625, "q4_0": 0.5625,
             "q4_1": 0.625, "q5_0": 0.6875, "q5_1": 0.75, "iq4_nl": 0.5625}
    types = [str(profile.server_args.get(k, "f16")) for k in ("cache-type-k", "cache-type-v")]
    return sum(sizes.get(t, 2.0) for t in types) / 2


def _device(devices: Mapping[str, Device], name: str, profile: Profile, key: str) -> Device:
    if name not in devices:
        raise HydraError(
            f"{profile.source}: {key}: unknown device '{name}'; known devices: "
            f"{', '.join(sorted(devices))}",
            hint="name devices in the node file (devices: {rtx: {cuda: 0}})")
    return devices[name]


def _available(dev: Device, cpu_sharers: int) -> int:
    if dev.free <= 0:
        return 0
    free = dev.free // cpu_sharers if dev.kind is Kind.CPU else dev.free
    return int(free * (1 - SAFETY))


# ---------------------------------------------------------------------------------------------
# Split planning


def _largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    s = sum(weights)
    raw = [w / s * total for w in weights]
    out = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - out[i], reverse=True)
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def plan_layer_split(profile: Profile, model: Model, order: Sequence[Device],
                     cpu_sharers: int) -> list[int]:
    """Layer counts per device in `order` (peers first, head last)."""
    n = model.block_count
    split = profile.split
    names = [d.name for d in order]
    if isinstance(split, Mapping):
        unknown = [k for k in split if k not in names]
        if unknown or len(split) != len(names):
            raise HydraError(
                f"{profile.source}: split: give one entry for each of {', '.join(names)}"
                f" (got {', '.join(split)})")
        split = tuple(split[name] for name in names)
    if split is not None:
        if len(split) != len(order):
            raise HydraError(
                f"{profile.source}: split has {len(split)} entries but this layout has "
                f"{len(order)} devices ({', '.join(names)}, in llama.cpp order: peers first, "
                "head last)")
        if all(isinstance(x, int) for x in split):
            total = int(sum(split))
            if total not in (n, n + 1):
                raise HydraError(
                    f"{profile.source}: split {'/'.join(str(x) for x in split)} adds up to "
                    f"{total} layers, but the model has {n} (give layer counts that add up to "
                    f"{n}, or proportions such as [0.4, 0.6])")
            counts = [int(x) for x in split]
            if total == n + 1:  # the operator counted the output layer on the last device
                counts[-1] -= 1
            return counts
        return _largest_remainder([float(x) for x in split], n)
    avail = [_available(d, cpu_sharers) for d in order]
    if not all(avail):
        return _largest_remainder([1.0] * len(order), n)
    return _largest_remainder([float(a) for a in avail], n)


def _user_ngl(profile: Profile) -> int | None:
    for key in ("n-gpu-layers", "ngl", "gpu-layers"):
        val = profile.server_args.get(key)
        if isinstance(val, int):
            return val
        if isinstance(val, str) and val.isdigit():
            return int(val)
    return None


def _solo_placements(profile: Profile, model: Model, head: Device, host: Device | None,
                     ctx: int, kv_type: float) -> list[Placement]:
    """SOLO: all on the head's device, minus what n-gpu-layers / n_cpu_moe leave on the CPU."""
    n = model.block_count
    if head.kind is Kind.CPU:
        return _layer_placements(model, [head], [n], ctx, kv_type, 1)
    ngl = _user_ngl(profile)
    gpu_layers = n + 1 if ngl is None else max(0, min(ngl, n + 1))
    gpu_blocks = max(gpu_layers - 1, 0)  # the output layer is offloaded first
    first_gpu = n - gpu_blocks
    layer_bytes = model.layer_bytes()
    expert = model.expert_bytes_per_layer()
    cpu_moe = set(range(min(profile.n_cpu_moe or 0, n)))
    on_gpu = [b - (expert[i] if i in cpu_moe else 0) for i, b in enumerate(layer_bytes)]
    gpu_w = sum(on_gpu[first_gpu:]) + (model.output_bytes() if gpu_layers else 0)
    kv_layer = model.kv_bytes_per_token(kv_type) * ctx // max(n, 1)
    what = f"layers {first_gpu}-{n - 1} + output" if gpu_blocks else "output only"
    out = [Placement(head.name, gpu_blocks, gpu_w, kv_layer * gpu_blocks, GPU_OVERHEAD,
                     _available(head, 1), what=what if gpu_layers else "nothing")]
    cpu_w = model.non_layer_bytes() + sum(layer_bytes) - gpu_w
    if first_gpu or cpu_moe:  # (the input embedding alone on the CPU is not worth a row)
        out.append(Placement(
            "cpu (host RAM)", first_gpu, cpu_w, kv_layer * first_gpu, CPU_OVERHEAD,
            _available(host, 1) if host else 0,
            what=(f"layers 0-{first_gpu - 1}" if first_gpu else "input embedding")
            + (f", experts of layers 0-{len(cpu_moe) - 1}" if cpu_moe else "")))
    return out


def _check_fit(placements: Sequence[Placement], profile: Profile) -> None:
    short = [p for p in placements if p.free_bytes and p.need_bytes > p.free_bytes]
    if not short:
        return
    rows = "\n".join(
        f"  {p.device}: needs {p.need_bytes / MIB:,.0f} MiB ({p.what}: weights "
        f"{p.weight_bytes / MIB:,.0f} + KV {p.kv_bytes / MIB:,.0f} + buffers "
        f"{p.overhead_bytes / MIB:,.0f}), has {p.free_bytes / MIB:,.0f} MiB usable"
        for p in placements)
    raise HydraError(
        f"{profile.source}: model does not fit the devices of profile '{profile.name}':\n{rows}",
        hint="add a peer, lower ctx-size / use a quantized KV cache (cache-type-k/v: q8_0), "
             "or pick a smaller quant")


def _layer_placements(model: Model, order: Sequence[Device], counts: Sequence[int],
                      ctx: int, kv_type: float, cpu_sharers: int) -> list[Placement]:
    """Placements in layer order (`order` lists devices by the blocks they hold, first first).

    The output layer (and with it the non-block tensors, for the estimate) goes with the last
    device in layer order, as llama.cpp places it.
    """
    layer_bytes = model.layer_bytes()
    kv_per_layer = model.kv_bytes_per_token(kv_type) * ctx // max(model.block_count, 1)
    out = []
    start = 0
    for i, (dev, count) in enumerate(zip(order, counts, strict=True)):
        weights = sum(layer_bytes[start:start + count])
        last = i == len(order) - 1
        if last:
            weights += model.output_bytes()
        out.append(Placement(
            device=dev.name, layers=count, weight_bytes=weights, kv_bytes=kv_per_layer * count,
            overhead_bytes=CPU_OVERHEAD if dev.kind is Kind.CPU else GPU_OVERHEAD,
            free_bytes=_available(dev, cpu_sharers),
            what=f"layers {start}-{start + count - 1}" + (" + output" if last else "")
            if count else ("output" if last else "layers")))
        start += count
    return out


def _ranges(nums: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    for n in sorted(nums):
        if out and int(out[-1].split("-")[-1]) == n - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def _ts(counts: Sequence[int]) -> str:
    """-ts for llama.cpp, which spreads it over the offloaded blocks *and* the output layer:
    the last device (which gets the output layer) counts one more."""
    return ",".join(str(c + (1 if i == len(counts) - 1 else 0)) for i, c in enumerate(counts))


# ---------------------------------------------------------------------------------------------
# Expert override patterns


def expert_pattern(tensor_names: Sequence[str], layers: Sequence[int] | None = None) -> str:
    """A regex (as llama.cpp's -ot searches it) matching exactly the expert tensors of `layers`.

    Built from the GGUF's real names and checked against all of them, so a pattern that matches
    nothing, or matches a non-expert tensor, cannot come out of here.
    """
    experts = [(int(m.group(1)), m.group(2), name) for name in tensor_names
               if (m := EXPERT_RE.match(name))]
    if not experts:
        raise HydraError("model has no expert tensors (blk.N.ffn_*_exps.weight); "
                         "use mode: combine on a dense model for a layer split")
    all_layers = sorted({layer for layer, _, _ in experts})
    chosen = sorted(set(layers)) if layers is not None else all_layers
    kinds = sorted({kind for _, kind, _ in experts})
    layer_re = "[0-9]+" if chosen == all_layers else "(?:" + "|".join(map(str, chosen)) + ")"
    pattern = rf"blk\.{layer_re}\.ffn_(?:{'|'.join(kinds)})_exps\.weight"
    compiled = re.compile(pattern)
    want = {name for layer, _, name in experts if layer in set(chosen)}
    got = {name for name in tensor_names if compiled.search(name)}
    if not want or got != want:
        raise AssertionError(f"generated -ot pattern {pattern!r} matches {len(got)} tensors, "
                             f"expected exactly the {len(want)} expert tensors")
    return pattern


# ---------------------------------------------------------------------------------------------
# The four cells


def _peer_spec(name: str, dev: Device, port: int | None, order: int, profile: Profile
               ) -> EngineSpec:
    if dev.kind is Kind.REMOTE:
        assert dev.endpoint
        host, _, p = dev.endpoint.rpartition(":")
        return EngineSpec(name=name, role=Role.PEER, program="ggml-rpc-server", args=(),
                          env=(), host=host, port=int(p), device=dev.name, start_order=order,
                          managed=False)
    assert port is not None
    # -c: keep ggml-rpc-server's tensor cache so a restarted head does not resend weights.
    args: tuple[str, ...] = ("-H", PEER_BIND, "-p", str(port), "-c")
    if dev.kind is Kind.CPU:
        threads = profile.server_args.get("threads", profile.server_args.get("t"))
        threads = threads if isinstance(threads, int) and threads > 0 else dev.threads
        if threads:
            args += ("-t", str(threads))
    return EngineSpec(name=name, role=Role.PEER, program="ggml-rpc-server", args=args,
                      env=_base_env(profile) + _pin_env(dev), host=PEER_BIND, port=port,
                      device=dev.name, start_order=order)


def resolve_peer_engine(profile: Profile, devices: Mapping[str, Device],
                        rpc_ports: Sequence[int]) -> Plan:
    """mode: peer -- one ggml-rpc-server on the profile's device, reachable from other hosts
    only through the router (ggml-RPC has no authentication: the allow list guards it)."""
    dev = _device(devices, profile.head, profile, "head")
    if dev.kind is Kind.REMOTE:
        raise HydraError(f"{profile.source}: head: mode: peer serves a device of this host; "
                         f"'{dev.name}' is a remote peer")
    if not profile.router:
        raise HydraError(f"{profile.source}: mode: peer needs router: true (the ggml-rpc-server "
                         "binds 127.0.0.1; the router's allow list is its only way in)")
    if not rpc_ports:
        raise HydraError("no free ggml-rpc-server port left in the node's rpc_ports range")
    peer = _peer_spec(f"peer-{dev.name}", dev, rpc_ports[0], 0, profile)
    router = RouterSpec(host=profile.host, port=profile.port, http=None,
                        rpc=(peer.host, peer.port), allow=tuple(profile.rpc_allow))
    return Plan(profile=profile.name, source=profile.source, model_path="", model_kind="-",
                mode=profile.mode.value, transport="rpc", host=profile.host, port=profile.port,
                engines=(peer,), router=router)


def resolve(profile: Profile, model: Model, model_path: str, devices: Mapping[str, Device],
            rpc_ports: Sequence[int], internal_port: int | None = None) -> Plan:
    """With `internal_port`, the head binds 127.0.0.1:internal_port and the Plan carries a
    RouterSpec for the external host:port; without it, the head binds the external port."""
    head_dev = _device(devices, profile.head, profile, "head")
    if head_dev.kind is Kind.REMOTE:
        raise HydraError(f"{profile.source}: head: '{head_dev.name}' is a remote peer; the head "
                         "runs on this host (a CPU or a local GPU)")
    peer_devs = [_device(devices, p, profile, f"peers[{i}]") for i, p in enumerate(profile.peers)]
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
    kind = "moe" if model.is_moe else "dense"
    ctx = _ctx(profile, model)
    kv_type = _kv_type_bytes(profile)
    combine = profile.mode is Mode.COMBINE
    extra = server_flags(profile.server_args, combine=combine, source=profile.source)
    if profile.n_cpu_moe is not None and not model.is_moe:
        raise HydraError(f"{profile.source}: n_cpu_moe is for MoE models; {model_path} is dense")
    cpu_sharers = sum(1 for d in [head_dev, *peer_devs] if d.kind is Kind.CPU)
    head_host, head_port = ((PEER_BIND, internal_port) if internal_port
                            else (profile.host, profile.port))
    base = ["-m", model_path, "--host", head_host, "--port", str(head_port)]
    notes: list[str] = []
    engines: list[EngineSpec] = []
    placements: list[Placement] = []
    transport = profile.transport if combine else Transport.RPC

    if not combine:
        dev_flags = (["-ngl", "99", "-sm", "none"] if head_dev.kind is Kind.CUDA else ["-ngl", "0"])
        if any(f in ("-ngl", "--n-gpu-layers", "--gpu-layers") for f in extra):
            dev_flags = dev_flags[2:]
        if profile.n_cpu_moe is not None:
            dev_flags += ["--n-cpu-moe", str(profile.n_cpu_moe)]
        placements = _solo_placements(profile, model, head_dev, devices.get("cpu"), ctx,
                                      kv_type)
        _check_fit(placements, profile)
        engines.append(EngineSpec(
            name="head", role=Role.HEAD, program="llama-server",
            args=tuple(base + dev_flags + extra), env=_base_env(profile) + _pin_env(head_dev),
            host=head_host, port=head_port, device=head_dev.name, start_order=0))
    elif transport is Transport.LOCAL:
        gpus = [head_dev, *peer_devs]
        if any(d.kind is not Kind.CUDA for d in gpus):
            raise HydraError(f"{profile.source}: transport: local runs one llama-server over "
                             "local GPUs only; CPU and remote peers need transport: rpc")
        if model.is_moe:
            raise HydraError(f"{profile.source}: transport: local is a layer split; for MoE "
                             "experts on a peer use transport: rpc")
        counts = plan_layer_split(profile, model, [*peer_devs, head_dev], 1)
        # profile split is in llama.cpp RPC order (peers first); locally the head is CUDA0.
        local_counts = [counts[-1], *counts[:-1]]
        placements = _layer_placements(model, gpus, local_counts, ctx, kv_type, 1)
        _check_fit(placements, profile)
        args = base + ["-ngl", "99", "-sm", "layer", "-ts", _ts(local_counts)] + extra
        engines.append(EngineSpec(
            name="head", role=Role.HEAD, program="llama-server", args=tuple(args),
            env=_base_env(profile) + _pin_env(gpus), host=head_host, port=head_port,
            device="+".join(d.name for d in gpus), start_order=0))
    else:
        managed = [d for d in peer_devs if d.kind is not Kind.REMOTE]
        if len(rpc_ports) < len(managed):
            raise HydraError(f"no free ggml-rpc-server port left for {len(managed)} peer(s) "
                             "in the node's rpc_ports range")
        ports = iter(rpc_ports)
        peers = [_peer_spec(f"peer-{d.name}", d, None if d.kind is Kind.REMOTE else next(ports),
                            i, profile) for i, d in enumerate(peer_devs)]
        engines += peers
        rpc = ",".join(p.endpoint for p in peers)
        if model.is_moe:
            if len(peers) != 1:
                raise HydraError(f"{profile.source}: MoE combine puts the experts on one peer; "
                                 f"got {len(peers)} peers")
            args, placements = _moe_combine(profile, model, head_dev, peer_devs[0], peers[0],
                                            ctx, kv_type, cpu_sharers)
        else:
            args, placements = _dense_combine(profile, model, head_dev, peer_devs, ctx, kv_type,
                                              cpu_sharers)
            if all(d.kind is Kind.CUDA for d in [head_dev, *peer_devs]):
                notes.append(
                    "all devices are local GPUs: transport: local (one llama-server over "
                    "them, -sm layer, no RPC) decoded at 0.99-1.00 of one GPU vs 0.78-0.86 for "
                    "this RPC split on two H200s; keep rpc only if the peer GPU must stay an "
                    "independent engine")
        engines.append(EngineSpec(
            name="head", role=Role.HEAD, program="llama-server",
            args=tuple(base + ["--rpc", rpc] + args + extra),
            env=_base_env(profile) + _pin_env(head_dev), host=head_host,
            port=head_port, device=head_dev.name, start_order=len(peers)))
    router = None
    if internal_port:
        # ggml-RPC through the external port would reach a local peer, but every local peer
        # here already serves this profile's head, and a ggml-rpc-server serves one client at
        # a time: an outside client would hang in its backlog. So RPC is closed at once.
        router = RouterSpec(host=profile.host, port=profile.port, http=(head_host, head_port),
                            rpc=None, allow=tuple(profile.rpc_allow))
    return Plan(
        profile=profile.name, source=profile.source, model_path=model_path, model_kind=kind,
        mode=profile.mode.value, transport=transport.value, host=profile.host, port=profile.port,
        engines=tuple(engines), placements=tuple(placements), notes=tuple(notes),
        meta={"ctx": ctx, "block_count": model.block_count}, router=router)


def _dense_combine(profile: Profile, model: Model, head: Device, peers: Sequence[Device],
                   ctx: int, kv_type: float, cpu_sharers: int
                   ) -> tuple[list[str], list[Placement]]:
    order = [*peers, head]
    counts = plan_layer_split(profile, model, order, cpu_sharers)
    if head.kind is Kind.CPU:
        # The CPU is not an offload device: -ngl N offloads the last N blocks to the RPC
        # devices (split among them by -ts); the first blocks stay on the head.
        placements = _layer_placements(model, [head, *peers], [counts[-1], *counts[:-1]], ctx,
                                       kv_type, cpu_sharers)
        _check_fit(placements, profile)
        # -ngl counts the output layer too (offloaded first, to the last RPC device).
        args = ["-ngl", str(sum(counts[:-1]) + 1), "-sm", "layer"]
        if len(peers) > 1:
            args += ["-ts", _ts(counts[:-1])]
        return args, placements
    placements = _layer_placements(model, order, counts, ctx, kv_type, cpu_sharers)
    _check_fit(placements, profile)
    return ["-ngl", "99", "-sm", "layer", "-ts", _ts(counts)], placements


def _moe_combine(profile: Profile, model: Model, head: Device, peer: Device,
                 peer_spec: EngineSpec, ctx: int, kv_type: float, cpu_sharers: int
                 ) -> tuple[list[str], list[Placement]]:
    expert_bytes = model.expert_bytes_per_layer()
    layers = [i for i, b in enumerate(expert_bytes) if b > 0]
    peer_avail = _available(peer, cpu_sharers)
    overhead = CPU_OVERHEAD if peer.kind is Kind.CPU else GPU_OVERHEAD
    chosen = list(layers)
    if peer_avail:
        # Experts of the last layers first, so whole trailing layers' experts sit on the peer.
        while chosen and sum(expert_bytes[i] for i in chosen) + overhead > peer_avail:
            chosen.pop(0)
        if not chosen:
            raise HydraError(
                f"{profile.source}: not even one layer's experts "
                f"({max(expert_bytes) / MIB:,.0f} MiB) fit on peer '{peer.name}' "
                f"({peer_avail / MIB:,.0f} MiB usable)")
    pattern = expert_pattern(model.tensor_names(), chosen)
    peer_bytes = sum(expert_bytes[i] for i in chosen)
    total = sum(model.layer_bytes()) + model.non_layer_bytes()
    head_bytes = total - peer_bytes
    kv = model.kv_bytes_per_token(kv_type) * ctx
    placements = [
        Placement(peer.name, len(chosen), peer_bytes, 0, overhead, peer_avail,
                  what=f"experts of {len(chosen)} layers ({_ranges(chosen)})"),
        Placement(head.name, model.block_count, head_bytes, kv,
                  CPU_OVERHEAD if head.kind is Kind.CPU else GPU_OVERHEAD,
                  _available(head, cpu_sharers),
                  what=f"all {model.block_count} layers but those experts"),
    ]
    _check_fit(placements, profile)
    # The buffer type name is RPC0[host:port]; bare RPC0 is "unknown buffer type".
    if head.kind is Kind.CUDA:
        # -ts 0,1: every layer on the head's GPU; without it llama.cpp also spreads whole
        # layers over the RPC device by free memory, not just the overridden experts.
        args = ["-ngl", "99", "-ts", "0,1"]
    else:
        args = ["-ngl", "0"]  # the CPU is no offload device: only the -ot tensors move
    args += ["-ot", f"{pattern}=RPC0[{peer_spec.endpoint}]"]
    return args, placements
