#!/usr/bin/env python3
"""What do several profiles behind one port (routed by the request's `model`) cost?

`hydra up -p demo -p demo-moe-combine --port 0`, measured in one run and printed side by side:

1. on-demand load overhead, per profile: the raw load time of its layout started by hand (the
   plan's argv: peers, HELLO, head, /health 200; the plan is made before the clock starts and
   readiness is polled every 10 ms) vs the on-demand load through hydra: with the target
   stopped, the time from sending a tiny chat request (max_tokens 1, cache_prompt false) for it
   until its response arrives, minus the median time of that same request once loaded (so
   generation is not counted). overhead = on-demand - raw, median over --rounds (target
   <= 0.5 s). The target is stopped again between rounds by ttl: hydra serves copies of the
   two profiles (same names, same layouts) with `ttl: 1` from a temporary --profiles-dir, and
   every measurement waits until both are stopped;
2. routing latency per request: p50/p99 of POST /tokenize {"model": NAME, "content": "hello"}
   on a keep-alive connection (http.client), sent directly to the profile's head (its internal
   port, from `hydra status --json`) and through the hydra port (routed by model), in
   interleaved blocks so machine noise hits both alike; prints what the routing adds;
3. reloads per minute under an alternating two-client load: a node whose memory (a device file,
   cpu total_mib 1000) fits only one of the two profiles, two keep-alive openai clients (one per
   profile, max_tokens 4) asking in a loop for --duration seconds, once with the node file's
   `defaults: min_resident: 0` and once with 10 (--min-resident); prints loads (beyond the
   start load), reloads/min, requests served and failed, p50/p95 request latency, and whether
   both profiles were ever running at once (polled on /v1/models).

    .venv/bin/python bench/routing.py [--rounds 3] [--requests 400] [--duration 40]
        [--min-resident 0,10] [--parts 1,2,3]

The default run takes about 3-4 minutes on a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
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

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.overhead import spawn_plan, stop_all  # noqa: E402
from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.serve.snapshot import LaneStatus  # noqa: E402
from hydra_supervisor.testing.harness import HYDRA, Up, lanes, make_env, snapshot  # noqa: E402
from hydra_supervisor.testing.harness import wait_until as wait  # noqa: E402

PROFILES = ("demo", "demo-moe-combine")
CHAT = [{"role": "user", "content": "Hi"}]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pct(xs: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of xs."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except requests.RequestException:
        return False


# -- hydra -----------------------------------------------------------------------------------------


class Hydra:
    """One `hydra up -p demo -p demo-moe-combine --port 0` in a directory of its own."""

    def __init__(self, tmp: Path, tag: str, node_extra: str = "", up_args: tuple[str, ...] = (),
                 devices: str | None = None) -> None:
        self.dir = tmp / tag
        self.dir.mkdir()
        self.env = make_env(self.dir, node_extra)
        if devices is not None:
            (self.dir / "devices.yaml").write_text(devices)
            self.env["HYDRA_DEVICES_FILE"] = str(self.dir / "devices.yaml")
        args = [a for p in PROFILES for a in ("-p", p)]
        self.up = Up(self.env, [*args, *up_args, "--port", "0"], self.dir)
        self.port = 0

    def __enter__(self) -> Hydra:
        try:
            self.up.wait_ready(180)
            self.port = snapshot(self.env).ports[0].port
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.up.stop(timeout=60)
        except subprocess.TimeoutExpired:
            log(f"hydra in {self.dir} did not stop within 60s after SIGTERM: killing it")
        finally:
            self.up.kill_everything()

    def alive(self) -> None:
        if self.up.proc.poll() is not None:
            raise SystemExit(f"hydra exited {self.up.proc.returncode}:\n{self.up.output()}")

    def models(self) -> dict[str, str]:
        r = requests.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=10)
        return {m["id"]: m["state"] for m in r.json()["data"]}

    def profiles(self) -> dict[str, LaneStatus]:
        return {lane.profile: lane for lane in lanes(self.env)}

    def wait_state(self, want: dict[str, str], timeout: float) -> None:
        def there() -> bool:
            self.alive()
            got = self.models()
            return all(got.get(k) == v for k, v in want.items())
        wait(there, timeout, f"profiles {want}", 0.05)

    def log_lines(self, pattern: str) -> list[str]:
        path = Path(self.env["HYDRA_STATE_DIR"]) / "logs" / "hydra.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return [ln for ln in text.splitlines() if re.search(pattern, ln)]


def chat(session: requests.Session, port: int, model: str) -> float:
    """A tiny request (max_tokens 1, no prompt cache); its time in seconds."""
    body = {"model": model, "messages": CHAT, "max_tokens": 1, "cache_prompt": False}
    t0 = time.monotonic()
    r = session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=240)
    took = time.monotonic() - t0
    if r.status_code != 200 or not r.json().get("choices"):
        raise SystemExit(f"request for {model} failed: {r.status_code} {r.text[:300]}")
    return took


# -- 1. on-demand load overhead --------------------------------------------------------------------


def make_plan(profile: str, env: dict[str, str]) -> dict[str, Any]:
    res = subprocess.run([*HYDRA, "plan", "-p", profile, "--port", str(free_port()), "--json"],
                         env=env, capture_output=True, text=True, check=True, timeout=120)
    return dict(json.loads(res.stdout))


def raw_load(plan: dict[str, Any], tmp: Path, tag: str) -> float:
    """Start the plan's processes by hand (peers, HELLO, head) until /health answers 200; the
    seconds that took (polled every 10 ms). Everything is stopped before returning."""
    t0 = time.monotonic()
    procs, _ = spawn_plan(plan, tmp, tag, poll=0.01)
    took = time.monotonic() - t0
    stop_all(procs)
    return took


def part_load(tmp: Path, rounds: int) -> list[dict[str, Any]]:
    pdir = tmp / "profiles-ttl"
    pdir.mkdir()
    for name in PROFILES:
        text = (REPO / "profiles" / f"{name}.yaml").read_text()
        (pdir / f"{name}.yaml").write_text(text + "ttl: 1\n")
    (tmp / "plan").mkdir()
    plan_env = make_env(tmp / "plan")
    plans = {p: make_plan(p, plan_env) for p in PROFILES}
    rows: dict[str, dict[str, list[float]]] = {
        p: {"raw": [], "on": [], "warm": [], "load": []} for p in PROFILES}
    with Hydra(tmp, "h-load", up_args=("--profiles-dir", str(pdir))) as h:
        session = requests.Session()
        all_stopped = dict.fromkeys(PROFILES, "stopped")
        h.wait_state(all_stopped, 60)  # the start load of demo unloads after its ttl
        for r in range(rounds):
            for i, prof in enumerate(PROFILES):
                hydra_first = (r + i) % 2 == 1
                for step in ("hydra", "raw") if hydra_first else ("raw", "hydra"):
                    h.wait_state(all_stopped, 60)
                    if step == "raw":
                        rows[prof]["raw"].append(raw_load(plans[prof], tmp, f"{prof}-{r}"))
                        continue
                    on = chat(session, h.port, prof)
                    warm = statistics.median(chat(session, h.port, prof) for _ in range(3))
                    rows[prof]["on"].append(on)
                    rows[prof]["warm"].append(warm)
                log(f"  round {r + 1}/{rounds} {prof}: raw {rows[prof]['raw'][-1]:.2f}s, "
                    f"on-demand {rows[prof]['on'][-1]:.2f}s - {rows[prof]['warm'][-1]:.3f}s "
                    "once loaded")
        for prof in PROFILES:  # hydra's own figure: room + start + ready, from its log
            for ln in h.log_lines(rf"profile {re.escape(prof)} serving after .*on request"):
                m = re.search(r"serving after ([0-9.]+)s", ln)
                if m:
                    rows[prof]["load"].append(float(m.group(1)))
        prof_rows = []
        for prof in PROFILES:
            d = rows[prof]
            ondemand = [o - w for o, w in zip(d["on"], d["warm"], strict=True)]
            over = [o - raw for o, raw in zip(ondemand, d["raw"], strict=True)]
            prof_rows.append({
                "profile": prof, "raw": statistics.median(d["raw"]),
                "on": statistics.median(d["on"]), "warm": statistics.median(d["warm"]),
                "ondemand": statistics.median(ondemand),
                "hydra_log": statistics.median(d["load"]) if d["load"] else float("nan"),
                "overhead": statistics.median(over), "all": over})
        return prof_rows


# -- 2. routing latency ----------------------------------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection; POST /tokenize with a model."""

    def __init__(self, port: int, model: str) -> None:
        self.port = port
        self.body = json.dumps({"model": model, "content": "hello"}).encode()
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.c.connect()
        self.reopened = 0

    def once(self) -> float:
        t0 = time.perf_counter()
        self.c.request("POST", "/tokenize", self.body, {"Content-Type": "application/json"})
        resp = self.c.getresponse()
        data = resp.read()
        took = time.perf_counter() - t0
        if resp.status != 200 or b"tokens" not in data:
            raise SystemExit(f"/tokenize on port {self.port}: {resp.status} {data[:200]!r}")
        if resp.will_close:  # llama-server (cpp-httplib) closes after 100 requests
            self.reopened += 1
            self.c.close()
            self.c.connect()  # outside the timing: only requests on an open connection count
            self.c.request("POST", "/tokenize", self.body, {"Content-Type": "application/json"})
            self.c.getresponse().read()  # and the new connection's first request neither
        return took

    def close(self) -> None:
        self.c.close()


def part_routing(tmp: Path, n: int, block: int) -> dict[str, Any]:
    with Hydra(tmp, "h-route") as h:
        session = requests.Session()
        chat(session, h.port, "demo-moe-combine")  # loads it beside demo
        h.wait_state(dict.fromkeys(PROFILES, "serving"), 60)
        heads = {p: next(x.port for x in e.processes if x.role == "head")
                 for p, e in h.profiles().items()}
        conns = {(path, p): Conn(heads[p] if path == "direct" else h.port, p)
                 for path in ("direct", "hydra") for p in PROFILES}
        times: dict[tuple[str, str], list[float]] = {k: [] for k in conns}
        try:
            for c in conns.values():  # warm: connections open, first-request allocations
                for _ in range(20):
                    c.once()
            for b in range(max(1, n // block)):
                order = ["direct", "hydra"] if b % 2 == 0 else ["hydra", "direct"]
                for path in order:
                    for p in PROFILES:
                        c = conns[(path, p)]
                        times[(path, p)].extend(c.once() for _ in range(block))
            h.alive()
        finally:
            for c in conns.values():
                c.close()
    out: dict[str, Any] = {"n": max(1, n // block) * block, "rows": [], "reopened": {
        path: sum(c.reopened for (pa, _), c in conns.items() if pa == path)
        for path in ("direct", "hydra")}}
    for p in [*PROFILES, "both"]:
        pick = PROFILES if p == "both" else (p,)
        d = [t for q in pick for t in times[("direct", q)]]
        hy = [t for q in pick for t in times[("hydra", q)]]
        out["rows"].append({"profile": p, "d50": pct(d, 50) * 1e3, "d99": pct(d, 99) * 1e3,
                            "h50": pct(hy, 50) * 1e3, "h99": pct(hy, 99) * 1e3})
    return out


# -- 3. reloads under an alternating two-client load -----------------------------------------------


def part_reloads(tmp: Path, min_resident: float, duration: float) -> dict[str, Any]:
    import openai

    tag = f"h-reload-{min_resident:g}"
    with Hydra(tmp, tag, node_extra=f"defaults:\n  min_resident: {min_resident:g}\n",
               devices="cpu:\n  total_mib: 1000\n  threads: 2\n") as h:
        start_loads = sum(e.loads for e in h.profiles().values())
        stop = threading.Event()
        lat: list[float] = []
        served = dict.fromkeys(PROFILES, 0)
        failures: list[str] = []
        most_running = [0]
        lock = threading.Lock()

        def client(model: str) -> None:
            c = openai.OpenAI(base_url=f"http://127.0.0.1:{h.port}/v1", api_key="none",
                              max_retries=0, timeout=150)
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    c.chat.completions.create(model=model, messages=CHAT,  # type: ignore[arg-type]
                                              max_tokens=4)
                    with lock:
                        lat.append(time.monotonic() - t0)
                        served[model] += 1
                except Exception as exc:  # noqa: BLE001 - every failure is a finding
                    with lock:
                        failures.append(f"{model} after {time.monotonic() - t0:.1f}s: {exc!r}")
                    time.sleep(0.5)
            c.close()

        def watcher() -> None:
            while not stop.is_set():
                try:
                    n = sum(s == "serving" for s in h.models().values())
                    most_running[0] = max(most_running[0], n)
                except (requests.RequestException, ValueError, KeyError):
                    pass
                time.sleep(0.25)

        threads = [threading.Thread(target=client, args=(p,), daemon=True) for p in PROFILES]
        threads.append(threading.Thread(target=watcher, daemon=True))
        t0 = time.monotonic()
        for t in threads:
            t.start()
        stop.wait(duration)
        stop.set()
        deadline = time.monotonic() + 180
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic()))
        elapsed = time.monotonic() - t0
        if any(t.is_alive() for t in threads):
            failures.append("a client was still waiting for its response 180s after the end")
        h.alive()
        profs = h.profiles()
        loads = sum(e.loads for e in profs.values()) - start_loads
        return {"min_resident": min_resident, "elapsed": elapsed, "loads": loads,
                "per_min": loads / (elapsed / 60), "served": dict(served),
                "failed": failures, "p50": pct(lat, 50) if lat else float("nan"),
                "p95": pct(lat, 95) if lat else float("nan"),
                "max": max(lat, default=float("nan")), "most_running": most_running[0],
                "unloads": sum(e.unloads for e in profs.values())}


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="on-demand loads per profile")
    ap.add_argument("--requests", type=int, default=400,
                    help="/tokenize requests per profile and path (direct, through hydra)")
    ap.add_argument("--block", type=int, default=50, help="requests per interleaved block")
    ap.add_argument("--duration", type=float, default=40.0,
                    help="seconds of the two-client load, per min_resident")
    ap.add_argument("--min-resident", default="0,10",
                    help="node defaults min_resident values for part 3 (comma-separated)")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run")
    ap.add_argument("--keep", metavar="DIR", default=None,
                    help="work in DIR and keep it (hydra's state dirs and logs); default: a "
                         "temporary directory, removed at the end")
    args = ap.parse_args()
    parts = {int(x) for x in args.parts.split(",")}
    t_start = time.monotonic()
    load_rows: list[dict[str, Any]] = []
    route: dict[str, Any] = {}
    reloads: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = Path(args.keep)
            tmp.mkdir(parents=True)
        else:
            tmp = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="hydra-bench-routing-")))
        if 1 in parts:
            log("1. on-demand load overhead ...")
            load_rows = part_load(tmp, args.rounds)
        if 2 in parts:
            log("2. routing latency ...")
            route = part_routing(tmp, args.requests, args.block)
        if 3 in parts:
            for mr in (float(x) for x in args.min_resident.split(",")):
                log(f"3. two alternating clients, min_resident {mr:g}s, {args.duration:g}s ...")
                reloads.append(part_reloads(tmp, mr, args.duration))

    ok = True
    if load_rows:
        print(f"\n1. on-demand load through hydra vs the same layout started by hand "
              f"(median of {args.rounds}; the target is stopped between rounds by `ttl: 1` "
              "copies of the profiles)")
        print(f"{'profile':18} {'raw load':>8} {'1st req':>8} {'loaded':>7} {'on-demand':>9} "
              f"{'hydra log':>9} {'overhead':>8}  per round")
        for r in load_rows:
            each = " ".join(f"{x:+.2f}" for x in r["all"])
            print(f"{r['profile']:18} {r['raw']:8.2f} {r['on']:8.2f} {r['warm']:7.3f} "
                  f"{r['ondemand']:9.2f} {r['hydra_log']:9.2f} {r['overhead']:+8.2f}  {each}")
            ok &= r["overhead"] <= 0.5
        print("on-demand = 1st request (profile stopped) - the same request once loaded; "
              "hydra log = its own 'serving after' figure;\noverhead = on-demand - raw load "
              f"(target <= 0.5 s) -> {'met' if ok else 'NOT met'}")
    if route:
        print(f"\n2. routing latency: POST /tokenize with a model on a keep-alive connection, "
              f"{route['n']} per profile and path, interleaved blocks of {args.block} (ms)")
        print(f"{'profile':18} {'direct p50':>10} {'p99':>7} {'hydra p50':>10} {'p99':>7} "
              f"{'added p50':>10} {'p99':>7}")
        for r in route["rows"]:
            print(f"{r['profile']:18} {r['d50']:10.3f} {r['d99']:7.3f} {r['h50']:10.3f} "
                  f"{r['h99']:7.3f} {r['h50'] - r['d50']:+10.3f} {r['h99'] - r['d99']:+7.3f}")
        ro = route["reopened"]
        print(f"connections closed by the server and reopened (outside the timing): direct "
              f"{ro['direct']}, through hydra {ro['hydra']}")
    if reloads:
        print(f"\n3. two clients alternating (one per profile, max_tokens 4) on a node that "
              f"fits one profile (device file cpu total_mib 1000), {args.duration:g}s each")
        print(f"{'min_resident':>12} {'run s':>5} {'loads':>5} {'reloads/min':>11} "
              f"{'served':>9} {'failed':>6} {'p50 s':>6} {'p95 s':>6} {'max s':>6} "
              f"{'both running':>12}")
        for r in reloads:
            served = "+".join(str(v) for v in r["served"].values())
            both = "never" if r["most_running"] <= 1 else "SEEN"
            print(f"{r['min_resident']:>11g}s {r['elapsed']:5.1f} {r['loads']:5d} "
                  f"{r['per_min']:11.1f} {served:>9} {len(r['failed']):6d} {r['p50']:6.2f} "
                  f"{r['p95']:6.2f} {r['max']:6.2f} {both:>12}")
            for f in r["failed"][:5]:
                print(f"  failed (min_resident {r['min_resident']:g}): {f}")
            ok &= not r["failed"] and r["most_running"] <= 1
        print("run s = from the clients' start until their last response (the requests "
              "in flight at the end are waited for);\nloads = sum of the profiles' "
              "fleet.loads minus the start load; reloads/min = loads / run; served = "
              f"{' + '.join(PROFILES)}")
    print(f"\nbench wall time {time.monotonic() - t_start:.0f}s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
