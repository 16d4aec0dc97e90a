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
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from hydra_supervisor.config.config import Mode, MoeSplit, Profile, Transport
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.argv import server_flags
from hydra_supervisor.plan.devices import MIB, Device, Kind
from hydra_supervisor.plan.plan import (
    EngineSpec,
    ModelKind,
    Placement,
    Plan,
    PlanMode,
    PlanTransport,
    Role,
    RouterSpec,
)

PEER_BIND = "127.0.0.1"
# What a GPU holds besides weights and KV (not in the GGUF): the process's CUDA context (CUDA
# runtime, cuBLAS, the kernels loaded) and llama.cpp's compute buffers, estimated in
# gpu_overhead(). Constants from NVML per-process memory on H200s (docs/measurements.md).
CUDA_CONTEXT = 704 * MIB  # seen: 592-699 MiB per process and GPU
GPU_OVERHEAD = 768 * MIB  # the estimate for a model whose shape is unknown (test stand-ins)
CPU_OVERHEAD = 256 * MIB
SAFETY = 0.05  # keep 5% of each device's free memory unplanned
DEFAULT_UBATCH = 512
EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_([a-z_]+?)_exps\.weight$")


class Model(Protocol):
    """What the resolver needs from hydra_supervisor.plan.modelinfo.ModelInfo."""

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


def _ubatch(profile: Profile) -> int:
    for key in ("ubatch-size", "ub"):
        val = profile.server_args.get(key)
        if isinstance(val, int) and val > 0:
            return val
    return DEFAULT_UBATCH


# llama.cpp's compute buffer per GPU, in units of one ubatch of activations (ubatch x 4 bytes x
# (n_embd + FFN width; x experts used for MoE)): the device with the output layer also holds the
# logits (ubatch x n_vocab f32); a non-output device of a multi-GPU layer split holds pipeline
# copies of its inputs (llama.cpp keeps 4); a device of expert tensors only, the expert
# activations. Where weights stay in host RAM, llama.cpp copies the one a large batch needs to
# the GPU: the largest block tensor more. Fitted to NVML on H200s (docs/measurements.md: measured
# 24-228 MiB of compute buffers, planned 0.4-7% above what the GPUs held).
COMPUTE_OUTPUT = 3
COMPUTE_SPLIT = 10
COMPUTE_EXPERTS = 4


def model_shape(model: Model) -> tuple[int, int, int, int]:
    """(n_embd, n_vocab, FFN activations per token, largest block tensor's bytes), read off the
    tensor shapes (ggml order); zeros for a stand-in without tensors (flat GPU_OVERHEAD)."""
    n_embd = int(getattr(model, "n_embd", 0) or 0)
    used = max(int(getattr(model, "expert_used_count", 0) or 0), 1)
    n_vocab = ffn = largest = 0
    for t in getattr(model, "tensors", ()):
        if t.layer is not None:
            largest = max(largest, t.n_bytes)
        if len(t.shape) < 2:
            continue
        if t.name in ("output.weight", "token_embd.weight"):
            n_vocab = max(n_vocab, t.shape[1])
        elif t.name.endswith((".ffn_up.weight", ".ffn_up_shexp.weight")):
            ffn = max(ffn, t.shape[1])
        elif t.name.endswith((".ffn_up_exps.weight", ".ffn_gate_up_exps.weight")):
            ffn = max(ffn, t.shape[1] * used)
    return n_embd, n_vocab, ffn, largest


def gpu_overhead(model: Model, profile: Profile, *, output: bool, split: bool = False,
                 host_weights: bool = False) -> int:
    """Bytes a GPU needs beyond weights and KV: the CUDA context of the process on it (with
    the memory pool llama.cpp grows while serving) and llama.cpp's compute buffer.

    output: the device holds the output layer; split: a non-output device of a multi-GPU
    layer split (else: expert tensors only); host_weights: some weights stay in host RAM.
    """
    n_embd, n_vocab, ffn, largest = model_shape(model)
    if not n_embd:
        return GPU_OVERHEAD
    act = _ubatch(profile) * 4 * (n_embd + ffn)
    if output:
        compute = COMPUTE_OUTPUT * act + _ubatch(profile) * 4 * n_vocab
    else:
        compute = (COMPUTE_SPLIT if split else COMPUTE_EXPERTS) * act
    return CUDA_CONTEXT + compute + (largest if host_weights else 0)


def _overhead(dev: Device, model: Model, profile: Profile, *, output: bool,
              split: bool = False, host_weights: bool = False) -> int:
    if dev.kind is Kind.CPU:
        return CPU_OVERHEAD
    return gpu_overhead(model, profile, output=output, split=split, host_weights=host_weights)


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
        return _layer_placements(profile, model, [head], [n], ctx, kv_type, 1)
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
    out = [Placement(head.name, gpu_blocks, gpu_w, kv_layer * gpu_blocks,
                     gpu_overhead(model, profile, output=gpu_layers > 0,
                                  host_weights=bool(first_gpu or cpu_moe)),
                     _available(head, 1), what=what if gpu_layers else "nothing")]
    cpu_w = model.non_layer_bytes() + sum(layer_bytes) - gpu_w
    if first_gpu or cpu_moe:  # (the input embedding alone on the CPU is not worth a row)
        out.append(Placement(
            "cpu (host RAM)", first_gpu, cpu_w, kv_layer * first_gpu, CPU_OVERHEAD,
            _available(host, 1) if host else 0,
            what=(f"layers 0-{first_gpu - 1}" if first_gpu else "input embedding")
            + (f", experts of layers 0-{len(cpu_moe) - 1}" if cpu_moe else "")))
    return out


def _fits(placements: Sequence[Placement]) -> bool:
    return not any(p.free_bytes and p.need_bytes > p.free_bytes for p in placements)


def _check_fit(placements: Sequence[Placement], profile: Profile) -> None:
    if _fits(placements):
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


def _layer_placements(profile: Profile, model: Model, order: Sequence[Device],
                      counts: Sequence[int], ctx: int, kv_type: float, cpu_sharers: int,
                      layer_bytes: Sequence[int] | None = None,
                      host_weights: bool = False) -> list[Placement]:
    """Placements in layer order (`order` lists devices by the blocks they hold, first first).

    The output layer goes with the last device in layer order, as llama.cpp places it.
    `layer_bytes` overrides the model's bytes per block (experts kept on the CPU left out).
    """
    layer_bytes = list(model.layer_bytes() if layer_bytes is None else layer_bytes)
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
            overhead_bytes=_overhead(dev, model, profile, output=last, split=len(order) > 1,
                                     host_weights=host_weights),
            free_bytes=_available(dev, cpu_sharers),
            what=f"layers {start}-{start + count - 1}" + (" + output" if last else "")
            if count else ("output" if last else "layers")))
        start += count
    return out


def _ranges(nums: Iterable[int]) -> str:
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
    return Plan(profile=profile.name, source=profile.source, model_path="",
                model_kind=ModelKind.NONE, mode=PlanMode(profile.mode.value),
                transport=PlanTransport.RPC, host=profile.host, port=profile.port,
                engines=(peer,), router=router)


# Measured on two H200s with hydra itself (docs/measurements.md); quoted in plan notes.
LOCAL_VS_RPC = "one llama-server over both GPUs decoded at 0.96-1.03 of one GPU, a ggml-RPC " \
    "layer split at 0.78-0.87, MoE experts over RPC at 0.15-0.17 (two H200s)"


def choose_transport(profile: Profile, head: Device, peers: Sequence[Device]
                     ) -> tuple[Transport, str]:
    """The transport a COMBINE runs over, and the plan note that says why."""
    devs = [head, *peers]
    names = ", ".join(f"{d.name} (CUDA{d.cuda_index})" if d.kind is Kind.CUDA else d.name
                      for d in devs)
    others = [d for d in devs if d.kind is not Kind.CUDA]
    if profile.transport is Transport.AUTO:
        if not others:
            return Transport.LOCAL, (
                f"transport auto -> local: {names} are all GPUs of this host, so one "
                "llama-server runs over them, no ggml-RPC (" + LOCAL_VS_RPC + "); set "
                "transport: rpc to keep a GPU as an independent peer engine")
        why = "; ".join(f"{d.name} is " + (f"a remote host ({d.endpoint})"
                                           if d.kind is Kind.REMOTE else "the CPU")
                        for d in others)
        return Transport.RPC, f"transport auto -> rpc: {why}, which only ggml-RPC reaches"
    if profile.transport is Transport.LOCAL:
        if others:
            raise HydraError(f"{profile.source}: transport: local runs one llama-server over "
                             "local GPUs only; CPU and remote peers need transport: rpc "
                             f"(or auto); not local GPUs: {', '.join(d.name for d in others)}")
        return Transport.LOCAL, "transport local (set in the profile)"
    note = "transport rpc (set in the profile)"
    if not others:
        note += ("; all devices are local GPUs, where transport: auto or local would run one "
                 "llama-server over them (" + LOCAL_VS_RPC + "); keep rpc only if a peer GPU "
                 "must stay an independent engine")
    return Transport.RPC, note


def choose_moe_split(profile: Profile, transport: Transport) -> MoeSplit:
    """moe_split: auto -> whole layers, over either transport: measured on two H200s, a layer
    split crosses between devices once per token (0.98-1.05 of SOLO decode locally, 0.71 over
    RPC) while experts on the other device cross there and back in every layer (0.39-0.42
    locally, 0.15-0.18 over RPC). The experts form is for capacity: attention and the whole KV
    cache stay on the head's GPU."""
    if profile.moe_split is not MoeSplit.AUTO:
        return profile.moe_split
    return MoeSplit.LAYERS


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
    kind = ModelKind.MOE if model.is_moe else ModelKind.DENSE
    ctx = _ctx(profile, model)
    kv_type = _kv_type_bytes(profile)
    combine = profile.mode is Mode.COMBINE
    extra = server_flags(profile.server_args, combine=combine, source=profile.source)
    if profile.n_cpu_moe is not None and not model.is_moe:
        raise HydraError(f"{profile.source}: n_cpu_moe is for MoE models; {model_path} is dense")
    if profile.moe_split is not MoeSplit.AUTO and combine and not model.is_moe:
        # (SOLO ignores it: on_peer_loss: degrade re-plans a COMBINE profile as SOLO)
        raise HydraError(f"{profile.source}: moe_split is for mode: combine of an MoE model; "
                         f"{model_path} is dense")
    cpu_sharers = sum(1 for d in [head_dev, *peer_devs] if d.kind is Kind.CPU)
    head_host, head_port = ((PEER_BIND, internal_port) if internal_port
                            else (profile.host, profile.port))
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
    meta: dict[str, object] = {"ctx": ctx, "block_count": model.block_count}

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
    else:
        transport, why = choose_transport(profile, head_dev, peer_devs)
        notes.append(why)
        meta["transport_requested"] = profile.transport.value
        split = choose_moe_split(profile, transport) if model.is_moe else None
        if split is not None:
            meta["moe_split"] = split.value
        if transport is Transport.LOCAL:
            engines.append(_local_head(profile, model, head_dev, peer_devs, split, base, extra,
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
            peers = [_peer_spec(f"peer-{d.name}", d,
                                None if d.kind is Kind.REMOTE else next(ports), i, profile)
                     for i, d in enumerate(peer_devs)]
            engines += peers
            rpc = ",".join(p.endpoint for p in peers)
            if split is MoeSplit.EXPERTS:
                if len(peers) != 1:
                    raise HydraError(f"{profile.source}: MoE combine puts the experts on one "
                                     f"peer; got {len(peers)} peers (or set moe_split: layers)")
                args, placements = _moe_combine(profile, model, head_dev, peer_devs[0],
                                                f"RPC0[{peers[0].endpoint}]", ctx, kv_type,
                                                cpu_sharers)
            else:
                args, placements = _dense_combine(profile, model, head_dev, peer_devs, ctx,
                                                  kv_type, cpu_sharers)
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
        mode=PlanMode(profile.mode.value), transport=PlanTransport(transport.value),
        host=profile.host, port=profile.port,
        engines=tuple(engines), placements=tuple(placements), notes=tuple(notes),
        meta=meta, router=router)


def _local_head(profile: Profile, model: Model, head: Device, peers: Sequence[Device],
                split: MoeSplit | None, base: list[str], extra: list[str], ctx: int,
                kv_type: float, host: Device | None, placements: list[Placement],
                notes: list[str], bind: str, port: int) -> EngineSpec:
    """transport local: one llama-server over the profile's GPUs (fills `placements`)."""
    if split is MoeSplit.EXPERTS:
        if len(peers) != 1:
            raise HydraError(f"{profile.source}: moe_split: experts puts the experts on one "
                             f"peer GPU; got {len(peers)} peers (or set moe_split: layers)")
        gpus = [head, peers[0]]  # the head is CUDA0, the experts' GPU CUDA1
        args, pls = _moe_combine(profile, model, head, peers[0], "CUDA1", ctx, kv_type, 1,
                                 host=host, notes=notes)
    else:
        gpus = [*peers, head]  # llama.cpp order as over RPC: the head's GPU last, with output
        args, pls = _local_layer_split(profile, model, gpus, ctx, kv_type, host, notes)
    placements += pls
    return EngineSpec(
        name="head", role=Role.HEAD, program="llama-server", args=tuple(base + args + extra),
        env=_base_env(profile) + _pin_env(gpus), host=bind, port=port,
        device="+".join(d.name for d in gpus), start_order=0)


def _cpu_experts_row(model: Model, n_cpu: int, host: Device | None) -> Placement:
    expert = model.expert_bytes_per_layer()
    return Placement("cpu (host RAM)", 0, sum(expert[:n_cpu]), 0, CPU_OVERHEAD,
                     _available(host, 1) if host else 0,
                     what=f"experts of layers {_ranges(range(n_cpu))} (--n-cpu-moe {n_cpu})")


def _local_layer_split(profile: Profile, model: Model, gpus: Sequence[Device], ctx: int,
                       kv_type: float, host: Device | None, notes: list[str]
                       ) -> tuple[list[str], list[Placement]]:
    """Whole layers per GPU (-sm layer -ts); for an MoE that does not fit, the experts of the
    first layers stay in host RAM (--n-cpu-moe N, the smallest N that fits)."""
    counts = plan_layer_split(profile, model, gpus, 1)
    layer_bytes = model.layer_bytes()
    expert = model.expert_bytes_per_layer()

    def attempt(n_cpu: int) -> list[Placement]:
        on_gpu = [b - (expert[i] if i < n_cpu else 0) for i, b in enumerate(layer_bytes)]
        pls = _layer_placements(profile, model, gpus, counts, ctx, kv_type, 1, on_gpu,
                                host_weights=n_cpu > 0)
        return pls + ([_cpu_experts_row(model, n_cpu, host)] if n_cpu else [])

    n_cpu = profile.n_cpu_moe or 0
    pls = attempt(n_cpu)
    if model.is_moe and profile.n_cpu_moe is None and not _fits(pls):
        for n in range(1, model.block_count + 1):
            if _fits(attempt(n)):
                n_cpu, pls = n, attempt(n)
                notes.append(f"not all experts fit the GPUs: the experts of layers "
                             f"{_ranges(range(n))} stay in host RAM (--n-cpu-moe {n}); set "
                             "n_cpu_moe to choose")
                break
    _check_fit(pls, profile)
    args = ["-ngl", "99", "-sm", "layer", "-ts", _ts(counts)]
    return args + (["--n-cpu-moe", str(n_cpu)] if n_cpu else []), pls


def _dense_combine(profile: Profile, model: Model, head: Device, peers: Sequence[Device],
                   ctx: int, kv_type: float, cpu_sharers: int
                   ) -> tuple[list[str], list[Placement]]:
    order = [*peers, head]
    counts = plan_layer_split(profile, model, order, cpu_sharers)
    if head.kind is Kind.CPU:
        # The CPU is not an offload device: -ngl N offloads the last N blocks to the RPC
        # devices (split among them by -ts); the first blocks stay on the head.
        placements = _layer_placements(profile, model, [head, *peers],
                                       [counts[-1], *counts[:-1]], ctx, kv_type, cpu_sharers)
        _check_fit(placements, profile)
        # -ngl counts the output layer too (offloaded first, to the last RPC device).
        args = ["-ngl", str(sum(counts[:-1]) + 1), "-sm", "layer"]
        if len(peers) > 1:
            args += ["-ts", _ts(counts[:-1])]
        return args, placements
    placements = _layer_placements(profile, model, order, counts, ctx, kv_type, cpu_sharers)
    _check_fit(placements, profile)
    return ["-ngl", "99", "-sm", "layer", "-ts", _ts(counts)], placements


def _moe_combine(profile: Profile, model: Model, head: Device, peer: Device, buft: str,
                 ctx: int, kv_type: float, cpu_sharers: int, *, host: Device | None = None,
                 notes: list[str] | None = None) -> tuple[list[str], list[Placement]]:
    """Experts of the trailing layers on `peer` (buffer type `buft`: RPC0[host:port] or CUDA1),
    as many as fit; the rest of the model on the head. With `host` (one process over local
    GPUs), experts that fit neither GPU stay in host RAM: those of the first layers
    (--n-cpu-moe N, the smallest N that fits), unless the profile sets n_cpu_moe."""
    expert_bytes = model.expert_bytes_per_layer()
    layers = [i for i, b in enumerate(expert_bytes) if b > 0]
    peer_avail = _available(peer, cpu_sharers)
    peer_over = _overhead(peer, model, profile, output=False)
    chosen = list(layers)
    if peer_avail:
        # Experts of the last layers first, so whole trailing layers' experts sit on the peer.
        while chosen and sum(expert_bytes[i] for i in chosen) + peer_over > peer_avail:
            chosen.pop(0)
        if not chosen:
            raise HydraError(
                f"{profile.source}: not even one layer's experts "
                f"({max(expert_bytes) / MIB:,.0f} MiB) fit on peer '{peer.name}' "
                f"({peer_avail / MIB:,.0f} MiB usable)")
    pattern = expert_pattern(model.tensor_names(), chosen)
    peer_bytes = sum(expert_bytes[i] for i in chosen)
    total = sum(model.layer_bytes()) + model.non_layer_bytes()
    kv = model.kv_bytes_per_token(kv_type) * ctx

    def attempt(n_cpu: int) -> list[Placement]:
        cpu_bytes = sum(expert_bytes[:n_cpu])
        head_bytes = total - peer_bytes - cpu_bytes
        if head.kind is Kind.CUDA:  # the input embedding stays in host RAM
            head_bytes -= total - sum(model.layer_bytes()) - model.output_bytes()
        pls = [
            Placement(peer.name, len(chosen), peer_bytes, 0, peer_over, peer_avail,
                      what=f"experts of {len(chosen)} layers ({_ranges(chosen)})"),
            Placement(head.name, model.block_count, head_bytes, kv,
                      _overhead(head, model, profile, output=True, host_weights=n_cpu > 0),
                      _available(head, cpu_sharers),
                      what=f"all {model.block_count} layers but those experts"),
        ]
        return pls + ([_cpu_experts_row(model, n_cpu, host)] if n_cpu else [])

    n_cpu = profile.n_cpu_moe or 0 if host is not None else 0
    if n_cpu and set(range(n_cpu)) & set(chosen):
        raise HydraError(f"{profile.source}: n_cpu_moe {n_cpu} keeps experts on the CPU that "
                         f"the plan puts on '{peer.name}' (layers {_ranges(chosen)})")
    placements = attempt(n_cpu)
    if host is not None and profile.n_cpu_moe is None and not _fits(placements):
        free_layers = min(chosen) if chosen else model.block_count
        for n in range(1, free_layers + 1):
            if _fits(attempt(n)):
                n_cpu, placements = n, attempt(n)
                if notes is not None:
                    notes.append(f"not all experts fit the GPUs: the experts of layers "
                                 f"{_ranges(range(n))} stay in host RAM (--n-cpu-moe {n})")
                break
    _check_fit(placements, profile)
    if head.kind is Kind.CUDA:
        # -ts 1,0 (local; 0,1 over RPC, where the RPC device comes first): every layer on the
        # head's GPU; without it llama.cpp also spreads whole layers over the other device by
        # free memory, not just the overridden experts.
        args = ["-ngl", "99"] + (["-sm", "layer", "-ts", "1,0"] if host is not None
                                 else ["-ts", "0,1"])
    else:
        args = ["-ngl", "0"]  # the CPU is no offload device: only the -ot tensors move
    # Over RPC the buffer type name is RPC0[host:port]; bare RPC0 is "unknown buffer type".
    args += ["-ot", f"{pattern}={buft}"]
    if n_cpu:
        args += ["--n-cpu-moe", str(n_cpu)]
    return args, placements
