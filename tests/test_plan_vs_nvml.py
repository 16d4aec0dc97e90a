"""hydra's planned bytes per GPU against what the GPUs really held (NVML, per process).

The numbers below are `bench/gpu_layouts.py` on two H200s (docs/measurements.md): NVML's used
memory of every process on each GPU while serving, after the decode and prefill runs, and the
model buffer sizes llama.cpp logged. Here the same layouts are planned again from shape-only
copies of the bench's synthetic models (same header, no data), and the plan must stay on the safe
side: never below what the GPU held, and at most MARGIN above it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from hydra_supervisor.config.profile import Mode, MoeSplit, Profile, Transport
from hydra_supervisor.plan import placement, resolver
from hydra_supervisor.plan.devices import MIB, Device, Kind
from hydra_supervisor.plan.modelinfo import ModelInfo, inspect
from hydra_supervisor.tools import synth

MARGIN = 0.08  # planned may exceed NVML by up to 8% per GPU (seen: 0.4-6.5%)
H200_FREE = 143_000 * MIB
DEVICES = {
    "gpu0": Device("gpu0", Kind.CUDA, H200_FREE, H200_FREE, cuda_index=0, model="H200"),
    "gpu1": Device("gpu1", Kind.CUDA, H200_FREE, H200_FREE, cuda_index=1, model="H200"),
    # the capped layout: gpu0 and gpu1 declared small (memory_mib) so that only some experts
    # fit gpu1 and the first layers' stay in host RAM
    "small0": Device("small0", Kind.CUDA, 3200 * MIB, 3200 * MIB, cuda_index=0),
    "small1": Device("small1", Kind.CUDA, 2400 * MIB, 2400 * MIB, cuda_index=1),
    "cpu": Device("cpu", Kind.CPU, 256_000 * MIB, 250_000 * MIB, threads=32),
}
CUDA = {name: d.cuda_index for name, d in DEVICES.items() if d.kind is Kind.CUDA}

# layout: (model, profile fields, {GPU: NVML MiB (max of two runs)}, {GPU: llama.cpp model MiB})
MEASURED = {
    "dense solo": ("dense", dict(head="gpu0"), {0: 8438}, {0: 7206}),
    "dense rpc": ("dense", dict(transport=Transport.RPC), {0: 4682, 1: 4622},
                  {0: 3669, 1: 3536}),
    "dense local": ("dense", dict(transport=Transport.LOCAL), {0: 4682, 1: 4622},
                    {0: 3669, 1: 3536}),
    "dense auto": ("dense", dict(), {0: 4682, 1: 4622}, {0: 3669, 1: 3536}),
    "moe solo": ("moe", dict(head="gpu0"), {0: 7650}, {0: 6773}),
    "moe rpc experts": ("moe", dict(transport=Transport.RPC, moe_split=MoeSplit.EXPERTS),
                        {0: 1094, 1: 7152}, {0: 245, 1: 6528}),
    "moe rpc layers": ("moe", dict(transport=Transport.RPC, moe_split=MoeSplit.LAYERS),
                       {0: 4256, 1: 4218}, {0: 3420, 1: 3353}),
    "moe local experts": ("moe", dict(moe_split=MoeSplit.EXPERTS), {0: 1096, 1: 7162},
                          {0: 245, 1: 6528}),
    "moe local layers": ("moe", dict(moe_split=MoeSplit.LAYERS), {0: 4256, 1: 4226},
                         {0: 3420, 1: 3353}),
    "moe auto": ("moe", dict(), {0: 4256, 1: 4226}, {0: 3420, 1: 3353}),
    "moe local experts capped": ("moe", dict(head="small0", peers=("small1",),
                                             moe_split=MoeSplit.EXPERTS),
                                 {0: 2882, 1: 1856}, {0: 1877, 1: 1224}),
}
SPLIT = {"dense": (0.5, 0.5), "moe": (0.5, 0.5)}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelInfo]:
    root = tmp_path_factory.mktemp("bench-models")
    dense = synth.write_shape_only(root / "dense.gguf", kind="dense", n_layers=32, n_embd=4096,
                                   n_ff=14336, n_head=32, n_head_kv=8, weight_type="q8_0")
    moe = synth.write_shape_only(root / "moe.gguf", kind="moe", n_layers=16, n_embd=2048,
                                 n_ff_exp=1024, n_expert=64, n_expert_used=4, n_head=16,
                                 n_head_kv=4, weight_type="q8_0")
    return {"dense": inspect(dense, use_cache=False), "moe": inspect(moe, use_cache=False)}


def plan_for(layout: str, models: dict[str, ModelInfo]) -> resolver.Plan:
    kind, fields, _, _ = MEASURED[layout]
    combine = "solo" not in layout
    prof = Profile(name=layout, source=f"{layout}.yaml", model="x", port=8080,
                   server_args={"ctx-size": 4096, "parallel": 1, "flash-attn": "on"})
    base: dict[str, object] = dict(mode=Mode.COMBINE, head="gpu0", peers=("gpu1",))
    if combine and (kind == "dense" or fields.get("moe_split") is not MoeSplit.EXPERTS):
        base["split"] = SPLIT[kind]
    if not combine:
        base = dict(mode=Mode.SOLO)
    prof = replace(prof, **{**base, **fields})
    return resolver.resolve(prof, models[kind], "/m.gguf", DEVICES, [30152])


def per_gpu(plan: resolver.Plan, what: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in plan.placements:
        if p.device in CUDA:
            out[CUDA[p.device]] = out.get(CUDA[p.device], 0) + (
                p.need_bytes if what == "need" else p.weight_bytes)
    return out


@pytest.mark.parametrize("layout", list(MEASURED))
def test_plan_is_above_nvml_within_the_margin(layout: str,
                                              models: dict[str, ModelInfo]) -> None:
    plan = plan_for(layout, models)
    _, _, nvml, weights = MEASURED[layout]
    need, planned_weights = per_gpu(plan, "need"), per_gpu(plan, "weights")
    assert set(need) == set(nvml)
    for gpu, used in nvml.items():
        # the weights are llama.cpp's own model buffers to the MiB
        assert planned_weights[gpu] / MIB == pytest.approx(weights[gpu], abs=1.5)
        assert used * MIB <= need[gpu] <= used * MIB * (1 + MARGIN), (
            f"{layout} gpu{gpu}: planned {need[gpu] / MIB:,.0f} MiB, NVML {used:,} MiB")


def test_capped_layout_is_the_measured_one(models: dict[str, ModelInfo]) -> None:
    args = plan_for("moe local experts capped", models).head.args
    assert args[args.index("-ot") + 1] == (
        r"blk\.(?:13|14|15)\.ffn_(?:down|gate|up)_exps\.weight=CUDA1")
    assert args[args.index("--n-cpu-moe") + 1] == "9"


def test_the_old_flat_estimate_fell_short_on_the_split_peer(models: dict[str, ModelInfo]) -> None:
    """Before: 768 MiB of buffers for every GPU; the first GPU of a split held more (NVML
    4,622 MiB vs 4,548 planned for the dense split, 4,226 vs 4,097 for MoE)."""
    for layout in ("dense local", "moe local layers"):
        plan = plan_for(layout, models)
        first = plan.placements[0]
        assert first.weight_bytes + first.kv_bytes + placement.GPU_OVERHEAD < (
            MEASURED[layout][2][1] * MIB) <= first.need_bytes


def test_rig_cards_hold_the_bench_models_with_room(models: dict[str, ModelInfo],
                                                   tmp_path: Path) -> None:
    """The bench layouts also plan onto a 16 GB + 12 GB pair (the original rig's cards)."""
    rig = dict(DEVICES, gpu0=replace(DEVICES["gpu0"], total=16311 * MIB, free=15800 * MIB),
               gpu1=replace(DEVICES["gpu1"], total=12288 * MIB, free=11900 * MIB))
    for layout in ("dense auto", "moe auto", "moe local experts"):
        kind, fields, _, _ = MEASURED[layout]
        prof = Profile(name=layout, source="x.yaml", model="x", mode=Mode.COMBINE, head="gpu0",
                       peers=("gpu1",), server_args={"ctx-size": 4096}, **fields)
        plan = resolver.resolve(prof, models[kind], "/m.gguf", rig, [30152])
        assert all(p.need_bytes <= p.free_bytes for p in plan.placements)
