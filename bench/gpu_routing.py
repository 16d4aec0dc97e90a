#!/usr/bin/env python3
"""Two profiles that cannot share one GPU, behind one port: do they take turns safely?

On a CUDA machine: two synthetic models, each SOLO on gpu0, served by one hydra
(`hydra up -p g-dense -p g-moe`). The node file gives gpu0 a memory size (memory_mib) that fits
either profile's plan but not both, so every request for the stopped one evicts the other.
Two clients alternate (one per profile, keep-alive HTTP) for --seconds, once per
min_resident value. Meanwhile NVML is sampled every 50 ms: the two heads must never hold GPU
memory at the same moment (an eviction frees the GPU before the next load starts).

Prints per run: requests served and failed, loads, reloads/min, p50/p95 latency, how often
both heads held GPU memory at once (target 0), the peak GPU memory, and the on-demand load
times hydra logged.

    python3 bench/gpu_routing.py --dense DENSE.gguf --moe MOE.gguf [--seconds 40]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor.testing.harness import HYDRA, Up, lanes, make_env, snapshot  # noqa: E402

MIB = 1 << 20


def plan_need(env: dict[str, str], profile: str, pdir: Path) -> int:
    res = subprocess.run([*HYDRA, "plan", "-p", profile, "--profiles-dir", str(pdir), "--json"],
                         env=env, capture_output=True, text=True, check=True, timeout=120)
    plan = json.loads(res.stdout)
    return sum(int(p["weight_bytes"]) + int(p["kv_bytes"]) + int(p["overhead_bytes"])
               for p in plan["placements"] if not str(p["device"]).startswith("cpu"))


class GpuSampler(threading.Thread):
    """Per-process GPU memory every 50 ms: how often two of `pids()` hold memory at once."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.stop = threading.Event()
        self.samples = 0
        self.both = 0
        self.peak = 0

    def run(self) -> None:
        while not self.stop.is_set():
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
            holders = [p for p in procs if (p.usedGpuMemory or 0) > 0]
            self.samples += 1
            if len(holders) >= 2:
                self.both += 1
            used = int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
            self.peak = max(self.peak, used)
            time.sleep(0.05)


def one_run(tmp: Path, dense: str, moe: str, min_resident: float, seconds: float
            ) -> dict[str, Any]:
    import requests

    run = tmp / f"mr{min_resident:g}"
    run.mkdir()
    pdir = run / "profiles"
    pdir.mkdir()
    for name, model in (("g-dense", dense), ("g-moe", moe)):
        (pdir / f"{name}.yaml").write_text(
            f"profile: {name}\nmodel: {model}\nmode: solo\nhead: gpu0\n"
            "server_args:\n  ctx-size: 2048\n  n-predict: 8\n")
    env = make_env(run)
    needs = {n: plan_need(env, n, pdir) for n in ("g-dense", "g-moe")}
    mem = (max(needs.values()) + min(needs.values()) // 2) // MIB  # one fits, never both
    node = Path(env["HYDRA_NODE"])
    node.write_text(node.read_text() + f"devices:\n  gpu0: {{cuda: 0, memory_mib: {mem}}}\n"
                    f"defaults:\n  min_resident: {min_resident}\n")
    up = Up(env, ["-p", "g-dense", "-p", "g-moe", "--profiles-dir", str(pdir), "--port", "0"],
            run)
    sampler = GpuSampler()
    try:
        up.wait_ready(600)
        port = snapshot(env).ports[0].port
        sampler.start()
        stop = threading.Event()
        lat: list[float] = []
        failed: list[str] = []
        served = {"g-dense": 0, "g-moe": 0}

        def client(model: str) -> None:
            session = requests.Session()  # keep-alive, like an OpenAI client
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            body = {"model": model, "max_tokens": 4, "messages": [{"role": "user",
                                                                   "content": "hi"}]}
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    r = session.post(url, json=body, timeout=600)
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.status_code} {r.text[:200]}")
                    served[model] += 1
                    lat.append(time.monotonic() - t0)
                except Exception as exc:  # noqa: BLE001 - every failure is a finding
                    failed.append(f"{model}: {exc!r}")
                time.sleep(0.05)

        threads = [threading.Thread(target=client, args=(m,), daemon=True) for m in served]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(600)
        elapsed = time.monotonic() - t0
        sampler.stop.set()
        sampler.join(5)
        loads = sum(lane.loads for lane in lanes(env)) - 1
        log = (Path(env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log").read_text()
        load_s = [float(x) for x in re.findall(r"serving after ([0-9.]+)s \(on request\)", log)]
        lat.sort()
        return {"min_resident": min_resident, "gpu_mib": mem,
                "needs_mib": {k: v // MIB for k, v in needs.items()}, "seconds": elapsed,
                "served": served, "failed": failed, "loads": loads,
                "reloads_per_min": loads / elapsed * 60,
                "p50": lat[len(lat) // 2] if lat else None,
                "p95": lat[int(len(lat) * 0.95)] if lat else None,
                "both_holding": sampler.both, "samples": sampler.samples,
                "peak_mib": sampler.peak // MIB,
                "load_s_median": statistics.median(load_s) if load_s else None}
    finally:
        sampler.stop.set()
        up.stop()
        up.kill_everything()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", required=True)
    ap.add_argument("--moe", required=True)
    ap.add_argument("--seconds", type=float, default=40)
    ap.add_argument("--min-resident", default="0,10")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as d:
        for mr in (float(x) for x in args.min_resident.split(",")):
            results.append(one_run(Path(d), args.dense, args.moe, mr, args.seconds))
    r0 = results[0]
    print(f"gpu0 given {r0['gpu_mib']} MiB (memory_mib); plans need {r0['needs_mib']} MiB")
    print("min_resident  run s  served (dense+moe)  failed  loads  reloads/min  p50 s  p95 s  "
          "load s  both on GPU  peak MiB")
    for r in results:
        print(f"{r['min_resident']:>11g}s {r['seconds']:6.1f}  "
              f"{r['served']['g-dense']:>7}+{r['served']['g-moe']:<10} {len(r['failed']):>6} "
              f"{r['loads']:>6} {r['reloads_per_min']:>11.1f} {r['p50'] or 0:6.2f} "
              f"{r['p95'] or 0:6.2f} {r['load_s_median'] or 0:7.2f} "
              f"{r['both_holding']:>5}/{r['samples']:<6} {r['peak_mib']:>8}")
        for f in r["failed"][:5]:
            print(f"  failed: {f}")
    print("both on GPU = NVML samples (every 50 ms) in which both heads held GPU memory "
          "(target 0); load s = median on-demand load hydra logged")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    bad = any(r["failed"] or r["both_holding"] for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
