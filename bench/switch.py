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

`--resident`: the resident rows instead (standby layouts, serve/standby.py). SOLO <-> COMBINE
of one model (default the demo MoE on the CPU: demo-moe-combine, whose standby is demo-moe),
each way N times under a steady streaming client, in three hydras side by side: with the
standby (a flip), with the standby and keep_slots (slots carried across), and without a
standby (a reload, as before). Per row: p50 and max from the switch request (the control
API, no CLI start-up) to the first token the target serves to a new streaming request, the
flip phase alone, failed and cut requests of the steady client, and the memory the standby
costs per device (measured RSS or GPU bytes of its processes) against its plan. The flip's
tail: after each switch, once the target serves steadily, the same request's first token
again (the target's own TTFT); per row and way, p50/p95/p99/max of (switch -> first token)
minus that own TTFT, the cost of the switch itself (target: p99 <= 150 ms over >= 50 flips).
`--rows standby` runs only that row (`--switches 25`: 50 flips).

    .venv/bin/python bench/switch.py --resident [--pair demo-moe-combine,demo-moe] [--switches 10]
        [--rows standby,standby+keep_slots,reload]
"""

from __future__ import annotations

import argparse
import json
import math
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
from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.serve.snapshot import LaneStatus, Snapshot  # noqa: E402
from hydra_supervisor.testing.load import Load  # noqa: E402


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
    ap.add_argument("--resident", action="store_true", help="the standby rows (see above)")
    ap.add_argument("--pair", default="demo-moe-combine,demo-moe",
                    help="the profile started and its standby (--resident)")
    ap.add_argument("--profiles-dir", default=None, help="where the pair's profiles are")
    ap.add_argument("--node", default=None, help="a node file (GPUs) for --resident")
    ap.add_argument("--rows", default="standby,standby+keep_slots,reload",
                    help="the --resident rows to run (comma-separated)")
    args = ap.parse_args()
    if args.resident:
        return resident(args)
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


# -- resident rows (standby layouts) -------------------------------------------------------------

def _variant(src_dir: Path, out: Path, names: list[str], standby: bool, keep: bool) -> Path:
    """Copies of the pair's profiles: with or without their standby: keys, keep_slots on/off."""
    import yaml

    from hydra_supervisor.config import config

    out.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        path = config.find_profile(name, str(src_dir) if src_dir else None)
        data = yaml.safe_load(path.read_text())
        data.pop("standby", None)
        if standby:
            data["standby"] = names[1 - i]
        if keep:
            data["keep_slots"] = True
        (out / f"{name}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _first_token(port: int, want: str, deadline: float) -> float:
    """Start a streaming request now; monotonic time of its first content token, which must
    come from `want` (llama-server names its profile in every chunk's model)."""
    import requests

    with requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", stream=True,
                       timeout=max(1.0, deadline - time.monotonic()),
                       json={"messages": [{"role": "user", "content": "Say hi"}],
                             "max_tokens": 4, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if delta.get("content"):
                if chunk.get("model") != want:
                    raise SystemExit(f"first token from {chunk.get('model')}, not {want}")
                return time.monotonic()
    raise SystemExit(f"no token from {want}")


def _rows(env: dict[str, str]) -> list[LaneStatus]:
    from hydra_supervisor.runtime import control_client

    sock = control_client.socket_path(Path(env["HYDRA_STATE_DIR"]))
    _, st = control_client.call(sock, "GET", "/status", timeout=10)
    return [lane for _, lane in Snapshot.from_json(st["daemon"]).lanes()]


def _ctl_switch(env: dict[str, str], profile: str) -> dict[str, object]:
    from hydra_supervisor.runtime import control_client

    sock = control_client.socket_path(Path(env["HYDRA_STATE_DIR"]))
    code, rep = control_client.call(sock, "POST", "/switch", {"profile": profile}, timeout=600)
    if code != 200 or rep.get("result") != "ok":
        raise SystemExit(f"switch to {profile} failed: {rep}")
    return rep


def _standby_memory(rows: list[LaneStatus]) -> str:
    """The standby row's processes: measured bytes (GPU where NVML has them, else RSS) vs
    the plan's MiB per device."""
    row = next((r for r in rows if r.role == "standby"), None)
    if row is None:
        return "no standby row"
    gpu = sum(p.gpu_bytes or 0 for p in row.processes)
    rss = sum(p.rss_bytes or 0 for p in row.processes)
    planned = ", ".join(f"{k} {v:,} MiB" for k, v in row.needs_mib.items())
    got = f"GPU {gpu / 2**20:,.0f} MiB, RSS {rss / 2**20:,.0f} MiB" if gpu else \
        f"RSS {rss / 2**20:,.0f} MiB"
    return f"standby {row.profile}: planned {planned}; measured {got}"


def _one_variant(label: str, names: list[str], pdir: Path, tmp: Path, switches: int,
                 node: str | None, standby: bool) -> dict[str, object]:
    env = env_for(tmp, label)
    if node:
        env["HYDRA_NODE"] = node
    port = free_port()
    log = (tmp / f"hydra-{label}.log").open("wb")
    hydra = subprocess.Popen([*HYDRA, "up", "-p", names[0], "--port", str(port),
                              "--profiles-dir", str(pdir)], env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            try:
                rows = _rows(env)
            except Exception:  # noqa: BLE001 - not answering yet
                return False
            if rows[0].state != "serving":
                return False
            return not standby or (len(rows) == 2 and rows[1].state == "serving"
                                   and rows[1].warm_s is not None)
        wait(up, 300, f"hydra up ({label})")
        memory = [_standby_memory(_rows(env))] if standby else []
        times: dict[str, list[float]] = {names[1]: [], names[0]: []}
        flips: dict[str, list[float]] = {names[1]: [], names[0]: []}
        own: dict[str, list[float]] = {names[1]: [], names[0]: []}  # target's own TTFT
        slots: list[float] = []
        with Load(port) as load:
            wait(lambda: load.ok >= 2, 120, "the steady client")
            for i in range(2 * switches):
                target = names[(i + 1) % 2]
                t0 = time.monotonic()
                rep = _ctl_switch(env, target)
                t1 = _first_token(port, target, t0 + 600)
                times[target].append(t1 - t0)
                phases = rep.get("phases") or {}
                assert isinstance(phases, dict)
                if "flip" in phases:
                    flips[target].append(float(phases["flip"]))
                if "save_slots" in phases:
                    slots.append(float(phases["save_slots"]) + float(
                        phases.get("restore_slots", 0.0)))
                print(f"  {label}: -> {target} {1000 * (t1 - t0):.1f} ms "
                      f"({rep.get('instant')}) {phases}", file=sys.stderr, flush=True)
                time.sleep(0.3)  # the steady client runs on the new layout a moment
                s0 = time.monotonic()  # the same request again, nothing switching
                own[target].append(_first_token(port, target, s0 + 600) - s0)
                if standby and i == 0:  # the other layout standing by now
                    memory.append(_standby_memory(_rows(env)))
            n = load.ok
            wait(lambda: load.ok > n, 120, "a request after the last switch")
        return {"label": label, "times": times, "flips": flips, "slots": slots, "own": own,
                "failed": len(load.failures), "cut": len(load.cut), "ok": load.ok,
                "memory": memory, "failures": load.failures[:3] + load.cut[:3]}
    finally:
        hydra.send_signal(signal.SIGTERM)
        hydra.wait(120)


def _pct(xs: list[float], p: float) -> float:
    """The p-th percentile, nearest rank (of 50 samples, p99 is their max)."""
    xs = sorted(xs)
    return xs[max(0, min(len(xs) - 1, math.ceil(len(xs) * p / 100) - 1))] if xs else \
        float("nan")


def resident(args: argparse.Namespace) -> int:
    names = args.pair.split(",")
    src = Path(args.profiles_dir) if args.profiles_dir else None
    with tempfile.TemporaryDirectory(prefix="hydra-bench-resident-") as d:
        tmp = Path(d)
        results = []
        rows = args.rows.split(",")
        for label, standby, keep in (("standby", True, False),
                                     ("standby+keep_slots", True, True),
                                     ("reload (no standby)", False, False)):
            if label.split()[0] not in rows:
                continue
            pdir = _variant(src, tmp / label.split()[0], names, standby, keep)  # type: ignore
            results.append(_one_variant(label.split()[0], names, pdir, tmp, args.switches,
                                        args.node, standby))
    print(f"\nresident switch {names[0]} <-> {names[1]}: {args.switches} switches each way "
          "per row, under a steady streaming + plain client; time = switch request (control "
          "API) -> first token of a new streaming request served by the target")
    print(f"{'row':20} {'to':18} {'p50 ms':>8} {'max ms':>8} {'flip p50 ms':>11} "
          f"{'failed':>6} {'cut':>4}")
    p50s = {}
    for r in results:
        times = r["times"]
        assert isinstance(times, dict)
        flips = r["flips"]
        assert isinstance(flips, dict)
        for target, ts in times.items():
            p50 = statistics.median(ts) * 1000
            p50s[(r["label"], target)] = p50
            fl = flips[target]
            flip = f"{statistics.median(fl) * 1000:11.2f}" if fl else f"{'-':>11}"
            print(f"{r['label']!s:20} {target:18} {p50:8.1f} {max(ts) * 1000:8.1f} {flip} "
                  f"{r['failed']!s:>6} {r['cut']!s:>4}")
    print("\nthe switch's own cost: (switch -> first token) - the target's own TTFT (the same "
          "request once it serves steadily), ms")
    print(f"{'row':20} {'to':18} {'flips':>5} {'own p50':>8} {'p50':>8} {'p95':>8} "
          f"{'p99':>8} {'max':>8}")
    for r in results:
        times, own = r["times"], r["own"]
        assert isinstance(times, dict) and isinstance(own, dict)
        every: list[float] = []
        for target, ts in [*times.items(), ("both ways", None)]:
            if ts is None:
                extra, mine = every, [x for o in own.values() for x in o]
            else:
                extra = [(t - o) * 1000 for t, o in zip(ts, own[target], strict=True)]
                every += extra
                mine = own[target]
            print(f"{r['label']!s:20} {target:18} {len(extra):5} "
                  f"{statistics.median(mine) * 1000:8.1f} {_pct(extra, 50):8.1f} "
                  f"{_pct(extra, 95):8.1f} {_pct(extra, 99):8.1f} {max(extra):8.1f}")
    for r in results:
        slots = r["slots"]
        assert isinstance(slots, list)
        if slots:
            print(f"keep_slots: save + restore of the slots per flip p50 "
                  f"{statistics.median(slots) * 1000:.1f} ms, max {max(slots) * 1000:.1f} ms")
    for target in names:
        a, b = p50s.get(("standby", target)), p50s.get(("reload", target))
        if a and b:
            print(f"to {target}: standby p50 / reload p50 = {a:.1f} / {b:.1f} ms = "
                  f"{a / b:.3f} ({b / a:.0f}x faster)")
    for r in results:
        for line in r["memory"]:  # type: ignore[attr-defined]
            print(f"{r['label']}: {line}")
        for f in r["failures"]:  # type: ignore[attr-defined]
            print(f"  {r['label']} failed: {f}")
    return 0 if all(r["failed"] == 0 and r["cut"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
