#!/usr/bin/env python3
"""The GPU layouts, started by hydra on a host with two GPUs, side by side in one run.

For each layout: `hydra up` from a generated profile, load time (spawn to GET /health 200 on the
external port, polled directly), decode and prefill tokens/s from llama-server's own timings
(through hydra's router), where llama.cpp put the weights (its load log), and the GPU memory each
device really holds while serving (NVML, per process) against hydra's plan; then `hydra down`.
Ratios are against SOLO on one GPU in the same run.

  dense solo / rpc / local / auto     one GPU; ggml-rpc-server peer + head --rpc -ts; one
                                      llama-server over both GPUs (-sm layer -ts); the default
  moe solo / rpc experts / rpc layers / local experts / local layers / auto
                                      experts on the peer (-ot ...=RPC0[..] or =CUDA1) or whole
                                      layers per GPU
  moe local experts, capped           gpu0 and gpu1 declared small (memory_mib): only some
                                      experts fit gpu1 and the first layers' stay in host RAM

    python3 bench/gpu_layouts.py --dense M.gguf --moe M.gguf --rounds 5 --out results.json
(without --dense/--moe the models are generated first; `hydra synth` writes the same shapes).
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
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor.plan.ports import ephemeral_range  # noqa: E402
from hydra_supervisor.tools import synth  # noqa: E402

HYDRA = [sys.executable, "-m", "hydra_supervisor"]
MIB = 1 << 20
DECODE_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
PREFILL_PROMPT = "In a hole in the ground there lived a hobbit, and the hobbit liked tea. " * 60
RPC_PORTS = (30152, 30170)  # below the ephemeral range (checked in main)
INTERNAL_PORTS = (30300, 30399)
BUF_RE = re.compile(r"(load_tensors|llama_kv_cache|llama_context|sched_reserve|graph_reserve)?"
                    r"[:\s]+(\S+) (model|KV|compute) buffer size = +([\d.]+) MiB")


def hydra(env: dict[str, str], *args: str, timeout: float = 120
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*HYDRA, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float) -> float | None:
    """Seconds until GET /health on the external port answers 200; None if hydra exited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return None
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(0.05)
    return None


def completion(port: int, prompt: str, n: int) -> dict[str, Any]:
    r = requests.post(f"http://127.0.0.1:{port}/completion", timeout=300, json={
        "prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0,
        "cache_prompt": False})
    r.raise_for_status()
    return dict(r.json()["timings"])


def measure(port: int, rounds: int, n: int) -> tuple[float, float, int]:
    """Median decode and prefill tokens/s over `rounds` (after one warm-up of each)."""
    dec, pre = [], []
    n_prompt = 0
    for i in range(rounds + 1):
        d = completion(port, DECODE_PROMPT, n)
        p = completion(port, PREFILL_PROMPT, 1)
        n_prompt = int(p.get("prompt_n", 0))
        if i:
            dec.append(float(d["predicted_per_second"]))
            pre.append(float(p["prompt_per_second"]))
    return statistics.median(dec), statistics.median(pre), n_prompt


def nvml_memory() -> dict[int, dict[int, int]]:
    """{physical GPU index: {pid: bytes used}} for every compute process (NVML)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return {}  # no GPU here (a CPU dry run of this script)
    try:
        out: dict[int, dict[int, int]] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            out[i] = {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}
        return out
    finally:
        pynvml.nvmlShutdown()


def llama_buffers(*logs: Path) -> list[tuple[str, str, float]]:
    """(buffer name, model|KV|compute, MiB) from llama.cpp's load logs; the last load only."""
    found: list[tuple[str, str, float]] = []
    for log in logs:
        if not log.exists():
            continue
        text = log.read_text(errors="replace")
        # a log keeps earlier runs' lines after a restart: take the text after the last start
        start = max(text.rfind("main: loading model"), text.rfind("build_info"), 0)
        for m in BUF_RE.finditer(text[start:]):
            found.append((m.group(2), m.group(3), float(m.group(4))))
    return found


def physical(device_env: str, local_index: int) -> int:
    visible = [int(x) for x in device_env.split(",") if x.strip()]
    return visible[local_index] if local_index < len(visible) else local_index


def run_layout(name: str, profile: Path, env: dict[str, str], port: int, rounds: int,
               n: int, tmp: Path, cuda_of: dict[str, int]) -> dict[str, Any]:
    plan_res = hydra(env, "plan", "-p", str(profile), "--json", "--port", str(port))
    if plan_res.returncode:
        return {"layout": name, "error": plan_res.stderr[-1500:]}
    plan = json.loads(plan_res.stdout)
    logf = tmp / f"{name.replace(' ', '_')}.up.log"
    with logf.open("w") as log:
        proc = subprocess.Popen([*HYDRA, "up", "-p", str(profile), "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        load = wait_ready(port, proc, 300)
        if load is None:
            return {"layout": name, "error": logf.read_text(errors="replace")[-2000:],
                    "plan_notes": plan["notes"]}
        tps, pps, n_prompt = measure(port, rounds, n)
        mem = nvml_memory()  # after the runs: compute pools have grown to their working size
        logs = Path(env["HYDRA_STATE_DIR"]) / "logs"
        head = next(e for e in plan["engines"] if e["role"] == "head")
        planned: dict[int, int] = {}
        for pl in plan["placements"]:
            if pl["device"] in cuda_of:
                idx = cuda_of[pl["device"]]
                planned[idx] = planned.get(idx, 0) + pl["weight_bytes"] + pl["kv_bytes"] \
                    + pl["overhead_bytes"]
        used = {gpu: sum(procs.values()) for gpu, procs in mem.items() if procs}
        bufs = llama_buffers(logs / "head.log")
        weights: dict[str, float] = {}
        for buf, what, mib in bufs:
            if what == "model" and not buf.startswith("CPU"):
                label = buf
                m = re.fullmatch(r"CUDA(\d+)", buf)
                if m:  # CUDAn inside the process -> the physical GPU
                    label = f"gpu{physical(head['env'].get('CUDA_VISIBLE_DEVICES', ''), int(m[1]))}"
                elif buf.startswith("RPC"):
                    label = "gpu1 (rpc)"
                weights[label] = weights.get(label, 0.0) + mib
        return {
            "layout": name, "transport": plan["transport"], "moe_split": plan["meta"].get(
                "moe_split", "-"), "decode_tps": tps, "prefill_tps": pps,
            "prompt_tokens": n_prompt, "load_s": load, "weights_mib": weights,
            "buffers": bufs, "nvml_bytes": {str(k): v for k, v in mem.items()},
            "used_bytes": {str(k): v for k, v in used.items()},
            "planned_bytes": {str(k): v for k, v in planned.items()},
            "placements": plan["placements"], "notes": plan["notes"],
            "head_args": " ".join(head["args"][6:]),
            "head_env": head["env"].get("CUDA_VISIBLE_DEVICES", ""),
        }
    finally:
        hydra(env, "down")
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


LAYOUTS: dict[str, tuple[str, str]] = {
    # name: (model, profile body)
    "dense solo": ("dense", "head: gpu0\n"),
    "dense rpc": ("dense", "mode: combine\nhead: gpu0\npeers: [gpu1]\ntransport: rpc\n{split}"),
    "dense local": ("dense", "mode: combine\nhead: gpu0\npeers: [gpu1]\ntransport: local\n"
                             "{split}"),
    "dense auto": ("dense", "mode: combine\nhead: gpu0\npeers: [gpu1]\n{split}"),
    "moe solo": ("moe", "head: gpu0\n"),
    "moe rpc experts": ("moe", "mode: combine\nhead: gpu0\npeers: [gpu1]\ntransport: rpc\n"
                               "moe_split: experts\n"),
    "moe rpc layers": ("moe", "mode: combine\nhead: gpu0\npeers: [gpu1]\ntransport: rpc\n"
                              "moe_split: layers\n{split}"),
    "moe local experts": ("moe", "mode: combine\nhead: gpu0\npeers: [gpu1]\n"
                                 "transport: local\nmoe_split: experts\n"),
    "moe local layers": ("moe", "mode: combine\nhead: gpu0\npeers: [gpu1]\ntransport: local\n"
                                "moe_split: layers\n{split}"),
    "moe auto": ("moe", "mode: combine\nhead: gpu0\npeers: [gpu1]\n{split}"),
    # llama.cpp's own fitting left on (hydra passes --fit off): what it costs at load
    "dense solo fit-on": ("dense", "head: gpu0\n{fit}"),
    "dense auto fit-on": ("dense", "mode: combine\nhead: gpu0\npeers: [gpu1]\n{split}{fit}"),
    "moe local experts capped": ("moe", "mode: combine\nhead: small0\npeers: [small1]\n"
                                        "moe_split: experts\n"),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", default="", help="dense GGUF (else generated)")
    ap.add_argument("--moe", default="", help="MoE GGUF (else generated)")
    ap.add_argument("--dense-layers", type=int, default=32)
    ap.add_argument("--embd", type=int, default=4096)
    ap.add_argument("--ff", type=int, default=14336)
    ap.add_argument("--moe-layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--split", default="[0.5, 0.5]", help="COMBINE split, peer first")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--cap-mib", default="3200,2400",
                    help="memory_mib of small0,small1 for the capped layout")
    ap.add_argument("--layouts", default="", help="comma-separated subset of the layouts")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    lo, hi = ephemeral_range()
    for a, b in (RPC_PORTS, INTERNAL_PORTS):
        assert b < lo or a > hi, f"bench ports {a}-{b} overlap the ephemeral range {lo}-{hi}"
    tmp = Path(tempfile.mkdtemp(prefix="hydra-gpu-"))
    models = {"dense": Path(args.dense) if args.dense else tmp / "dense.gguf",
              "moe": Path(args.moe) if args.moe else tmp / "moe.gguf"}
    wanted = [x.strip() for x in args.layouts.split(",") if x.strip()] or list(LAYOUTS)
    t0 = time.monotonic()
    need = {LAYOUTS[w][0] for w in wanted}
    if "dense" in need and not models["dense"].exists():
        synth.write_dense(models["dense"], n_layers=args.dense_layers, n_embd=args.embd,
                          n_ff=args.ff, n_head=32, n_head_kv=8, ftype="q8_0", ctx=4096)
    if "moe" in need and not models["moe"].exists():
        synth.write_moe(models["moe"], n_layers=args.moe_layers, n_embd=2048, n_ff_exp=1024,
                        n_expert=args.experts, n_expert_used=4, n_head=16, n_head_kv=4,
                        ftype="q8_0", ctx=4096)
    print(f"models ready in {time.monotonic() - t0:.0f}s", flush=True)
    cap0, cap1 = (int(x) for x in args.cap_mib.split(","))
    node = tmp / "node.yaml"
    node.write_text(
        "devices:\n  gpu0: {cuda: 0}\n  gpu1: {cuda: 1}\n"
        f"  small0: {{cuda: 0, memory_mib: {cap0}}}\n  small1: {{cuda: 1, memory_mib: {cap1}}}\n"
        f"rpc_ports: [{RPC_PORTS[0]}, {RPC_PORTS[1]}]\n"
        f"internal_ports: [{INTERNAL_PORTS[0]}, {INTERNAL_PORTS[1]}]\n")
    cuda_of = {"gpu0": 0, "gpu1": 1, "small0": 0, "small1": 1}
    env = dict(os.environ, HYDRA_NODE=str(node), HYDRA_STATE_DIR=str(tmp / "state"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                        os.environ.get("PYTHONPATH")])))
    # log-verbosity 4: llama.cpp then logs each device's model / KV / compute buffer sizes
    common = ("server_args: {ctx-size: 4096, parallel: 1, flash-attn: \"on\", "
              "log-verbosity: 4%s}\n")
    results = []
    for i, name in enumerate(wanted):
        model, body = LAYOUTS[name]
        prof = tmp / f"layout{i}.yaml"
        fit = "{fit}" in body
        prof.write_text(f"model: {models[model]}\n"
                        + body.format(split=f"split: {args.split}\n", fit="")
                        + common % (', fit: "on"' if fit else ""))
        r = run_layout(name, prof, env, 18200 + i, args.rounds, args.n_predict, tmp, cuda_of)
        print(json.dumps({k: v for k, v in r.items() if k not in ("buffers", "placements")}),
              flush=True)
        results.append(r)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


def table(results: list[dict[str, Any]]) -> str:
    solo = {k: next((r for r in results if r["layout"] == f"{k} solo" and "error" not in r),
                    None) for k in ("dense", "moe")}
    lines = [f"{'layout':26} {'transport':9} {'decode t/s':>10} {'vs solo':>7} "
             f"{'prefill t/s':>11} {'vs solo':>7} {'load':>6} {'vs solo':>7}  "
             "weights per device (llama.cpp)  | planned / NVML MiB per GPU"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['layout']:26} ERROR {str(r['error'])[-400:]}")
            continue
        ref = solo["moe" if r["layout"].startswith("moe") else "dense"]

        def ratio(key: str, r: dict[str, Any] = r, ref: dict[str, Any] | None = ref) -> str:
            return f"{r[key] / ref[key]:.2f}" if ref else "-"

        weights = ", ".join(f"{d} {m:,.0f}" for d, m in sorted(r["weights_mib"].items())) or "-"
        planned, used = r["planned_bytes"], r["used_bytes"]
        mem = ", ".join(f"gpu{g} {planned.get(g, 0) / MIB:,.0f}/{used.get(g, 0) / MIB:,.0f}"
                        for g in sorted(set(planned) | set(used)))
        lines.append(
            f"{r['layout']:26} {r['transport']:9} {r['decode_tps']:10.1f} {ratio('decode_tps'):>7} "
            f"{r['prefill_tps']:11.1f} {ratio('prefill_tps'):>7} {r['load_s']:5.1f}s "
            f"{ratio('load_s'):>7}  {weights}  | {mem}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
