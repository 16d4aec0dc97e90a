"""Devices, peers and the transport (pure): looking up a profile's devices, the environment
that pins an engine to its device, a peer's ggml-rpc-server (managed on this host, or a remote
one hydra only reaches), and the choice of transport (local or ggml-RPC) and of moe_split for a
COMBINE, with the plan note that says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hydra_supervisor.config.profile import MoeSplit, Profile, Transport
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan.devices import Device, Kind
from hydra_supervisor.plan.plan import EngineSpec, Role
from hydra_supervisor.plan.ports import endpoint_parts

PEER_BIND = "127.0.0.1"


def pin_env(dev: Device | Sequence[Device]) -> tuple[tuple[str, str], ...]:
    devs = [dev] if isinstance(dev, Device) else list(dev)
    cuda = [str(d.cuda_index) for d in devs if d.kind is Kind.CUDA]
    # An empty CUDA_VISIBLE_DEVICES hides every GPU, so a CPU engine of a CUDA build stays on CPU.
    return (("CUDA_VISIBLE_DEVICES", ",".join(cuda)),)


# llama-server stamps each log line with its time since start and its level (its own
# --log-timestamps --log-prefix, as environment so the argv stays the profile's); hydra's run
# marker turns the stamps into wall-clock times (proc/logfiles.py). ggml-rpc-server has no such
# option and ignores them. A profile's env: may turn them off (LLAMA_ARG_LOG_TIMESTAMPS=0).
LOG_ENV = {"LLAMA_ARG_LOG_TIMESTAMPS": "1", "LLAMA_ARG_LOG_PREFIX": "1"}


def base_env(profile: Profile) -> tuple[tuple[str, str], ...]:
    # ggml runs gdb for a backtrace on abort when gdb exists; that delays a dead head's exit.
    env = {"GGML_NO_BACKTRACE": "1", **LOG_ENV, **profile.env}
    return tuple(env.items())


def device_named(devices: Mapping[str, Device], name: str, profile: Profile, key: str) -> Device:
    if name not in devices:
        raise HydraError(
            f"{profile.source}: {key}: unknown device '{name}'; known devices: "
            f"{', '.join(sorted(devices))}",
            hint="name devices in the node file (devices: {rtx: {cuda: 0}})")
    return devices[name]


def peer_spec(name: str, dev: Device, port: int | None, order: int, profile: Profile
               ) -> EngineSpec:
    if dev.kind is Kind.REMOTE:
        assert dev.endpoint
        host, p = endpoint_parts(dev.endpoint)
        return EngineSpec(name=name, role=Role.PEER, program="ggml-rpc-server", args=(),
                          env=(), host=host, port=p, device=dev.name, start_order=order,
                          managed=False, tls=dev.tls)
    assert port is not None
    # -c: keep ggml-rpc-server's tensor cache so a restarted head does not resend weights.
    args: tuple[str, ...] = ("-H", PEER_BIND, "-p", str(port), "-c")
    if dev.kind is Kind.CPU:
        threads = profile.server_args.get("threads", profile.server_args.get("t"))
        threads = threads if isinstance(threads, int) and threads > 0 else dev.threads
        if threads:
            args += ("-t", str(threads))
    return EngineSpec(name=name, role=Role.PEER, program="ggml-rpc-server", args=args,
                      env=base_env(profile) + pin_env(dev), host=PEER_BIND, port=port,
                      device=dev.name, start_order=order)


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
