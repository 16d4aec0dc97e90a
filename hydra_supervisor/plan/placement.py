"""Placement arithmetic (pure): what each device holds and needs -- the memory a GPU holds
besides weights and KV, the layer split over devices (a profile's `split` or by free memory),
the rows of a SOLO and of a layer split, whether they fit, and the -ts that says it to llama.cpp.

The resolver (resolver.py) and the COMBINE layouts (combine.py) call these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from hydra_supervisor.config.profile import Profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.devices import MIB, Device, Kind
from hydra_supervisor.plan.plan import Placement

# What a GPU holds besides weights and KV (not in the GGUF): the process's CUDA context (CUDA
# runtime, cuBLAS, the kernels loaded) and llama.cpp's compute buffers, estimated in
# gpu_overhead(). Constants from NVML per-process memory on H200s (docs/measurements.md).
CUDA_CONTEXT = 704 * MIB  # seen: 592-699 MiB per process and GPU
GPU_OVERHEAD = 768 * MIB  # the estimate for a model whose shape is unknown (test stand-ins)
CPU_OVERHEAD = 256 * MIB
SAFETY = 0.05  # keep 5% of each device's free memory unplanned
DEFAULT_UBATCH = 512


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


def context_size(profile: Profile, model: Model) -> int:
    for key in ("ctx-size", "c"):
        val = profile.server_args.get(key)
        if isinstance(val, int) and val > 0:
            return val
    return model.context_length or 4096


def kv_type_bytes(profile: Profile) -> float:
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


def device_overhead(dev: Device, model: Model, profile: Profile, *, output: bool,
              split: bool = False, host_weights: bool = False) -> int:
    if dev.kind is Kind.CPU:
        return CPU_OVERHEAD
    return gpu_overhead(model, profile, output=output, split=split, host_weights=host_weights)


def available_bytes(dev: Device, cpu_sharers: int) -> int:
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
    avail = [available_bytes(d, cpu_sharers) for d in order]
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


def solo_placements(profile: Profile, model: Model, head: Device, host: Device | None,
                     ctx: int, kv_type: float) -> list[Placement]:
    """SOLO: all on the head's device, minus what n-gpu-layers / n_cpu_moe leave on the CPU."""
    n = model.block_count
    if head.kind is Kind.CPU:
        return layer_placements(profile, model, [head], [n], ctx, kv_type, 1)
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
                     available_bytes(head, 1), what=what if gpu_layers else "nothing")]
    cpu_w = model.non_layer_bytes() + sum(layer_bytes) - gpu_w
    if first_gpu or cpu_moe:  # (the input embedding alone on the CPU is not worth a row)
        out.append(Placement(
            "cpu (host RAM)", first_gpu, cpu_w, kv_layer * first_gpu, CPU_OVERHEAD,
            available_bytes(host, 1) if host else 0,
            what=(f"layers 0-{first_gpu - 1}" if first_gpu else "input embedding")
            + (f", experts of layers 0-{len(cpu_moe) - 1}" if cpu_moe else "")))
    return out


def fits(placements: Sequence[Placement]) -> bool:
    return not any(p.free_bytes and p.need_bytes > p.free_bytes for p in placements)


class DoesNotFit(HydraError):
    """The layout needs more memory than its devices have (`hydra profiles`: "does not fit").
    `devices`: those that are short (a remote one with spares is tried on the next: spares.py)."""

    def __init__(self, message: str, *, hint: str | None = None,
                 devices: Sequence[str] = ()) -> None:
        super().__init__(message, hint=hint)
        self.devices = tuple(devices)


def check_fit(placements: Sequence[Placement], profile: Profile) -> None:
    if fits(placements):
        return
    rows = "\n".join(
        f"  {p.device}: needs {p.need_bytes / MIB:,.0f} MiB ({p.what}: weights "
        f"{p.weight_bytes / MIB:,.0f} + KV {p.kv_bytes / MIB:,.0f} + buffers "
        f"{p.overhead_bytes / MIB:,.0f}), has {p.free_bytes / MIB:,.0f} MiB usable"
        for p in placements)
    raise DoesNotFit(
        f"{profile.source}: model does not fit the devices of profile '{profile.name}':\n{rows}",
        hint="add a peer, lower ctx-size / use a quantized KV cache (cache-type-k/v: q8_0), "
             "or pick a smaller quant",
        devices=[p.device for p in placements if p.free_bytes and p.need_bytes > p.free_bytes])


def layer_placements(profile: Profile, model: Model, order: Sequence[Device],
                      counts: Sequence[int], ctx: int, kv_type: float, cpu_sharers: int,
                      layer_bytes: Sequence[int] | None = None,
                      host_weights: bool = False, output_on: int = -1) -> list[Placement]:
    """Placements in layer order (`order` lists devices by the blocks they hold, first first).

    The output layer goes with the last device in layer order, as llama.cpp places it, unless
    `output_on` names another index into `order` (the planner pins it there with -ot).
    `layer_bytes` overrides the model's bytes per block (experts kept on the CPU left out).
    """
    layer_bytes = list(model.layer_bytes() if layer_bytes is None else layer_bytes)
    kv_per_layer = model.kv_bytes_per_token(kv_type) * ctx // max(model.block_count, 1)
    out = []
    start = 0
    output_on %= len(order)
    for i, (dev, count) in enumerate(zip(order, counts, strict=True)):
        weights = sum(layer_bytes[start:start + count])
        has_output = i == output_on
        if has_output:
            weights += model.output_bytes()
        out.append(Placement(
            device=dev.name, layers=count, weight_bytes=weights, kv_bytes=kv_per_layer * count,
            overhead_bytes=device_overhead(dev, model, profile, output=has_output,
                                           split=len(order) > 1, host_weights=host_weights),
            free_bytes=available_bytes(dev, cpu_sharers),
            what=f"layers {start}-{start + count - 1}" + (" + output" if has_output else "")
            if count else ("output" if has_output else "layers")))
        start += count
    return out


def layer_ranges(nums: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    for n in sorted(nums):
        if out and int(out[-1].split("-")[-1]) == n - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{n}"
        else:
            out.append(str(n))
    return ", ".join(out)


def tensor_split_arg(counts: Sequence[int]) -> str:
    """-ts for llama.cpp, which spreads it over the offloaded blocks *and* the output layer:
    the last device (which gets the output layer) counts one more."""
    return ",".join(str(c + (1 if i == len(counts) - 1 else 0)) for i, c in enumerate(counts))
