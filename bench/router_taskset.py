"""The experiment behind router_cpus (router/affinity.py): the request-aware leg and the byte
relay, each in its own process started under a CPU mask (``PIN``, e.g. ``taskset -c 3``), in
front of the stand-in upstream; streams of 8 tokens, ``WIDTH`` at once, ``ROUNDS`` rounds, each
round direct, aware, raw. Prints the added p50 time to the first byte over direct and each
relay's CPU per request (its process's user + system time over the requests it relayed).

The relays are started with HYDRA_ROUTER_CPUS=all, so that the mask is the only pinning.

  PIN="taskset -c 3" .venv/bin/python bench/router_taskset.py ROUNDS WIDTH
  for pin in "" "taskset -c 3" "taskset -c 3,4" "taskset -c 3-6"; do
    PIN="$pin" python3 bench/router_taskset.py 10 64
    PIN="$pin" python3 bench/router_taskset.py 300 1
  done
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hydra_supervisor.testing.routerhelp import drive_streams, stream_request  # noqa: E402


def _port(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return int(json.loads(line)["port"]) if line.startswith("{") else int(line)


def main() -> int:
    rounds, width = int(sys.argv[1]), int(sys.argv[2])
    pin = shlex.split(os.environ.get("PIN", ""))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_ROUTER_CPUS": "all"}
    up = subprocess.Popen([sys.executable, "-m", "hydra_supervisor.testing.sse_upstream"],
                          cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    uport = _port(up)
    req = stream_request(tokens=8, delay=0.0)
    relays: dict[str, tuple[subprocess.Popen[str], int]] = {}
    try:
        for design in ("router", "router-raw"):
            p = subprocess.Popen([*pin, sys.executable, str(ROOT / "bench" / "router.py"),
                                  "_relay", design, str(uport)], cwd=ROOT, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            relays[design] = (p, _port(p))
            drive_streams(relays[design][1], 4, req)  # warm-up (threads, pools)
        first: dict[str, list[float]] = {d: [] for d in ("direct", *relays)}
        cpu = {d: 0.0 for d in relays}
        for _ in range(rounds):
            for d in first:
                proc = psutil.Process(relays[d][0].pid) if d in relays else None
                c0 = sum(proc.cpu_times()[:2]) if proc else 0.0
                res = drive_streams(relays[d][1] if d in relays else uport, width, req,
                                    timeout=60)
                if res["failed"]:
                    raise RuntimeError(f"{d}: {res['failed'][:2]}")
                first[d] += res["first"]
                if proc:
                    cpu[d] += sum(proc.cpu_times()[:2]) - c0
        n = rounds * width
        direct = statistics.median(first["direct"])
        print(f"direct p50 {direct * 1e3:.2f} ms; " + "; ".join(
            f"{d} {(statistics.median(first[d]) - direct) * 1e3:+.2f} ms, "
            f"cpu/req {cpu[d] / n * 1e6:.0f} us" for d in relays))
    finally:
        for p, _ in relays.values():
            if p.stdin:
                p.stdin.close()
            p.wait(30)
        if up.stdin:
            up.stdin.close()
        up.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
