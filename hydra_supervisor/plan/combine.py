"""The COMBINE layouts (pure): the head's flags and the placements of a layer split over local
GPUs or ggml-RPC peers, and of an MoE's experts on a peer (-ot '<experts regex>=CUDA1' or
RPC0[host:port]), with the experts that fit neither GPU left in host RAM (--n-cpu-moe); and the
expert override pattern, built from the GGUF's tensor names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from hydra_supervisor.config.profile import MoeSplit, Profile
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.devices import MIB, Device, Kind
from hydra_supervisor.plan.peers import base_env, pin_env
from hydra_supervisor.plan.placement import (
    CPU_OVERHEAD,
    DoesNotFit,
    Model,
    available_bytes,
    check_fit,
    device_overhead,
    fits,
    layer_placements,
    layer_ranges,
    plan_layer_split,
    tensor_split_arg,
)
from hydra_supervisor.plan.plan import EngineSpec, Placement, Role

EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_([a-z_]+?)_exps\.weight$")
OUTPUT_TENSORS = ("output_norm.weight", "output_norm.bias", "output.weight", "output.bias")


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


def local_head(profile: Profile, model: Model, head: Device, peers: Sequence[Device],
                split: MoeSplit | None, base: list[str], extra: list[str], ctx: int,
                kv_type: float, host: Device | None, placements: list[Placement],
                notes: list[str], bind: str, port: int) -> EngineSpec:
    """transport local: one llama-server over the profile's GPUs (fills `placements`)."""
    if split is MoeSplit.EXPERTS:
        if len(peers) != 1:
            raise HydraError(f"{profile.source}: moe_split: experts puts the experts on one "
                             f"peer GPU; got {len(peers)} peers (or set moe_split: layers)")
        gpus = [head, peers[0]]  # the head is CUDA0, the experts' GPU CUDA1
        args, pls = moe_combine(profile, model, head, peers[0], "CUDA1", ctx, kv_type, 1,
                                 host=host, notes=notes)
    else:
        gpus = [*peers, head]  # llama.cpp order as over RPC: the head's GPU last, with output
        args, pls = _local_layer_split(profile, model, gpus, ctx, kv_type, host, notes)
    placements += pls
    return EngineSpec(
        name="head", role=Role.HEAD, program="llama-server", args=tuple(base + args + extra),
        env=base_env(profile) + pin_env(gpus), host=bind, port=port,
        device="+".join(d.name for d in gpus), start_order=0)


def _cpu_experts_row(model: Model, n_cpu: int, host: Device | None) -> Placement:
    expert = model.expert_bytes_per_layer()
    return Placement("cpu (host RAM)", 0, sum(expert[:n_cpu]), 0, CPU_OVERHEAD,
                     available_bytes(host, 1) if host else 0,
                     what=f"experts of layers {layer_ranges(range(n_cpu))} (--n-cpu-moe {n_cpu})")


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
        pls = layer_placements(profile, model, gpus, counts, ctx, kv_type, 1, on_gpu,
                                host_weights=n_cpu > 0)
        return pls + ([_cpu_experts_row(model, n_cpu, host)] if n_cpu else [])

    n_cpu = profile.n_cpu_moe or 0
    pls = attempt(n_cpu)
    if model.is_moe and profile.n_cpu_moe is None and not fits(pls):
        for n in range(1, model.block_count + 1):
            if fits(attempt(n)):
                n_cpu, pls = n, attempt(n)
                notes.append(f"not all experts fit the GPUs: the experts of layers "
                             f"{layer_ranges(range(n))} stay in host RAM (--n-cpu-moe {n}); set "
                             "n_cpu_moe to choose")
                break
    check_fit(pls, profile)
    args = ["-ngl", "99", "-sm", "layer", "-ts", tensor_split_arg(counts)]
    return args + (["--n-cpu-moe", str(n_cpu)] if n_cpu else []), pls


def output_pattern(tensor_names: Sequence[str]) -> str:
    """A regex (as llama.cpp's -ot searches it) matching exactly the output layer's tensors:
    output_norm and output (token_embd where the model ties its embeddings: llama.cpp's output
    layer then uses a duplicate of it, which the rule places too)."""
    names = set(tensor_names)
    want = [n for n in OUTPUT_TENSORS if n in names]
    if "output.weight" not in names and "token_embd.weight" in names:
        want.append("token_embd.weight")
    if not want:
        raise HydraError("model has no output layer tensors (output.weight, "
                         "output_norm.weight or token_embd.weight)")
    pattern = "^(?:" + "|".join(re.escape(n) for n in want) + ")$"
    compiled = re.compile(pattern)
    got = {n for n in names if compiled.search(n)}
    if got != set(want):
        raise AssertionError(f"generated -ot pattern {pattern!r} matches {sorted(got)}, "
                             f"expected exactly {want}")
    return pattern


def dense_combine(profile: Profile, model: Model, head: Device, peers: Sequence[Device],
                   ctx: int, kv_type: float, cpu_sharers: int, notes: list[str] | None = None
                   ) -> tuple[list[str], list[Placement]]:
    order = [*peers, head]
    counts = plan_layer_split(profile, model, order, cpu_sharers)
    if head.kind is Kind.CPU:
        # The CPU is not an offload device: -ngl N offloads the last N blocks to the RPC
        # devices (split among them by -ts); the first blocks stay on the head. llama.cpp puts
        # the output layer on the last RPC device; across a network link that costs each token
        # its logits (n_vocab x 4 bytes) over the link, so with a remote peer an -ot rule keeps
        # the output layer on the head (only the hidden state, n_embd x 4 bytes, crosses).
        remote = [p for p in peers if p.kind is Kind.REMOTE]
        placements = layer_placements(profile, model, [head, *peers],
                                       [counts[-1], *counts[:-1]], ctx, kv_type, cpu_sharers,
                                       output_on=0 if remote else -1)
        check_fit(placements, profile)
        # -ngl counts the output layer too (offloaded first, to the last RPC device).
        args = ["-ngl", str(sum(counts[:-1]) + 1), "-sm", "layer"]
        if len(peers) > 1:
            args += ["-ts", tensor_split_arg(counts[:-1])]
        if remote:
            args += ["-ot", f"{output_pattern(model.tensor_names())}=CPU"]
            if notes is not None:
                notes.append(f"the output layer stays on the head ({head.name}): "
                             f"{remote[0].name} is a remote host, and each token's logits would "
                             "cross the link (-ot ...=CPU)")
        return args, placements
    placements = layer_placements(profile, model, order, counts, ctx, kv_type, cpu_sharers)
    check_fit(placements, profile)
    return ["-ngl", "99", "-sm", "layer", "-ts", tensor_split_arg(counts)], placements


def moe_combine(profile: Profile, model: Model, head: Device, peer: Device, buft: str,
                 ctx: int, kv_type: float, cpu_sharers: int, *, host: Device | None = None,
                 notes: list[str] | None = None) -> tuple[list[str], list[Placement]]:
    """Experts of the trailing layers on `peer` (buffer type `buft`: RPC0[host:port] or CUDA1),
    as many as fit; the rest of the model on the head. With `host` (one process over local
    GPUs), experts that fit neither GPU stay in host RAM: those of the first layers
    (--n-cpu-moe N, the smallest N that fits), unless the profile sets n_cpu_moe."""
    expert_bytes = model.expert_bytes_per_layer()
    layers = [i for i, b in enumerate(expert_bytes) if b > 0]
    peer_avail = available_bytes(peer, cpu_sharers)
    peer_over = device_overhead(peer, model, profile, output=False)
    chosen = list(layers)
    if peer_avail:
        # Experts of the last layers first, so whole trailing layers' experts sit on the peer.
        while chosen and sum(expert_bytes[i] for i in chosen) + peer_over > peer_avail:
            chosen.pop(0)
        if not chosen:
            raise DoesNotFit(
                f"{profile.source}: not even one layer's experts "
                f"({max(expert_bytes) / MIB:,.0f} MiB) fit on peer '{peer.name}' "
                f"({peer_avail / MIB:,.0f} MiB usable)", devices=(peer.name,))
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
                      what=f"experts of {len(chosen)} layers ({layer_ranges(chosen)})"),
            Placement(head.name, model.block_count, head_bytes, kv,
                      device_overhead(head, model, profile, output=True, host_weights=n_cpu > 0),
                      available_bytes(head, cpu_sharers),
                      what=f"all {model.block_count} layers but those experts"),
        ]
        return pls + ([_cpu_experts_row(model, n_cpu, host)] if n_cpu else [])

    n_cpu = profile.n_cpu_moe or 0 if host is not None else 0
    if n_cpu and set(range(n_cpu)) & set(chosen):
        raise HydraError(f"{profile.source}: n_cpu_moe {n_cpu} keeps experts on the CPU that "
                         f"the plan puts on '{peer.name}' (layers {layer_ranges(chosen)})")
    placements = attempt(n_cpu)
    if host is not None and profile.n_cpu_moe is None and not fits(placements):
        free_layers = min(chosen) if chosen else model.block_count
        for n in range(1, free_layers + 1):
            if fits(attempt(n)):
                n_cpu, placements = n, attempt(n)
                if notes is not None:
                    notes.append(f"not all experts fit the GPUs: the experts of layers "
                                 f"{layer_ranges(range(n))} stay in host RAM (--n-cpu-moe {n})")
                break
    check_fit(placements, profile)
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
