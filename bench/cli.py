"""How long client commands take: `hydra --version` and `hydra status --json` against a running
demo, each minus a bare `python -c pass` on the same machine (median of N, interleaved).

Target (issue 18): <= 0.25 s over the bare interpreter for both.

Usage: .venv/bin/python bench/cli.py [--runs 10]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra_supervisor.testing.harness import Up, make_env  # noqa: E402

HYDRA = [str(Path(sys.executable).parent / "hydra")]


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, timeout=60)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = make_env(Path(tmp))
        up = Up(env, ["--profile", "demo", "--port", "0"], Path(tmp))
        try:
            up.wait_ready(180)
            rows: dict[str, list[float]] = {"python -c pass": [], "hydra --version": [],
                                            "hydra status --json": []}
            for _ in range(args.runs):  # interleaved: drift on a shared machine hits all
                rows["python -c pass"].append(timed([sys.executable, "-c", "pass"], env))
                rows["hydra --version"].append(timed([*HYDRA, "--version"], env))
                rows["hydra status --json"].append(timed([*HYDRA, "status", "--json"], env))
        finally:
            up.stop()
    base = statistics.median(rows["python -c pass"])
    print(f"median of {args.runs}, interleaved (s)")
    print(f"{'command':22} {'median':>8} {'minus bare python':>18}")
    worst = 0.0
    for name, vals in rows.items():
        med = statistics.median(vals)
        extra = med - base
        if name != "python -c pass":
            worst = max(worst, extra)
        print(f"{name:22} {med:8.3f} {extra:+18.3f}")
    print(f"target: <= 0.25 s over bare python -> {'met' if worst <= 0.25 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
