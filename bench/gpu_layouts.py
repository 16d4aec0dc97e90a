#!/usr/bin/env python3
"""The GPU layouts, started by hydra on a host with two GPUs, side by side in one run.

Generates synthetic models (dense and MoE, random weights), then for each layout runs
`hydra up`, checks where llama-server put the weights (its own load log), measures decode
tokens/s with llama-server's timings, and `hydra down`. Prints each layout's decode speed and its
ratio to SOLO on one GPU:

  dense solo            one llama-server on gpu0
  dense combine rpc     ggml-rpc-server on gpu1, head on gpu0 with --rpc -ts
  dense combine local   one llama-server over gpu0+gpu1 (-sm layer -ts)
  moe solo / moe combine (experts on gpu1 over RPC, -ot)

    python bench/gpu_layouts.py --dense-layers 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor import synth  # noqa: E402

HYDRA = [sys.executable, "-m", "hydra_supervisor"]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def hydra(env: dict[str, str], *args: str, timeout: float = 120
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HYDRA, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def measure(port: int, rounds: int, n: int) -> float:
    speeds = []
    for _ in range(rounds + 1):
        r = requests.post(f"http://127.0.0.1:{port}/completion", timeout=300, json={
            "prompt": PROMPT, "n_predict": n, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False}).json()
        speeds.append(float(r["timings"]["predicted_per_second"]))
    return statistics.median(speeds[1:])  # the first one warms up


def run_layout(name: str, profile: Path, env: dict[str, str], port: int, rounds: int,
               n: int, tmp: Path) -> dict[str, object]:
    log = (tmp / f"{name}.up.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen([*HYDRA, "up", "-p", str(profile), "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return {"layout": name, "error": (tmp / f"{name}.up.log").read_text()[-2000:]}
            st = json.loads(hydra(env, "status", "--json").stdout)
            if st["status"] and st["status"].get("pid") == proc.pid and all(
                    e["state"] == "READY" for e in st["status"]["engines"]):
                break
            time.sleep(0.2)
        load = time.monotonic() - t0
        tps = measure(port, rounds, n)
        head_log = (Path(env["HYDRA_STATE_DIR"]) / "logs" / "head.log").read_text(errors="replace")
        buffers = re.findall(r"load_tensors: +(\S+) model buffer size = +([\d.]+) MiB", head_log)
        plan = json.loads(hydra(env, "plan", "-p", str(profile), "--json").stdout)
        # With --verbose llama.cpp logs where each block went: compare with hydra's plan.
        assigned: dict[str, int] = {}
        for dev in re.findall(r"load_tensors: layer +\d+ assigned to device (\S+?),", head_log):
            assigned[dev] = assigned.get(dev, 0) + 1
        overridden = len(re.findall(r"buffer type overridden to RPC0", head_log))
        return {"layout": name, "decode_tps": tps, "load_s": load, "buffers": buffers,
                "blocks_by_device_llama": assigned, "experts_overridden_to_rpc": overridden,
                "planned": [(p["device"], p["what"]) for p in plan["placements"]],
                "head_args": " ".join(next(e for e in plan["engines"]
                                           if e["role"] == "head")["args"][2:])}
    finally:
        hydra(env, "down")
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense-layers", type=int, default=32)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--moe-layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--split", default="[0.5, 0.5]", help="COMBINE split, peer first")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--out", default="")
    ap.add_argument("--verify", action="store_true",
                    help="run llama-server with --verbose and report where each block went")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hydra-gpu-"))
    dense, moe = tmp / "dense.gguf", tmp / "moe.gguf"
    t0 = time.monotonic()
    synth.write_dense(dense, n_layers=args.dense_layers, n_embd=args.embd, n_ff=args.ff,
                      n_head=32, n_head_kv=8, ftype="q8_0", ctx=4096)
    synth.write_moe(moe, n_layers=args.moe_layers, n_embd=2048, n_ff_exp=1024,
                    n_expert=args.experts, n_expert_used=4, n_head=16, n_head_kv=4,
                    ftype="q8_0", ctx=4096)
    print(f"models generated in {time.monotonic() - t0:.0f}s", flush=True)
    node = tmp / "node.yaml"
    node.write_text("devices:\n  gpu0: {cuda: 0}\n  gpu1: {cuda: 1}\nrpc_ports: [50152, 50170]\n")
    env = dict(os.environ, HYDRA_NODE=str(node), HYDRA_STATE_DIR=str(tmp / "state"))
    verbose = ", verbose: true" if args.verify else ""
    common = f"server_args: {{ctx-size: 4096, parallel: 1, flash-attn: on{verbose}}}\n"
    layouts = {
        "dense solo": f"model: {dense}\nhead: gpu0\n",
        "dense combine rpc": f"model: {dense}\nmode: combine\nhead: gpu0\npeers: [gpu1]\n"
                             f"split: {args.split}\n",
        "dense combine local": f"model: {dense}\nmode: combine\nhead: gpu0\npeers: [gpu1]\n"
                               f"split: {args.split}\ntransport: local\n",
        "moe solo": f"model: {moe}\nhead: gpu0\n",
        "moe combine rpc (-ot)": f"model: {moe}\nmode: combine\nhead: gpu0\npeers: [gpu1]\n",
    }
    results = []
    for i, (name, text) in enumerate(layouts.items()):
        prof = tmp / f"layout{i}.yaml"
        prof.write_text(text + common)
        r = run_layout(name, prof, env, 18200 + i, args.rounds, args.n_predict, tmp)
        print(json.dumps(r), flush=True)
        results.append(r)
    base = {"dense": next((r.get("decode_tps") for r in results if r["layout"] == "dense solo"),
                          None),
            "moe": next((r.get("decode_tps") for r in results if r["layout"] == "moe solo"),
                        None)}
    print(f"\n{'layout':24} {'decode t/s':>10} {'vs solo':>8} {'load':>6}  weights per device")
    for r in results:
        if "error" in r:
            print(f"{r['layout']:24} ERROR {str(r['error'])[-300:]}")
            continue
        tps = float(r["decode_tps"])  # type: ignore[arg-type]
        ref = base["moe" if r["layout"].startswith("moe") else "dense"]  # type: ignore[union-attr]
        ratio = f"{tps / ref:.2f}" if ref else "-"
        bufs = ", ".join(f"{d} {float(m):,.0f} MiB" for d, m in r["buffers"])  # type: ignore
        print(f"{r['layout']:24} {tps:10.1f} {ratio:>8} {float(r['load_s']):5.1f}s  {bufs}")
        if args.verify:
            print(f"{'':24} planned {r['planned']}; llama.cpp put blocks "
                  f"{r['blocks_by_device_llama']}, experts overridden to RPC0: "
                  f"{r['experts_overridden_to_rpc']}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
