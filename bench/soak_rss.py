#!/usr/bin/env python3
"""A faulted soak, to see what holds hydra's memory (issue 31, item 9): `hydra up -p
demo-combine` (head + CPU ggml-rpc-server peer) under steady traffic (a short completion every
0.25 s, a streamed chat completion back to back, the status and the dashboard's history read
every second) while faults come every `--every` seconds, in turn: the head killed, the peer
killed, the head SIGSTOPped for 3 s, `hydra restart head`. hydra's RSS is sampled every 5 s;
at the end the script prints the timeline, the requests served and failed, and where the
memory is (glibc's arenas: `malloc_info` is not reachable from outside, so the comparison is
run-against-run: ``--env MALLOC_ARENA_MAX=2`` bounds glibc's per-thread arenas).

    .venv/bin/python bench/soak_rss.py [--minutes 6] [--every 15] [--env NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.testing.faults import FAST_POLICY, Client  # noqa: E402
from hydra_supervisor.testing.harness import Up, make_env, run_hydra, status_json  # noqa: E402


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def _streamer(port: int, stop: threading.Event, counts: dict[str, int]) -> None:
    while not stop.is_set():
        try:
            with requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", stream=True,
                               timeout=30, json={"messages": [{"role": "user", "content": "Hi"}],
                                                 "max_tokens": 24, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
                counts["ok" if r.status_code == 200 else "failed"] += 1
        except requests.RequestException:
            counts["failed"] += 1
            stop.wait(0.2)


def _reader(env: dict[str, str], mport: int, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            status_json(env)
            requests.get(f"http://127.0.0.1:{mport}/api/history", timeout=5)
            requests.get(f"http://127.0.0.1:{mport}/api/state", timeout=5)
        except (requests.RequestException, AssertionError, OSError, ValueError):
            pass


def _engine_pid(env: dict[str, str], role: str) -> int | None:
    st = status_json(env)["status"]
    for e in (st["engines"] if st else []):
        if e["role"] == role and e["pid"]:
            return int(e["pid"])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--every", type=float, default=15.0, help="seconds between faults")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for hydra's env")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hydra-soak-") as d:
        tmp = Path(d)
        env = make_env(tmp)
        for kv in args.env:
            k, _, v = kv.partition("=")
            env[k] = v
        prof = tmp / "soak.yaml"
        prof.write_text((REPO / "profiles" / "demo-combine.yaml").read_text() + FAST_POLICY)
        port, mport = free_port(), free_port()
        up = Up(env, ["--profile", str(prof), "--port", str(port), "--metrics-port",
                      str(mport)], tmp)
        try:
            up.wait_ready(300)
            pid = up.proc.pid
            stop = threading.Event()
            counts = {"ok": 0, "failed": 0}
            threads = [threading.Thread(target=_streamer, args=(port, stop, counts)),
                       threading.Thread(target=_reader, args=(env, mport, stop))]
            for t in threads:
                t.start()
            samples: list[tuple[float, float]] = []
            faults: list[tuple[float, str]] = []
            t0 = time.monotonic()
            end = t0 + args.minutes * 60
            next_fault = t0 + args.every
            kinds = ["kill head", "kill peer", "stop head 3 s", "hydra restart head"]
            n = 0
            with Client(port) as client:
                samples.append((0.0, _rss_mb(pid)))
                while time.monotonic() < end:
                    time.sleep(5.0)
                    now = time.monotonic()
                    samples.append((now - t0, _rss_mb(pid)))
                    if now >= next_fault:
                        kind = kinds[n % len(kinds)]
                        n += 1
                        next_fault = now + args.every
                        faults.append((now - t0, kind))
                        if kind == "hydra restart head":
                            run_hydra(env, "restart", "head", timeout=120)
                            continue
                        target = _engine_pid(env, "peer" if "peer" in kind else "head")
                        if target is None:
                            continue
                        try:
                            if kind.startswith("kill"):
                                os.kill(target, signal.SIGKILL)
                            else:
                                os.kill(target, signal.SIGSTOP)
                                time.sleep(3)  # hydra may kill it meanwhile (hang_timeout 3)
                                os.kill(target, signal.SIGCONT)
                        except ProcessLookupError:
                            pass
                stop.set()
                for t in threads:
                    t.join(60)
            time.sleep(10)  # quiet: what stays
            samples.append((time.monotonic() - t0, _rss_mb(pid)))
            info = psutil.Process(pid)
            out = {
                "env": args.env, "minutes": args.minutes, "faults": len(faults),
                "streams": counts, "completions": {"sent": client.sent, "failed": client.failed},
                "rss_mb": [(round(t), round(m, 1)) for t, m in samples],
                "threads_end": info.num_threads(), "fds_end": info.num_fds(),
            }
            print(json.dumps(out))
            rss = [m for _, m in samples]
            print(f"hydra RSS: start {rss[0]:.0f} MB, peak {max(rss):.0f} MB, end (after 10 s "
                  f"quiet) {rss[-1]:.0f} MB; {len(faults)} faults; streams {counts}; "
                  f"completions {client.sent - client.failed}/{client.sent}; threads "
                  f"{out['threads_end']}, fds {out['fds_end']}", flush=True)
        finally:
            up.stop()
            up.kill_everything()
    return 0


if __name__ == "__main__":
    sys.exit(main())
