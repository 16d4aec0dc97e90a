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

from hydra_supervisor import synth
from hydra_supervisor.config import load_node
from hydra_supervisor.modelinfo import ModelInfo, inspect

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

    def plan(self, profile: str) -> dict[str, Any]:
        if profile not in self._plans:
            res = self.hydra("plan", "--profile", profile, "--json")
            assert res.returncode == 0, f"hydra plan {profile}: rc {res.returncode}\n{res.stderr}"
            self._plans[profile] = json.loads(res.stdout)
        return self._plans[profile]


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
# dense27b-combine: layer split over RPC, peer first


def test_dense_combine_argv_env_and_start_order(rig: Rig, dense: ModelInfo) -> None:
    plan = rig.plan("dense27b-combine")
    assert (plan["model_kind"], plan["mode"], plan["transport"]) == ("dense", "combine", "rpc")
    eng = engines(plan)
    peer, head = eng["peer-rtx3060"], eng["head"]
    assert (peer["start_order"], head["start_order"]) == (0, 1)

    assert peer["program"] == "ggml-rpc-server"
    assert peer["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert peer["args"] == ["-H", "127.0.0.1", "-p", str(peer["port"]), "-c"]
    assert peer["endpoint"] == "127.0.0.1:30052"  # first port of the node's rpc_ports

    args = head["args"]
    assert head["program"] == "llama-server"
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert head["env"]["GGML_NO_BACKTRACE"] == "1"
    assert value(args, "-m") == str(rig.dense)
    assert value(args, "--rpc") == peer["endpoint"]
    assert args.index("--rpc") < args.index("-ts")
    assert value(args, "-sm") == "layer"
    assert value(args, "-ngl") == "99"
    ts = [int(x) for x in value(args, "-ts").split(",")]
    assert ts == [25, 40]  # llama.cpp spreads -ts over 64 blocks + the output layer
    assert sum(ts) == dense.block_count + 1
    common_server_args(args, 60000)
    assert (value(args, "--rope-scaling"), value(args, "--rope-scale"),
            value(args, "--yarn-orig-ctx")) == ("yarn", "4", "32768")


def test_dense_combine_placements_bytes(rig: Rig, dense: ModelInfo) -> None:
    plan = rig.plan("dense27b-combine")
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
    for p in (peer, head):
        need = p["weight_bytes"] + p["kv_bytes"] + p["overhead_bytes"]
        assert need <= p["free_bytes"]
        assert p["free_bytes"] / MIB == pytest.approx(USABLE_MIB[p["device"]], abs=1)


def test_dense_combine_notes_transport_local(rig: Rig) -> None:
    notes = rig.plan("dense27b-combine")["notes"]
    assert any("transport: local" in n and "0.78-0.86" in n for n in notes), notes


def test_dense_combine_text_form_is_readable(rig: Rig) -> None:
    res = rig.hydra("plan", "--profile", "dense27b-combine")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "profile dense27b-combine" in out
    assert "64 layers" in out and "MiB" in out
    assert re.search(r"rtx3060: layers 0-24, weights [\d,]+ MiB .* = [\d,]+ MiB "
                     r"\(11,305 MiB usable\)", out), out
    assert re.search(r"rtx: layers 25-63 \+ output, .* \(15,010 MiB usable\)", out), out
    peer_line = out.index("0. peer-rtx3060 (peer, on rtx3060) listens 127.0.0.1:30052")
    head_line = out.index("1. head (head, on rtx) listens 127.0.0.1:30200")
    assert peer_line < head_line
    assert "router listens 127.0.0.1:8080: HTTP -> 127.0.0.1:30200" in out
    assert "CUDA_VISIBLE_DEVICES=1 ggml-rpc-server -H 127.0.0.1 -p 30052 -c" in out
    assert "CUDA_VISIBLE_DEVICES=0 llama-server -m " in out
    assert "--rpc 127.0.0.1:30052 -ngl 99 -sm layer -ts 25,40" in out
    assert "note: all devices are local GPUs: transport: local" in out
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


def test_dense_combine_ts_gives_llama_cpp_the_planned_blocks(rig: Rig, dense: ModelInfo) -> None:
    plan = rig.plan("dense27b-combine")
    args = engines(plan)["head"]["args"]
    ts = [float(x) for x in value(args, "-ts").split(",")]
    planned = [p["layers"] for p in plan["placements"]]
    assert llama_cpp_blocks_per_device(ts, dense.block_count, 99) == planned


# ---------------------------------------------------------------------------------------------
# moe35b-combine: the experts of the trailing layers on the 3060


def test_moe_combine_ot_matches_exactly_the_planned_expert_tensors(rig: Rig,
                                                                   mini: ModelInfo) -> None:
    plan = rig.plan("moe35b-combine")
    assert (plan["model_kind"], plan["mode"], plan["transport"]) == ("moe", "combine", "rpc")
    eng = engines(plan)
    peer, head = eng["peer-rtx3060"], eng["head"]
    assert (peer["start_order"], head["start_order"]) == (0, 1)
    assert peer["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert head["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert peer["args"] == ["-H", "127.0.0.1", "-p", "30052", "-c"]

    args = head["args"]
    assert value(args, "--rpc") == "127.0.0.1:30052"
    assert args.index("--rpc") < args.index("-ot")
    assert value(args, "-ngl") == "99"
    # -ts 0,1: no whole layer on the RPC device, only the -ot expert tensors (seen on 2 H200s:
    # without it llama.cpp spread layers over both devices by free memory)
    assert value(args, "-ts") == "0,1" and "--n-cpu-moe" not in args
    common_server_args(args, 131072)

    pattern, _, buft = value(args, "-ot").rpartition("=")
    assert buft == f"RPC0[{peer['endpoint']}]"  # bare RPC0 is "unknown buffer type"
    peer_pl, head_pl = plan["placements"]
    assert (peer_pl["device"], head_pl["device"]) == ("rtx3060", "rtx")
    n_peer = peer_pl["layers"]
    assert 0 < n_peer < mini.block_count
    peer_layers = set(range(mini.block_count - n_peer, mini.block_count))  # the trailing ones
    want = {t.name for t in mini.tensors if t.is_expert and t.layer in peer_layers}
    got = {t.name for t in mini.tensors if re.search(pattern, t.name)}
    assert got == want
    assert len(want) == 3 * n_peer


def test_moe_combine_placements_bytes(rig: Rig, mini: ModelInfo) -> None:
    plan = rig.plan("moe35b-combine")
    peer, head = plan["placements"]
    expert_bytes = mini.expert_bytes_per_layer()
    n_peer = peer["layers"]
    assert peer["what"] == f"experts of {n_peer} layers ({40 - n_peer}-39)"
    assert peer["weight_bytes"] == sum(expert_bytes[-n_peer:])
    assert peer["kv_bytes"] == 0
    assert head["weight_bytes"] == mini.tensor_bytes() - peer["weight_bytes"]
    assert head["kv_bytes"] / MIB == pytest.approx(kv_mib(mini, 131072, 40), abs=1)
    # As many trailing layers' experts as fit the 3060, and not one more.
    one_more = peer["weight_bytes"] + expert_bytes[-n_peer - 1] + peer["overhead_bytes"]
    assert peer["weight_bytes"] + peer["overhead_bytes"] <= peer["free_bytes"] < one_more
    assert head["weight_bytes"] + head["kv_bytes"] + head["overhead_bytes"] <= head["free_bytes"]


def test_moe_combine_text_form(rig: Rig) -> None:
    res = rig.hydra("plan", "--profile", "moe35b-combine")
    assert res.returncode == 0, res.stderr
    assert "256 experts (8 used)" in res.stdout
    assert re.search(r"rtx3060: experts of \d+ layers \(\d+-39\), weights [\d,]+ MiB",
                     res.stdout)
    assert "=RPC0[127.0.0.1:30052]'" in res.stdout  # shell-quoted, copy-pastable


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
                  r"\+ KV ([\d,]+) \+ buffers 768\), has 11,305 MiB usable", err)
    assert m, err
    need, weights, kv = (int(x.replace(",", "")) for x in m.groups())
    assert weights > 20_000 and kv == 340 and need == weights + kv + 768
    assert "fix:" in err
    assert "Traceback" not in err
