#!/usr/bin/env python3
"""Does hydra add anything per token? Decode and prefill tokens/s of a profile started by
`hydra up` vs the very same argv started by hand, measured side by side in one run.

hydra's copy is measured through its external port (the first-byte router in front of
llama-server), the hand-started one directly on llama-server's port.
Both copies run at once (an idle llama-server costs no CPU) and requests alternate between them,
round after round, so machine noise hits both alike. Speeds are llama-server's own `timings`
(prompt_per_second, predicted_per_second); the ratio printed is hydra / by-hand, median over
rounds. Target: >= 0.99.

    .venv/bin/python bench/overhead.py [--profiles demo,demo-combine] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
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

from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.proc import rpcproto  # noqa: E402
from hydra_supervisor.serve.snapshot import Snapshot  # noqa: E402
from hydra_supervisor.tools import binaries  # noqa: E402

HYDRA = [sys.executable, "-m", "hydra_supervisor"]
PROMPT = " ".join(f"The number {i} is followed by {i + 1}." for i in range(40))


def wait(pred: Any, timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(poll)
    raise SystemExit(f"timed out waiting for {what}")


def healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def env_for(tmp: Path, tag: str) -> dict[str, str]:
    # Below the kernel's ephemeral range (32768-60999): a port picked there at plan time can be
    # taken by any client connection before llama-server binds it (seen on a busy machine).
    base = 20000 + free_port() % 10000
    node = tmp / f"node-{tag}.yaml"
    # Ranges of its own for the heads too: a layout started by hand beside a running hydra
    # must not find (and time) that hydra's head on the default internal port.
    node.write_text(f"rpc_ports: [{base}, {base + 20}]\n"
                    f"internal_ports: [{base + 21}, {base + 40}]\n")
    return dict(os.environ, HYDRA_STATE_DIR=str(tmp / f"state-{tag}"), HYDRA_NODE=str(node))


def start_hydra(profile: str, port: int, env: dict[str, str], tmp: Path) -> subprocess.Popen[bytes]:
    log = (tmp / f"hydra-{profile}.log").open("wb")
    proc = subprocess.Popen([*HYDRA, "up", "-p", profile, "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    wait(lambda: healthy(port) or proc.poll() is not None, 180, f"hydra up {profile}")
    if proc.poll() is not None:
        raise SystemExit(f"hydra up {profile} failed; see {log.name}")
    return proc


def start_by_hand(profile: str, port: int, env: dict[str, str], tmp: Path
                  ) -> tuple[list[subprocess.Popen[bytes]], int]:
    """The plan's argv, spawned plainly (no hydra, no router): peers, HELLO, head.
    Returns the processes and the port the head listens on."""
    res = subprocess.run([*HYDRA, "plan", "-p", profile, "--port", str(port), "--json"],
                         env=env, capture_output=True, text=True, check=True)
    return spawn_plan(json.loads(res.stdout), tmp, f"hand-{profile}")


def spawn_plan(plan: dict[str, Any], tmp: Path, tag: str, poll: float = 0.1
               ) -> tuple[list[subprocess.Popen[bytes]], int]:
    """Start a `hydra plan --json` layout by hand: each peer until it answers HELLO, then the
    head until /health is 200 (polled every `poll` s). Returns the processes and the head's
    port; on a failure what started is stopped."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for eng in sorted(plan["engines"], key=lambda e: e["start_order"]):
            exe = str(binaries.find(eng["program"]).path)
            with (tmp / f"{tag}-{eng['name']}.log").open("wb") as log:
                procs.append(subprocess.Popen([exe, *eng["args"]],
                                              env={**os.environ, **eng["env"]},
                                              stdout=log, stderr=subprocess.STDOUT))
            if eng["role"] == "peer":
                def hello(e: dict[str, Any] = eng) -> bool:
                    try:
                        rpcproto.probe(e["host"], e["port"], 1.0)
                        return True
                    except (OSError, rpcproto.HelloError):
                        return False
                wait(hello, 60, f"peer {eng['endpoint']}", poll)
        head_port = next(e["port"] for e in plan["engines"] if e["role"] == "head")
        wait(lambda: healthy(head_port), 180, f"{plan.get('profile', '?')} started by hand",
             poll)
        return procs, head_port
    except BaseException:
        stop_all(procs)
        raise


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop processes started by hand, the head first."""
    for p in reversed(procs):
        p.terminate()
    for p in reversed(procs):
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def measure(port: int, n_predict: int) -> tuple[float, float]:
    body = {"prompt": PROMPT, "n_predict": n_predict, "cache_prompt": False,
            "temperature": 0, "ignore_eos": True}
    t = requests.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=300).json()
    timings = t["timings"]
    return float(timings["predicted_per_second"]), float(timings["prompt_per_second"])


def head_port(env: dict[str, str]) -> int:
    """The internal port of the head hydra started (its llama-server, behind the router)."""
    out = subprocess.run([*HYDRA, "status", "--json"], env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    snap = Snapshot.from_json(json.loads(out)["daemon"])
    return next(p.port for _, _, p in snap.processes() if p.role == "head")


def bench(profile: str, rounds: int, n_predict: int, tmp: Path, direct: bool = False,
          hand_first: bool = False) -> dict[str, float]:
    hp, mp = free_port(), free_port()
    henv, menv = env_for(tmp, f"{profile}-hydra"), env_for(tmp, f"{profile}-hand")
    hand: list[subprocess.Popen[bytes]] = []
    if hand_first:  # which copy starts first: an effect of the order shows up as a flip
        hand, mp = start_by_hand(profile, mp, menv, tmp)
    hydra = start_hydra(profile, hp, henv, tmp)
    try:
        if not hand_first:
            hand, mp = start_by_hand(profile, mp, menv, tmp)
        if direct:  # hydra's head on its own port: the router left out of the comparison
            hp = head_port(henv)
        measure(hp, 8)  # warm both (page cache, first-request allocations)
        measure(mp, 8)
        dec: dict[str, list[float]] = {"hydra": [], "hand": []}
        pre: dict[str, list[float]] = {"hydra": [], "hand": []}
        for r in range(rounds):
            order = [("hydra", hp), ("hand", mp)] if r % 2 == 0 else [("hand", mp), ("hydra", hp)]
            for who, port in order:
                d, p = measure(port, n_predict)
                dec[who].append(d)
                pre[who].append(p)
        ratios_d = [a / b for a, b in zip(dec["hydra"], dec["hand"], strict=True)]
        ratios_p = [a / b for a, b in zip(pre["hydra"], pre["hand"], strict=True)]
        return {
            "decode_hydra": statistics.median(dec["hydra"]),
            "decode_hand": statistics.median(dec["hand"]),
            "decode_ratio": statistics.median(ratios_d),
            "prefill_hydra": statistics.median(pre["hydra"]),
            "prefill_hand": statistics.median(pre["hand"]),
            "prefill_ratio": statistics.median(ratios_p),
        }
    finally:
        hydra.send_signal(signal.SIGTERM)
        hydra.wait(30)
        for proc in reversed(hand):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", default="demo,demo-combine")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--direct", action="store_true",
                    help="measure hydra's head on its internal port (no router in between)")
    ap.add_argument("--hand-first", action="store_true",
                    help="start the by-hand copy before hydra's (default: hydra's first)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hydra-bench-") as d:
        for profile in args.profiles.split(","):
            rows.append((profile, bench(profile, args.rounds, args.n_predict, Path(d),
                                        direct=args.direct, hand_first=args.hand_first)))
    how = ", ".join(w for w, on in (("hydra's head direct", args.direct),
                                    ("by-hand started first", args.hand_first)) if on)
    print(f"\nhydra overhead: {args.rounds} alternating rounds, n_predict {args.n_predict}, "
          f"median tokens/s (llama-server timings){'; ' + how if how else ''}")
    print(f"{'profile':16} {'decode hydra':>12} {'by hand':>9} {'ratio':>6}   "
          f"{'prefill hydra':>13} {'by hand':>9} {'ratio':>6}")
    ok = True
    for profile, r in rows:
        print(f"{profile:16} {r['decode_hydra']:12.1f} {r['decode_hand']:9.1f} "
              f"{r['decode_ratio']:6.3f}   {r['prefill_hydra']:13.1f} {r['prefill_hand']:9.1f} "
              f"{r['prefill_ratio']:6.3f}")
        ok &= r["decode_ratio"] >= 0.99 and r["prefill_ratio"] >= 0.99
    print(f"target: ratio >= 0.99 -> {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
