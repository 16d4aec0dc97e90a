"""Golden argv/env tests for the resolver's four cells (pure: no processes, no files).

The model here is a stand-in with llama.cpp's real tensor naming; test_resolver_moe.py checks
the generated -ot patterns against a real synthetic MoE GGUF.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from hydra_supervisor.config.config import Mode, MoeSplit, Profile, Transport
from hydra_supervisor.errors import HydraError
from hydra_supervisor.plan import resolver
from hydra_supervisor.plan.devices import MIB, Device, Kind

GIB = 1024 * MIB


@dataclass
class FakeModel:
    block_count: int = 4
    context_length: int = 4096
    expert_count: int = 0
    per_layer: int = 100 * MIB
    per_layer_experts: int = 0
    extra: int = 50 * MIB
    kv_per_token: int = 16 * 1024
    names: list[str] = field(default_factory=list)

    @property
    def is_moe(self) -> bool:
        return self.expert_count > 0

    def layer_bytes(self) -> list[int]:
        return [self.per_layer + self.per_layer_experts] * self.block_count

    def expert_bytes_per_layer(self) -> list[int]:
        return [self.per_layer_experts] * self.block_count

    def non_layer_bytes(self) -> int:
        return self.extra

    def output_bytes(self) -> int:
        return self.extra // 2  # the other half is token_embd, which stays on the CPU

    def tensor_names(self) -> list[str]:
        if self.names:
            return self.names
        out = ["token_embd.weight", "output_norm.weight", "output.weight"]
        for i in range(self.block_count):
            out += [f"blk.{i}.attn_q.weight", f"blk.{i}.attn_norm.weight"]
            if self.is_moe:
                out += [f"blk.{i}.ffn_gate_inp.weight"] + [
                    f"blk.{i}.ffn_{k}_exps.weight" for k in ("gate", "up", "down")]
            else:
                out += [f"blk.{i}.ffn_{k}.weight" for k in ("gate", "up", "down")]
        return out

    def kv_bytes_per_token(self, type_bytes: float = 2.0) -> int:
        return int(self.kv_per_token * type_bytes / 2)


DEVICES = {
    "cpu": Device("cpu", Kind.CPU, 64 * GIB, 48 * GIB, threads=8),
    "cpu-peer": Device("cpu-peer", Kind.CPU, 64 * GIB, 48 * GIB, threads=8),
    "rtx": Device("rtx", Kind.CUDA, 16 * GIB, 15 * GIB, cuda_index=0, model="RTX 5060 Ti"),
    "rtx3060": Device("rtx3060", Kind.CUDA, 12 * GIB, 11 * GIB, cuda_index=1,
                      model="RTX 3060"),
    "p100": Device("p100", Kind.REMOTE, 16 * GIB, 16 * GIB, endpoint="192.168.122.21:50052"),
}
M = "/m/model.gguf"


def prof(**kw) -> Profile:
    base = Profile(name="t", source="t.yaml", model="x", port=8080)
    return replace(base, **kw)


def test_dense_solo_gpu():
    plan = resolver.resolve(prof(head="rtx", server_args={"ctx-size": 8192, "jinja": True}),
                            FakeModel(), M, DEVICES, [])
    (head,) = plan.engines
    assert head.program == "llama-server"
    assert head.args == ("-m", M, "--alias", "t", "--host", "127.0.0.1", "--port", "8080",
                         "-ngl", "99", "-sm", "none", "--fit", "off", "--ctx-size", "8192",
                         "--jinja")
    assert head.env == (("GGML_NO_BACKTRACE", "1"), ("LLAMA_ARG_LOG_TIMESTAMPS", "1"),
                        ("LLAMA_ARG_LOG_PREFIX", "1"), ("CUDA_VISIBLE_DEVICES", "0"))


def test_dense_solo_cpu_is_the_demo_shape():
    plan = resolver.resolve(prof(head="cpu", server_args={"ctx-size": 4096, "parallel": 2}),
                            FakeModel(), M, DEVICES, [])
    assert plan.head.args == ("-m", M, "--alias", "t", "--host", "127.0.0.1", "--port", "8080",
                              "-ngl", "0", "--ctx-size", "4096", "--parallel", "2")
    assert plan.head.env_dict()["CUDA_VISIBLE_DEVICES"] == ""


def test_dense_combine_gpu_head_rpc_first():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 split=(1, 3), transport=Transport.RPC), FakeModel(), M, DEVICES,
                            [50052])
    peer, head = plan.in_start_order()
    assert peer.args == ("-H", "127.0.0.1", "-p", "50052", "-c")
    assert peer.env_dict()["CUDA_VISIBLE_DEVICES"] == "1"
    assert head.args == ("-m", M, "--alias", "t", "--host", "127.0.0.1", "--port", "8080",
                         "--rpc", "127.0.0.1:50052", "-ngl", "99", "-sm", "layer", "-ts", "1,4",
                         "--fit", "off")
    assert head.env_dict()["CUDA_VISIBLE_DEVICES"] == "0"
    assert [p.layers for p in plan.placements] == [1, 3]
    assert plan.transport == "rpc"
    (note,) = plan.notes
    assert note.startswith("transport rpc (set in the profile); all devices are local GPUs")


def test_dense_combine_split_by_name_and_output_layer_count():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 split={"rtx": 4, "rtx3060": 1}, transport=Transport.RPC),
                            FakeModel(), M, DEVICES, [50052])
    # 5 = 4 blocks + output, as llama.cpp counts -ts: 1 block on the peer, 3 + output on the head
    assert plan.head.args[-4:-2] == ("-ts", "1,4")
    assert [p.layers for p in plan.placements] == [1, 3]


def test_dense_combine_cpu_head_offloads_last_layers():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="cpu", peers=("cpu-peer",),
                                 split=(2, 2)), FakeModel(), M, DEVICES, [50060])
    peer, head = plan.in_start_order()
    assert peer.args == ("-H", "127.0.0.1", "-p", "50060", "-c", "-t", "8")
    # -ngl counts the output layer: 2 blocks + output go to the peer.
    assert head.args[8:] == ("--rpc", "127.0.0.1:50060", "-ngl", "3", "-sm", "layer")
    assert [(p.device, p.layers) for p in plan.placements] == [("cpu", 2), ("cpu-peer", 2)]
    assert plan.transport == "rpc"
    assert plan.notes == ("transport auto -> rpc: cpu is the CPU; cpu-peer is the CPU, which "
                          "only ggml-RPC reaches",)


def test_dense_combine_with_remote_peer_is_not_spawned():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060", "p100"),
                                 split=(1, 1, 2)), FakeModel(), M, DEVICES, [50052])
    local, remote, head = plan.in_start_order()
    assert local.managed and not remote.managed
    assert remote.endpoint == "192.168.122.21:50052"
    assert "--rpc" in head.args
    assert head.args[head.args.index("--rpc") + 1] == "127.0.0.1:50052,192.168.122.21:50052"
    assert head.args[-4:] == ("-ts", "1,1,3", "--fit", "off")
    assert "-ot" not in head.args  # a GPU head comes last in the split: the output is its own
    assert plan.transport == "rpc"
    assert plan.notes == ("transport auto -> rpc: p100 is a remote host (192.168.122.21:50052), "
                          "which only ggml-RPC reaches",)


def test_cpu_head_keeps_the_output_layer_when_the_peer_is_remote():
    # llama.cpp would put the output layer on the last RPC device; across a link each token's
    # logits (n_vocab x 4 bytes) would then cross it, so an -ot rule keeps it on the head.
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="cpu", peers=("p100",), split=(2, 2)),
                            FakeModel(), M, DEVICES, [50060])
    remote, head = plan.in_start_order()
    assert not remote.managed
    assert head.args[8:] == ("--rpc", "192.168.122.21:50052", "-ngl", "3", "-sm", "layer",
                             "-ot", r"^(?:output_norm\.weight|output\.weight)$=CPU")
    assert [(p.device, p.layers, p.what) for p in plan.placements] == [
        ("cpu", 2, "layers 0-1 + output"), ("p100", 2, "layers 2-3")]
    head_pl, peer_pl = plan.placements
    assert head_pl.weight_bytes == 2 * 100 * MIB + FakeModel().output_bytes()
    assert peer_pl.weight_bytes == 2 * 100 * MIB
    assert plan.notes[-1] == ("the output layer stays on the head (cpu): p100 is a remote host, "
                              "and each token's logits would cross the link (-ot ...=CPU)")


def test_output_pattern_names_the_tied_embedding_and_nothing_else():
    from hydra_supervisor.plan.combine import output_pattern

    tied = [n for n in FakeModel().tensor_names() if n != "output.weight"]
    pattern = output_pattern(tied)
    assert pattern == r"^(?:output_norm\.weight|token_embd\.weight)$"
    assert output_pattern(FakeModel().tensor_names()) == (
        r"^(?:output_norm\.weight|output\.weight)$")
    with pytest.raises(HydraError, match="no output layer tensors"):
        output_pattern(["blk.0.attn_q.weight"])


@pytest.mark.parametrize("transport", [Transport.LOCAL, Transport.AUTO])
def test_transport_local_one_process_over_both_gpus(transport):
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 split=(1, 3), transport=transport),
                            FakeModel(), M, DEVICES, [50052])
    (head,) = plan.engines
    # peers first, head last, as over RPC: the profile's split puts the same layers on the
    # same cards under either transport (1 block on the 3060, 3 + output on the 5060 Ti)
    assert head.env_dict()["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert head.args[8:] == ("-ngl", "99", "-sm", "layer", "-ts", "1,4", "--fit", "off")
    assert "--rpc" not in head.args
    assert head.device == "rtx3060+rtx"
    assert plan.transport == "local"
    assert [(p.device, p.layers, p.what) for p in plan.placements] == [
        ("rtx3060", 1, "layers 0-0"), ("rtx", 3, "layers 1-3 + output")]
    (note,) = plan.notes
    if transport is Transport.AUTO:
        assert note.startswith("transport auto -> local: rtx (CUDA0), rtx3060 (CUDA1) are all "
                               "GPUs of this host, so one llama-server runs over them")
    else:
        assert note == "transport local (set in the profile)"
    rpc = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                split=(1, 3), transport=Transport.RPC),
                           FakeModel(), M, DEVICES, [50052])
    assert rpc.placements == plan.placements


def test_moe_solo_with_n_cpu_moe():
    plan = resolver.resolve(prof(head="rtx", n_cpu_moe=8),
                            FakeModel(expert_count=8, per_layer_experts=200 * MIB), M, DEVICES, [])
    assert plan.head.args[8:] == ("-ngl", "99", "-sm", "none", "--n-cpu-moe", "8", "--fit",
                                  "off")


def test_moe_combine_experts_on_peer():
    model = FakeModel(expert_count=8, per_layer_experts=200 * MIB)
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 transport=Transport.RPC, moe_split=MoeSplit.EXPERTS), model, M,
                            DEVICES, [50052])
    peer, head = plan.in_start_order()
    i = head.args.index("--rpc")
    assert head.args[i:] == (
        "--rpc", "127.0.0.1:50052", "-ngl", "99", "-ts", "0,1",
        "-ot", r"blk\.[0-9]+\.ffn_(?:down|gate|up)_exps\.weight=RPC0[127.0.0.1:50052]",
        "--fit", "off")
    assert plan.meta["moe_split"] == "experts"
    assert head.args.index("--rpc") < head.args.index("-ot")


def test_moe_combine_partial_when_peer_is_small():
    model = FakeModel(expert_count=8, per_layer_experts=4 * GIB)
    small = dict(DEVICES, rtx3060=replace(DEVICES["rtx3060"], free=10 * GIB))
    big_head = dict(small, rtx=replace(DEVICES["rtx"], free=100 * GIB, total=100 * GIB))
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 transport=Transport.RPC, moe_split=MoeSplit.EXPERTS), model, M,
                            big_head, [50052])
    ot = plan.head.args[plan.head.args.index("-ot") + 1]
    assert ot.startswith(r"blk\.(?:2|3)\.ffn_(?:down|gate|up)_exps\.weight=RPC0[")
    assert plan.placements[0].layers == 2


@pytest.mark.parametrize("kw,needle", [
    (dict(mode=Mode.COMBINE, head="rtx", peers=("rtx",)), "is the head's own device"),
    (dict(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",), split=(1, 2)),
     "adds up to 3 layers, but the model has 4"),
    (dict(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",), split=(1, 1, 2)),
     "split has 3 entries but this layout has 2 devices"),
    (dict(mode=Mode.COMBINE, head="rtx", peers=()), "needs at least one entry in peers"),
    (dict(head="rtx", peers=("rtx3060",)), "only used with mode: combine"),
    (dict(head="nosuch"), "unknown device 'nosuch'"),
    (dict(head="p100"), "is a remote peer"),
    (dict(head="rtx", server_args={"port": 1}), "use the profile key 'port'"),
    (dict(mode=Mode.COMBINE, head="cpu", peers=("cpu-peer",), transport=Transport.LOCAL),
     "local GPUs only"),
])
def test_bad_layouts_are_refused(kw, needle):
    with pytest.raises(HydraError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        resolver.resolve(prof(**kw), FakeModel(), M, DEVICES, [50052])


def test_too_big_gives_numbers_per_device():
    model = FakeModel(block_count=40, per_layer=800 * MIB)
    with pytest.raises(HydraError) as exc:
        resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",)), model, M,
                         DEVICES, [50052])
    msg = str(exc.value)
    assert "does not fit" in msg
    assert "rtx3060: needs" in msg and "rtx: needs" in msg and "MiB usable" in msg


def test_split_planned_from_free_memory():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",)),
                            FakeModel(block_count=26), M, DEVICES, [50052])
    # 11 GiB vs 15 GiB free → 11/26 and 15/26 of 26 layers.
    assert plan.head.args[-4:-2] == ("-ts", "11,16")


def test_expert_pattern_never_matches_nothing():
    names = FakeModel(expert_count=4).tensor_names()
    with pytest.raises(HydraError, match="no expert tensors"):
        resolver.expert_pattern([n for n in names if "exps" not in n])
    pat = resolver.expert_pattern(names, [0])
    assert pat == r"blk\.(?:0)\.ffn_(?:down|gate|up)_exps\.weight"


def test_demo_profile_golden(tmp_path: Path):
    """The shipped demo profile, through the real loader, gives this exact argv."""
    from hydra_supervisor.config.config import default_node, load_profile
    from hydra_supervisor.config.paths import repo_root

    p = load_profile(repo_root() / "profiles" / "demo.yaml", default_node())
    plan = resolver.resolve(p, FakeModel(), "/models/gemma.gguf", DEVICES, [])
    assert plan.head.args == ("-m", "/models/gemma.gguf", "--alias", "demo", "--host",
                              "127.0.0.1", "--port",
                              "8080", "-ngl", "0", "--ctx-size", "4096", "--parallel", "2",
                              "--chat-template", "gemma", "--no-jinja", "--n-predict", "64",
                              "--threads", "1", "--seed", "1")
    assert plan.head.env == (("GGML_NO_BACKTRACE", "1"), ("LLAMA_ARG_LOG_TIMESTAMPS", "1"),
                             ("LLAMA_ARG_LOG_PREFIX", "1"), ("CUDA_VISIBLE_DEVICES", ""))


def llama_cpp_devices(ts: list[float], n_layer: int, ngl: int) -> list[int]:
    """Blocks per device as llama.cpp assigns them (src/llama-model.cpp: cumulative -ts split
    points over the offloaded layers, output layer included; upper_bound of il/act)."""
    import bisect

    total = sum(ts)
    points = [sum(ts[:i + 1]) / total for i in range(len(ts))]
    start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    out = [0] * len(ts)
    for il in range(start, n_layer):
        out[bisect.bisect_right(points, (il - start) / act)] += 1
    return out


@pytest.mark.parametrize("n,split", [(4, (1, 3)), (64, (25, 39)), (65, (21, 44)), (18, (9, 9)),
                                     (40, (13, 13, 14))])
def test_ts_gives_llama_cpp_exactly_the_planned_blocks(n, split):
    peers = ("rtx3060", "p100")[:len(split) - 1]
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=peers, split=split),
                            FakeModel(block_count=n, per_layer=1 * MIB), M, DEVICES,
                            [50052])
    ts = [float(x) for x in plan.head.args[plan.head.args.index("-ts") + 1].split(",")]
    assert llama_cpp_devices(ts, n, 99) == [p.layers for p in plan.placements]


def test_solo_partial_offload_counts_only_what_the_gpu_holds():
    model = FakeModel(block_count=10, per_layer=2 * GIB, extra=2 * MIB)
    plan = resolver.resolve(prof(head="rtx", server_args={"n-gpu-layers": 6}), model, M,
                            DEVICES, [])
    gpu, host = plan.placements
    assert (gpu.device, gpu.layers, gpu.what) == ("rtx", 5, "layers 5-9 + output")
    assert gpu.weight_bytes == 5 * 2 * GIB + MIB
    assert host.layers == 5 and host.weight_bytes == 5 * 2 * GIB + MIB
    with pytest.raises(HydraError, match="does not fit"):
        resolver.resolve(prof(head="rtx"), model, M, DEVICES, [])


def test_solo_n_cpu_moe_keeps_those_experts_off_the_gpu():
    model = FakeModel(block_count=8, expert_count=8, per_layer=100 * MIB,
                      per_layer_experts=1 * GIB)
    full = resolver.resolve(prof(head="rtx"), model, M, DEVICES, []).placements[0]
    part = resolver.resolve(prof(head="rtx", n_cpu_moe=3), model, M, DEVICES, []).placements
    assert full.weight_bytes - part[0].weight_bytes == 3 * GIB
    assert part[1].device == "cpu (host RAM)" and "experts of layers 0-2" in part[1].what


# ---------------------------------------------------------------------------------------------
# transport auto and MoE over two local GPUs (one llama-server, no RPC)

MOE = FakeModel(expert_count=8, per_layer_experts=200 * MIB)


def test_moe_auto_is_a_local_layer_split():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 split=(1, 3)), MOE, M, DEVICES, [50052])
    (head,) = plan.engines
    assert (plan.transport, plan.meta["moe_split"], plan.meta["transport_requested"]) == (
        "local", "layers", "auto")
    assert head.env_dict()["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert head.args[8:] == ("-ngl", "99", "-sm", "layer", "-ts", "1,4", "--fit", "off")
    assert [(p.device, p.layers, p.weight_bytes) for p in plan.placements] == [
        ("rtx3060", 1, 300 * MIB), ("rtx", 3, 900 * MIB + 25 * MIB)]


def test_moe_local_experts_on_the_second_gpu():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 moe_split=MoeSplit.EXPERTS), MOE, M, DEVICES, [50052])
    (head,) = plan.engines
    assert plan.transport == "local" and plan.meta["moe_split"] == "experts"
    # the head's GPU is CUDA0 (every layer, -ts 1,0), the experts' GPU CUDA1
    assert head.env_dict()["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert head.device == "rtx+rtx3060"
    assert head.args[8:] == (
        "-ngl", "99", "-sm", "layer", "-ts", "1,0",
        "-ot", r"blk\.[0-9]+\.ffn_(?:down|gate|up)_exps\.weight=CUDA1", "--fit", "off")
    peer, main = plan.placements
    assert (peer.device, peer.weight_bytes, peer.what) == (
        "rtx3060", 4 * 200 * MIB, "experts of 4 layers (0-3)")
    # everything else but the input embedding (half of `extra` in the stand-in)
    assert (main.device, main.weight_bytes) == ("rtx", 4 * 100 * MIB + 25 * MIB)


def test_moe_local_experts_partial_then_host_ram():
    """Experts of the trailing layers that fit CUDA1; the head's GPU keeps some; the first
    layers' experts stay in host RAM (--n-cpu-moe N, the smallest N that fits)."""
    model = FakeModel(block_count=10, expert_count=8, per_layer=50 * MIB,
                      per_layer_experts=1 * GIB)
    small = dict(DEVICES, rtx=replace(DEVICES["rtx"], free=4 * GIB),
                 rtx3060=replace(DEVICES["rtx3060"], free=3 * GIB))
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 moe_split=MoeSplit.EXPERTS), model, M, small, [])
    args = plan.head.args
    ot = args[args.index("-ot") + 1]
    # 3 GiB * 0.95 less 768 MiB of buffers: two layers' experts on CUDA1
    assert ot == r"blk\.(?:8|9)\.ffn_(?:down|gate|up)_exps\.weight=CUDA1"
    n_cpu = int(args[args.index("--n-cpu-moe") + 1])
    peer, head, host = plan.placements
    assert host.device == "cpu (host RAM)" and host.weight_bytes == n_cpu * GIB
    assert head.weight_bytes == 10 * 50 * MIB + (8 - n_cpu) * GIB + 25 * MIB
    assert head.need_bytes <= head.free_bytes
    # one layer fewer on the CPU would not fit the head's GPU
    assert head.need_bytes + GIB > head.free_bytes
    assert any(f"--n-cpu-moe {n_cpu}" in n for n in plan.notes)


def test_moe_local_layers_keep_first_experts_in_host_ram_when_short():
    model = FakeModel(block_count=8, expert_count=8, per_layer=50 * MIB,
                      per_layer_experts=3 * GIB)
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 split=(4, 4)), model, M, DEVICES, [])
    args = plan.head.args
    assert args[8:14] == ("-ngl", "99", "-sm", "layer", "-ts", "4,5")
    n_cpu = int(args[args.index("--n-cpu-moe") + 1])
    assert n_cpu == 1  # 4 x 3 GiB + buffers > 11 GiB x 0.95 on the 3060: one layer's experts move
    assert plan.placements[-1].what == "experts of layers 0 (--n-cpu-moe 1)"
    assert all(p.need_bytes <= p.free_bytes for p in plan.placements)


def test_n_cpu_moe_given_is_kept_in_a_local_combine():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 n_cpu_moe=1), MOE, M, DEVICES, [])
    assert plan.head.args[-4:] == ("--n-cpu-moe", "1", "--fit", "off")
    assert not any("not all experts fit" in n for n in plan.notes)


@pytest.mark.parametrize("kw,model,needle", [
    (dict(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",), moe_split=MoeSplit.EXPERTS),
     FakeModel(), "moe_split is for mode: combine of an MoE model"),
    (dict(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",), transport=Transport.RPC,
          n_cpu_moe=2), MOE, "n_cpu_moe over transport rpc is not planned"),
    (dict(mode=Mode.COMBINE, head="rtx", peers=("p100",), transport=Transport.LOCAL), MOE,
     "not local GPUs: p100"),
    (dict(mode=Mode.COMBINE, head="rtx", peers=("rtx3060", "p100"),
          moe_split=MoeSplit.EXPERTS), MOE, "puts the experts on one peer; got 2 peers"),
])
def test_bad_moe_and_transport_choices(kw, model, needle):
    with pytest.raises(HydraError, match=needle):
        resolver.resolve(prof(**kw), model, M, DEVICES, [50052])


def test_fit_left_to_the_profile_when_it_says():
    plan = resolver.resolve(prof(head="rtx", server_args={"fit": "on"}), FakeModel(), M,
                            DEVICES, [])
    assert plan.head.args[8:] == ("-ngl", "99", "-sm", "none", "--fit", "on")


def test_moe_over_rpc_is_a_layer_split_unless_experts_asked():
    plan = resolver.resolve(prof(mode=Mode.COMBINE, head="rtx", peers=("rtx3060",),
                                 transport=Transport.RPC, split=(2, 2)), MOE, M, DEVICES,
                            [50052])
    assert plan.meta["moe_split"] == "layers"
    i = plan.head.args.index("--rpc")
    assert plan.head.args[i:] == ("--rpc", "127.0.0.1:50052", "-ngl", "99", "-sm", "layer",
                                  "-ts", "2,3", "--fit", "off")
