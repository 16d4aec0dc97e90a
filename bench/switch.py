#!/usr/bin/env python3
"""What does `hydra switch` cost beyond loading the target layout, and does it lose requests?

In one run, side by side:
1. for each target profile: the raw load time of its layout started by hand (the plan's argv:
   peers, HELLO, head, /health 200), then `hydra switch` to it on a running hydra; prints every
   phase and the switch total minus the raw load (hydra's own overhead; target <= 0.5 s);
2. N switches back and forth under a steady load of streaming and non-streaming requests from
   keep-alive clients (the openai package): failed requests (target 0).
The request-aware HTTP leg vs direct (32 concurrent streams) is in bench/router.py.

    .venv/bin/python bench/switch.py [--targets demo-combine,demo] [--switches 20]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import routing  # noqa: E402
from bench.overhead import HYDRA, env_for, wait  # noqa: E402
from hydra_supervisor.ports import free_port  # noqa: E402
from tests.test_switch import Load  # noqa: E402


def raw_load(profile: str, tmp: Path) -> float:
    """The layout started by hand, timed from the first spawn (the plan is made before the
    clock starts, and /health is polled every 10 ms: bench/routing.py's raw_load)."""
    env = env_for(tmp, f"raw-{profile}")
    return routing.raw_load(routing.make_plan(profile, env), tmp, f"raw-{profile}")


def switch(env: dict[str, str], profile: str) -> dict[str, object]:
    res = subprocess.run([*HYDRA, "switch", profile, "--json"], env=env, capture_output=True,
                         text=True, timeout=600)
    rep: dict[str, object] = json.loads(res.stdout)
    if rep.get("result") != "ok":
        raise SystemExit(f"switch to {profile} failed: {rep}")
    return rep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", default="demo")
    ap.add_argument("--targets", default="demo-combine,demo-moe-combine,demo")
    ap.add_argument("--switches", type=int, default=20)
    args = ap.parse_args()
    targets = args.targets.split(",")
    with tempfile.TemporaryDirectory(prefix="hydra-bench-switch-") as d:
        tmp = Path(d)
        env = env_for(tmp, "hydra")
        port = free_port()
        log = (tmp / "hydra.log").open("wb")
        t0 = time.monotonic()
        hydra = subprocess.Popen([*HYDRA, "up", "--no-profile", "--port", str(port)], env=env,
                                 stdout=log, stderr=subprocess.STDOUT)
        try:
            def answers() -> bool:
                import requests
                try:
                    return requests.get(f"http://127.0.0.1:{port}/health",
                                        timeout=1).status_code == 503
                except requests.RequestException:
                    return False
            wait(answers, 60, "the model-less hydra")
            idle_ready = time.monotonic() - t0
            switch(env, args.start)
            rows = []
            for target in targets:
                raw = raw_load(target, tmp)
                rep = switch(env, target)
                rows.append((target, raw, rep))
            print(f"\nmodel-less `hydra up` to answering (incl. python start-up): "
                  f"{idle_ready:.2f}s")
            print(f"\n{'target':18} {'raw load':>8} {'switch':>7} {'overhead':>8}  phases")
            overheads = []
            for target, raw, rep in rows:
                total = float(rep["total_s"])  # type: ignore[arg-type]
                phases = rep["phases"]
                assert isinstance(phases, dict)
                overheads.append(total - raw)
                ph = "  ".join(f"{k} {v:.2f}" for k, v in phases.items())
                print(f"{target:18} {raw:8.2f} {total:7.2f} {total - raw:8.2f}  {ph}")
            print(f"overhead = switch total - raw load of the target; median "
                  f"{statistics.median(overheads):.2f}s (target <= 0.5 s)")

            pair = [args.start, targets[0]]
            with Load(port) as load:
                wait(lambda: load.ok >= 2, 120, "the load running")
                times = []
                for i in range(args.switches):
                    rep = switch(env, pair[(i + 1) % 2])
                    times.append(float(rep["total_s"]))  # type: ignore[arg-type]
                    print(f"  switch {i + 1}/{args.switches} -> {rep['to']}: "
                          f"{rep['total_s']:.2f}s", file=sys.stderr, flush=True)
                n = load.ok
                wait(lambda: load.ok > n, 120, "a request after the last switch")
            print(f"\n{args.switches} switches {pair[0]} <-> {pair[1]} under load: "
                  f"{load.ok} requests served, {len(load.failures)} failed (target 0); "
                  f"switch median {statistics.median(times):.2f}s")
            for f in load.failures[:5]:
                print(f"  failed: {f}")
            return 0 if not load.failures else 1
        finally:
            hydra.send_signal(signal.SIGTERM)
            hydra.wait(60)


if __name__ == "__main__":
    sys.exit(main())
