"""The rig profiles (profiles/dense27b-*.yaml, moe35b-*.yaml) planned by the real `hydra plan`.

No processes but the CLI itself and no GPUs: the models are shape-only GGUFs (real header, sparse
data) of the deployment's sizes, and the GPUs come from a fake inventory ($HYDRA_DEVICES_FILE)
with the rig's RTX 5060 Ti (CUDA0) and RTX 3060 (CUDA1). The node file is
docs/node.rig.example.yaml with its model paths pointed at the shape-only files.

Shapes: the 27B is llama-shaped (the real file is qwen35, a hybrid with DeltaNet/SSM layers and an
MTP head), with the FFN widened so that 64 blocks + a 248,320-token vocabulary give the real
file's ~19.5 GB, and 2 KV heads of 128 so KV bytes per token equal the real model's (16 attention
layers x 4 KV heads x 256). The 35B-A3B's layer and expert counts were not found; 40 layers x 256
experts (8 used), n_embd 2048, expert FFN 512 is plausible and gives the Mini's ~15 GB at Q3_K and
the Balanced's ~23 GB at Q5_K; 1 KV head of 128 on every layer matches a hybrid with 10 attention
layers x 2 KV heads x 256.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from bisect import bisect_right
from pathlib import Path
from typing import Any

import pytest
import yaml

from hydra_supervisor.config.config import load_node
from hydra_supervisor.plan import placement
from hydra_supervisor.plan.modelinfo import ModelInfo, inspect
from hydra_supervisor.tools import synth

REPO = Path(__file__).resolve().parent.parent
HYDRA = [sys.executable, "-m", "hydra_supervisor"]
EXAMPLE_NODE = REPO / "docs" / "node.rig.example.yaml"
MIB = 1 << 20
VOCAB = 248_320
DENSE_27B: dict[str, Any] = dict(
    kind="dense", n_layers=64, n_embd=5120, n_ff=22784, n_head=40, n_head_kv=2, ctx=262_144,
    weight_type="q5_k", vocab_size=VOCAB)
MOE_35B: dict[str, Any] = dict(
    kind="moe", n_layers=40, n_embd=2048, n_ff_exp=512, n_expert=256, n_expert_used=8,
    n_head=16, n_head_kv=1, ctx=262_144, vocab_size=VOCAB)
INVENTORY = """\
gpus:
  - {index: 0, name: "NVIDIA GeForce RTX 5060 Ti", total_mib: 16311, free_mib: 15800}
  - {index: 1, name: "NVIDIA GeForce RTX 3060", total_mib: 12288, free_mib: 11900}
cpu: {total_mib: 65536, free_mib: 60000, threads: 20}
"""
# What the resolver may plan on each GPU: free memory less its 5% safety margin.
USABLE_MIB = {"rtx": int(15800 * MIB * 0.95) / MIB, "rtx3060": int(11900 * MIB * 0.95) / MIB}
RIG_PROFILES = ("dense27b-solo", "dense27b-combine", "moe35b-solo", "moe35b-combine")


class Rig:
    """Shape-only models, node file, inventory and the environment for `hydra plan`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        models = root / "models"
        self.dense = synth.write_shape_only(models / "qwopus-27b-q5_k.gguf", **DENSE_27B)
        self.mini = synth.write_shape_only(models / "qwopus-35b-mini-q3_k.gguf",
                                           weight_type="q3_k", **MOE_35B)
        self.balanced = synth.write_shape_only(models / "qwopus-35b-balanced-q5_k.gguf",
                                               weight_type="q5_k", **MOE_35B)
        node = yaml.safe_load(EXAMPLE_NODE.read_text())
        node["models"] = {"qwen3.6-27B-coder": str(self.dense),
                          "qwen3.6-35B-mini": str(self.mini),
                          "qwen3.6-35B-balanced": str(self.balanced)}
        self.node = root / "node.yaml"
        self.node.write_text(yaml.safe_dump(node))
        inventory = root / "devices.yaml"
        inventory.write_text(INVENTORY)
        self.cache = root / "cache"
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith("HYDRA_") and k != "XDG_CONFIG_HOME"}
        self.env.update({
            "HYDRA_NODE": str(self.node),
            "HYDRA_DEVICES_FILE": str(inventory),
            "HYDRA_STATE_DIR": str(root / "state"),
            "HYDRA_CACHE_DIR": str(self.cache),
            # No ~/.config/hydra/profiles of this machine may shadow the repo's profiles.
            "XDG_CONFIG_HOME": str(root / "config"),
        })
        self._plans: dict[str, dict[str, Any]] = {}

    def hydra(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*HYDRA, *args], env=self.env, capture_output=True, text=True,
                              timeout=60, cwd=REPO, check=False)

    def variant(self, profile: str, extra: str) -> Path:
        """The repo's profile with `extra` YAML lines appended (same name, same model alias)."""
        path = self.root / "variants" / f"{profile}-{re.sub(r'[^a-z0-9]+', '-', extra)}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text((REPO / "profiles" / f"{profile}.yaml").read_text() + f"\n{extra}\n")
        return path

    def plan(self, profile: str, extra: str = "") -> dict[str, Any]:
        key = f"{profile}|{extra}"
        if key not in self._plans:
            ref = str(self.variant(profile, extra)) if extra else profile
            res = self.hydra("plan", "--profile", ref, "--json")
            assert res.returncode == 0, f"hydra plan {key}: rc {res.returncode}\n{res.stderr}"
            self._plans[key] = json.loads(res.stdout)
        return self._plans[key]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Rig:
    return Rig(tmp_path_factory.mktemp("rig"))


@pytest.fixture(scope="module")
def dense(rig: Rig) -> ModelInfo:
    return inspect(rig.dense, use_cache=False)


@pytest.fixture(scope="module")
def mini(rig: Rig) -> ModelInfo:
    return inspect(rig.mini, use_cache=False)


def engines(plan: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in plan["engines"]}


def value(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, f"{flag} appears {args.count(flag)} times in {args}"
    return args[args.index(flag) + 1]


def common_server_args(args: list[str], ctx: int) -> None:
    """The deployed llama-server settings every rig profile carries, as stock flags."""
    assert value(args, "--ctx-size") == str(ctx)
    assert value(args, "--parallel") == "1"
    assert value(args, "--ubatch-size") == "512"
    assert value(args, "--flash-attn") == "on"  # not a bare flag: the YAML quotes "on"
    assert value(args, "--fit") == "off"
    assert value(args, "--cache-type-k") == "q8_0"
    assert value(args, "--cache-type-v") == "q8_0"
    assert value(args, "--cache-reuse") == "64"
    for bare in ("--jinja", "--metrics"):
        i = args.index(bare)
        assert i == len(args) - 1 or args[i + 1].startswith("-")


def kv_mib(model: ModelInfo, ctx: int, layers: int) -> float:
    """The resolver's KV estimate for `layers` blocks at q8_0 K and V."""
    return model.kv_bytes_per_token(1.0625) * ctx // model.block_count * layers / MIB


# ---------------------------------------------------------------------------------------------
# The shape-only models and the files the operator copies


def test_shape_only_models_cost_no_disk_and_read_back(rig: Rig, dense: ModelInfo,
                                                      mini: ModelInfo) -> None:
    for path, info in ((rig.dense, dense), (rig.mini, mini)):
        st = path.stat()
        assert st.st_blocks * 512 < 4 * MIB  # a hole, not gigabytes of zeros
        assert info.file_size == st.st_size
        # header + padded data = the file: the tensor infos describe the whole data region
        assert st.st_size - info.tensor_bytes() < 1 * MIB
    assert (dense.arch, dense.block_count, dense.expert_count) == ("llama", 64, 0)
    assert 19.0e9 < dense.file_size < 20.0e9  # the real file: 18.18 GiB, 19.5 GB
    types = {t.name: t.ggml_type for t in dense.tensors}
    assert types["blk.0.attn_q.weight"] == "Q5_K"
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert dict((t.name, t.shape) for t in dense.tensors)["token_embd.weight"] == (5120, VOCAB)

    assert (mini.block_count, mini.expert_count, mini.expert_used_count) == (40, 256, 8)
    assert 14.0e9 < mini.file_size < 16.0e9  # the Mini: Q3_K, ~15 GB
    experts = [t for t in mini.tensors if t.is_expert]
    assert len(experts) == 40 * 3
    assert {t.ggml_type for t in experts} == {"Q3_K"}
    gate = next(t for t in experts if t.name == "blk.0.ffn_gate_exps.weight")
    assert gate.shape == (2048, 512, 256)
    assert gate.n_bytes == 2048 * 512 * 256 // 256 * 110  # Q3_K: 110 bytes per 256 weights
    assert 22.0e9 < inspect(rig.balanced, use_cache=False).file_size < 25.0e9


def test_example_node_file_parses() -> None:
    node = load_node(EXAMPLE_NODE)
    assert node.devices["rtx"].cuda == 0
    assert node.devices["rtx3060"].cuda == 1
    p100 = node.devices["p100"]
    assert (p100.endpoint, p100.memory_mib) == ("192.168.122.21:30052", 16384)
    assert set(node.models) >= {"qwen3.6-27B-coder", "qwen3.6-35B-mini"}
    assert all(path.startswith("/models/") for path in node.models.values())


def test_rig_profiles_are_listed_and_commented(rig: Rig) -> None:
    res = rig.hydra("profiles")
    assert res.returncode == 0, res.stderr
    for name in RIG_PROFILES:
        assert name in res.stdout
        text = (REPO / "profiles" / f"{name}.yaml").read_text()
        assert text.startswith("# "), f"{name}.yaml must open with a comment saying what it is for"
    assert not (REPO / "profiles" / "node.rig.example.yaml").exists()  # not a profile


def test_plans_use_the_modelinfo_cache_under_the_cache_dir(rig: Rig) -> None:
    rig.plan("dense27b-combine")
    rig.plan("moe35b-combine")
    entries = list((rig.cache / "modelinfo").glob("*.json"))
    assert len(entries) >= 2
    cached = {json.loads(e.read_text())["info"]["path"] for e in entries}
    assert {str(rig.dense.resolve()), str(rig.mini.resolve())} <= cached


# ---------------------------------------------------------------------------------------------
# dense27b-combine: layer split, peer first; transport auto -> local (one llama-server)


def test_dense_combine_is_one_llama_server_over_both_gpus(rig: Rig, dense: ModelInfo) -> None:
    plan = rig.plan("dense27b-combine")
    assert (plan["model_kind"], plan["mode"], plan["transport"]) == ("dense", "combine", "local")
    (head,) = plan["engines"]
    args = head["args"]
    assert head["program"] == "llama-server"
    # the 3060 first, as over RPC: the split [25, 40] puts the same blocks on the same cards
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert head["env"]["GGML_NO_BACKTRACE"] == "1"
    assert head["device"] == "rtx3060+rtx"
    assert value(args, "-m") == str(rig.dense)
    assert "--rpc" not in args and "-ot" not in args
    assert value(args, "-sm") == "layer"
    assert value(args, "-ngl") == "99"
    ts = [int(x) for x in value(args, "-ts").split(",")]
    assert ts == [25, 40]  # llama.cpp spreads -ts over 64 blocks + the output layer
    assert sum(ts) == dense.block_count + 1
    common_server_args(args, 60000)
    assert (value(args, "--rope-scaling"), value(args, "--rope-scale"),
            value(args, "--yarn-orig-ctx")) == ("yarn", "4", "32768")


def test_dense_combine_rpc_argv_env_and_start_order(rig: Rig) -> None:
    plan = rig.plan("dense27b-combine", "transport: rpc")
    assert (plan["model_kind"], plan["mode"], plan["transport"]) == ("dense", "combine", "rpc")
    eng = engines(plan)
    peer, head = eng["peer-rtx3060"], eng["head"]
    assert (peer["start_order"], head["start_order"]) == (0, 1)
    assert peer["program"] == "ggml-rpc-server"
    assert peer["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert peer["args"] == ["-H", "127.0.0.1", "-p", str(peer["port"]), "-c"]
    assert peer["endpoint"] == "127.0.0.1:30052"  # first port of the node's rpc_ports
    args = head["args"]
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert value(args, "--rpc") == peer["endpoint"]
    assert args.index("--rpc") < args.index("-ts")
    assert (value(args, "-sm"), value(args, "-ngl"), value(args, "-ts")) == ("layer", "99",
                                                                           "25,40")
    common_server_args(args, 60000)


@pytest.mark.parametrize("transport", ["", "transport: rpc"])
def test_dense_combine_placements_bytes(rig: Rig, dense: ModelInfo, transport: str) -> None:
    plan = rig.plan("dense27b-combine", transport)
    layer_bytes = dense.layer_bytes()
    peer, head = plan["placements"]
    assert (peer["device"], peer["layers"], head["device"], head["layers"]) == (
        "rtx3060", 25, "rtx", 39)
    assert peer["weight_bytes"] == sum(layer_bytes[:25])
    # the head holds the later blocks plus the output layer; token_embd stays on the CPU
    assert head["weight_bytes"] == sum(layer_bytes[25:]) + dense.output_bytes()
    assert dense.output_bytes() < dense.non_layer_bytes()
    assert peer["kv_bytes"] / MIB == pytest.approx(kv_mib(dense, 60000, 25), abs=1)
    assert head["kv_bytes"] / MIB == pytest.approx(kv_mib(dense, 60000, 39), abs=1)
    # buffers: CUDA context + compute (ubatch 512): the head's holds 512 x 248,320 logits, the
    # peer's the pipeline copies of a split's first device (placement.gpu_overhead)
    act = 512 * 4 * (5120 + 22784)
    assert head["overhead_bytes"] == placement.CUDA_CONTEXT + 3 * act + 512 * 4 * VOCAB
    assert peer["overhead_bytes"] == placement.CUDA_CONTEXT + 10 * act
    for p in (peer, head):
        need = p["weight_bytes"] + p["kv_bytes"] + p["overhead_bytes"]
        assert need <= p["free_bytes"]
        assert p["free_bytes"] / MIB == pytest.approx(USABLE_MIB[p["device"]], abs=1)


def test_dense_combine_notes_say_which_transport_and_why(rig: Rig) -> None:
    (note,) = rig.plan("dense27b-combine")["notes"]
    assert note.startswith("transport auto -> local: rtx (CUDA0), rtx3060 (CUDA1) are all GPUs "
                           "of this host, so one llama-server runs over them, no ggml-RPC")
    (note,) = rig.plan("dense27b-combine", "transport: rpc")["notes"]
    assert note.startswith("transport rpc (set in the profile); all devices are local GPUs")
    assert "0.78-0.87" in note


def test_dense_combine_text_form_is_readable(rig: Rig) -> None:
    res = rig.hydra("plan", "--profile", "dense27b-combine")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "profile dense27b-combine" in out
    assert "mode combine (dense), transport local" in out
    assert "64 layers" in out and "MiB" in out
    assert re.search(r"rtx3060: layers 0-24, weights [\d,]+ MiB .* = [\d,]+ MiB "
                     r"\(11,305 MiB usable\)", out), out
    assert re.search(r"rtx: layers 25-63 \+ output, .* \(15,010 MiB usable\)", out), out
    assert "0. head (head, on rtx3060+rtx) listens 127.0.0.1:30200" in out
    assert "router listens 127.0.0.1:8080: HTTP -> 127.0.0.1:30200" in out
    assert "CUDA_VISIBLE_DEVICES=1,0 llama-server -m " in out
    assert "-ngl 99 -sm layer -ts 25,40" in out
    assert "note: transport auto -> local" in out
    assert all(len(line) < 400 for line in out.splitlines() if "llama-server" not in line)


def llama_cpp_blocks_per_device(ts: list[float], n_layer: int, ngl: int) -> list[int]:
    """Blocks per device as llama.cpp's llama_model::load_tensors assigns them (CPU ignored).

    Mirrors src/llama-model.cpp: the split points are the normalized prefix sums of -ts, and
    block il goes to upper_bound(splits, il / act_gpu_layers) with act_gpu_layers =
    min(ngl, n_layer + 1): the output layer is one of the layers the proportions are spread over.
    """
    total = sum(ts)
    splits, acc = [], 0.0
    for x in ts:
        acc += x
        splits.append(acc / total)
    i_gpu_start = max(n_layer + 1 - ngl, 0)
    act = min(ngl, n_layer + 1)
    counts = [0] * len(ts)
    for il in range(i_gpu_start, n_layer):
        counts[bisect_right(splits, (il - i_gpu_start) / act)] += 1
    return counts


@pytest.mark.parametrize("profile", ["dense27b-combine", "moe35b-combine"])
def test_combine_ts_gives_llama_cpp_the_planned_blocks(rig: Rig, dense: ModelInfo,
                                                      mini: ModelInfo, profile: str) -> None:
    plan = rig.plan(profile)
    args = engines(plan)["head"]["args"]
    ts = [float(x) for x in value(args, "-ts").split(",")]
    planned = [p["layers"] for p in plan["placements"]]
    model = dense if profile.startswith("dense") else mini
    assert llama_cpp_blocks_per_device(ts, model.block_count, 99) == planned


# ---------------------------------------------------------------------------------------------
# moe35b-combine: auto -> one llama-server, whole layers per GPU; experts forms on request


def test_moe_combine_is_a_local_layer_split(rig: Rig, mini: ModelInfo) -> None:
    plan = rig.plan("moe35b-combine")
    assert (plan["model_kind"], plan["mode"], plan["transport"]) == ("moe", "combine", "local")
    assert plan["meta"]["moe_split"] == "layers"
    (head,) = plan["engines"]
    args = head["args"]
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "1,0"
    assert "--rpc" not in args and "-ot" not in args and "--n-cpu-moe" not in args
    # by usable memory: 11,305 vs 15,010 MiB -> 17 of 40 blocks on the 3060
    assert (value(args, "-ngl"), value(args, "-sm"), value(args, "-ts")) == ("99", "layer",
                                                                           "17,24")
    common_server_args(args, 131072)
    peer, main = plan["placements"]
    assert (peer["device"], peer["layers"], main["device"], main["layers"]) == (
        "rtx3060", 17, "rtx", 23)
    assert peer["weight_bytes"] == sum(mini.layer_bytes()[:17])
    for p in (peer, main):
        assert p["weight_bytes"] + p["kv_bytes"] + p["overhead_bytes"] <= p["free_bytes"]


@pytest.mark.parametrize("extra,buft", [
    ("moe_split: experts", "CUDA1"),
    ("transport: rpc\nmoe_split: experts", "RPC0[127.0.0.1:30052]"),  # bare RPC0: unknown
])
def test_moe_combine_experts_ot_matches_exactly_the_planned_expert_tensors(
        rig: Rig, mini: ModelInfo, extra: str, buft: str) -> None:
    plan = rig.plan("moe35b-combine", extra)
    assert plan["meta"]["moe_split"] == "experts"
    eng = engines(plan)
    head = eng["head"]
    args = head["args"]
    assert value(args, "-ngl") == "99"
    if buft == "CUDA1":
        assert plan["transport"] == "local" and len(eng) == 1
        assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"  # the head's GPU is CUDA0
        # -ts 1,0: every layer on CUDA0; only the -ot expert tensors go to CUDA1
        assert (value(args, "-sm"), value(args, "-ts")) == ("layer", "1,0")
    else:
        peer = eng["peer-rtx3060"]
        assert plan["transport"] == "rpc"
        assert (peer["start_order"], head["start_order"]) == (0, 1)
        assert peer["env"]["CUDA_VISIBLE_DEVICES"] == "1"
        assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0"
        assert value(args, "--rpc") == peer["endpoint"]
        assert args.index("--rpc") < args.index("-ot")
        # -ts 0,1: no whole layer on the RPC device (the RPC device comes first)
        assert value(args, "-ts") == "0,1"
    assert "--n-cpu-moe" not in args
    common_server_args(args, 131072)

    pattern, _, got_buft = value(args, "-ot").rpartition("=")
    assert got_buft == buft
    peer_pl, head_pl = plan["placements"]
    assert (peer_pl["device"], head_pl["device"]) == ("rtx3060", "rtx")
    n_peer = peer_pl["layers"]
    assert 0 < n_peer < mini.block_count
    peer_layers = set(range(mini.block_count - n_peer, mini.block_count))  # the trailing ones
    want = {t.name for t in mini.tensors if t.is_expert and t.layer in peer_layers}
    got = {t.name for t in mini.tensors if re.search(pattern, t.name)}
    assert got == want
    assert len(want) == 3 * n_peer

    # bytes: the experts of those layers on the 3060, as many as fit and not one more
    expert_bytes = mini.expert_bytes_per_layer()
    assert peer_pl["what"] == f"experts of {n_peer} layers ({40 - n_peer}-39)"
    assert peer_pl["weight_bytes"] == sum(expert_bytes[-n_peer:])
    assert peer_pl["kv_bytes"] == 0
    embd = mini.non_layer_bytes() - mini.output_bytes()  # token_embd stays in host RAM
    assert head_pl["weight_bytes"] == mini.tensor_bytes() - peer_pl["weight_bytes"] - embd
    assert head_pl["kv_bytes"] / MIB == pytest.approx(kv_mib(mini, 131072, 40), abs=1)
    one_more = peer_pl["weight_bytes"] + expert_bytes[-n_peer - 1] + peer_pl["overhead_bytes"]
    assert peer_pl["weight_bytes"] + peer_pl["overhead_bytes"] <= peer_pl["free_bytes"] < one_more
    assert (head_pl["weight_bytes"] + head_pl["kv_bytes"] + head_pl["overhead_bytes"]
            <= head_pl["free_bytes"])


def test_moe_combine_text_form(rig: Rig) -> None:
    res = rig.hydra("plan", "--profile", "moe35b-combine")
    assert res.returncode == 0, res.stderr
    assert "256 experts (8 used)" in res.stdout
    assert "mode combine (moe), transport local" in res.stdout
    assert re.search(r"rtx3060: layers 0-16, weights [\d,]+ MiB", res.stdout), res.stdout
    assert "CUDA_VISIBLE_DEVICES=1,0 llama-server" in res.stdout
    res = rig.hydra("plan", "--profile",
                    str(rig.variant("moe35b-combine", "transport: rpc\nmoe_split: experts")))
    assert res.returncode == 0, res.stderr
    assert re.search(r"rtx3060: experts of \d+ layers \(\d+-39\), weights [\d,]+ MiB",
                     res.stdout)
    assert "=RPC0[127.0.0.1:30052]'" in res.stdout  # shell-quoted, copy-pastable


# ---------------------------------------------------------------------------------------------
# The original rig emulated: a 16 GB and a 12 GB card (the device file above)


@pytest.mark.parametrize("profile,extra", [
    ("dense27b-combine", ""), ("dense27b-combine", "transport: rpc"),
    ("moe35b-combine", ""), ("moe35b-combine", "moe_split: experts"),
    ("moe35b-combine", "transport: rpc\nmoe_split: experts"),
])
def test_rig_combine_plans_fit_the_16gb_and_12gb_cards(rig: Rig, profile: str,
                                                       extra: str) -> None:
    """Every GPU's planned bytes (weights + KV + CUDA context and compute buffers, which
    tests/test_plan_vs_nvml.py checks to be at or above NVML's per-process memory on H200s)
    within the card's free memory less 5%: the plan fits the rig's cards by measured usage."""
    plan = rig.plan(profile, extra)
    gpus = [p for p in plan["placements"] if p["device"] in USABLE_MIB]
    assert {p["device"] for p in gpus} == {"rtx", "rtx3060"}
    for p in gpus:
        need = p["weight_bytes"] + p["kv_bytes"] + p["overhead_bytes"]
        assert need <= USABLE_MIB[p["device"]] * MIB, (p["device"], need / MIB)
        assert p["overhead_bytes"] >= placement.CUDA_CONTEXT


# ---------------------------------------------------------------------------------------------
# SOLO profiles: partial offload the resolver does not credit yet


def test_moe_solo_n_cpu_moe(rig: Rig, mini: ModelInfo) -> None:
    plan = rig.plan("moe35b-solo")
    (head,) = plan["engines"]
    args = head["args"]
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert value(args, "--n-cpu-moe") == "8"
    assert "--rpc" not in args and "-ot" not in args
    common_server_args(args, 65536)
    gpu, host = plan["placements"]
    cpu_experts = sum(mini.expert_bytes_per_layer()[:8])
    assert gpu["weight_bytes"] == sum(mini.layer_bytes()) - cpu_experts + mini.output_bytes()
    assert host["device"] == "cpu (host RAM)" and "experts of layers 0-7" in host["what"]
    assert gpu["weight_bytes"] + gpu["kv_bytes"] + gpu["overhead_bytes"] <= gpu["free_bytes"]


def test_dense_solo_partial_offload(rig: Rig, dense: ModelInfo) -> None:
    plan = rig.plan("dense27b-solo")
    (head,) = plan["engines"]
    args = head["args"]
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert value(args, "--n-gpu-layers") == "40"
    assert "-ngl" not in args
    assert value(args, "-sm") == "none"
    common_server_args(args, 32768)
    gpu, host = plan["placements"]
    # -ngl 40: the output layer and the last 39 blocks on the GPU, blocks 0-24 on the CPU
    assert (gpu["layers"], gpu["what"]) == (39, "layers 25-63 + output")
    assert (host["layers"], host["what"]) == (25, "layers 0-24")
    assert gpu["weight_bytes"] == sum(dense.layer_bytes()[25:]) + dense.output_bytes()


# ---------------------------------------------------------------------------------------------
# Refusal: a model too big for the device, with the numbers


def test_too_big_is_refused_with_per_device_numbers(rig: Rig, tmp_path: Path) -> None:
    profile = tmp_path / "balanced-on-3060.yaml"
    profile.write_text(
        "# The MoE Balanced (Q5_K, ~23 GB) SOLO on the 12 GB 3060 without n_cpu_moe: no fit.\n"
        "model: qwen3.6-35B-balanced\nmode: solo\nhead: rtx3060\n"
        "server_args: {ctx-size: 32768, cache-type-k: q8_0, cache-type-v: q8_0}\n")
    res = rig.hydra("plan", "--profile", str(profile))
    assert res.returncode == 2, res.stdout
    err = res.stderr
    assert "model does not fit the devices of profile 'balanced-on-3060'" in err
    m = re.search(r"rtx3060: needs ([\d,]+) MiB \(layers 0-39 \+ output: weights ([\d,]+) "
                  r"\+ KV ([\d,]+) \+ buffers ([\d,]+)\), has 11,305 MiB usable", err)
    assert m, err
    need, weights, kv, buffers = (int(x.replace(",", "")) for x in m.groups())
    assert weights > 20_000 and kv == 340 and abs(need - (weights + kv + buffers)) <= 1
    assert "fix:" in err
    assert "Traceback" not in err
