#!/usr/bin/env python3
"""Across hosts (issue 22's benchmark): two hosts as network namespaces joined by a 1 Gbit link
(`tc ... tbf`, testing/netns.py), each with its own `hydra up` and state dir. In one run, side by
side:

1. `hydra up` to ready (all engines READY, the "ready:" line printed) on the head host for
   - SOLO (the model on the head host's CPU alone): the reference, ratio 1.00;
   - COMBINE (dense layer split) whose peer is the other host's lent CPU (`mode: peer` there),
     with the peer's ggml-rpc-server cache (`-c`, its own LLAMA_CACHE):
       cold       the cache emptied before each start: every weight crosses the link;
       warm       the cache a previous load filled: the head sends hashes for tensors > 10 MiB;
       pre-filled the cache emptied, then filled on the peer host from its own copy of the GGUF
                  (hydra_supervisor/tools/rpccache.py's prefill; the row says "not available" where
                  that module is missing) before the start;
2. decode tokens/s (llama-server's own `timings.predicted_per_second`, through the head's
   router) of that cross-host COMBINE against the same COMBINE with both processes on the head
   host (a local ggml-rpc-server hydra starts itself); and, to split the cross-host cost, the
   head connected straight to a bare ggml-rpc-server on the peer host (no hydra, no router
   relay there: not a supported setup, ggml-RPC has no authentication).

Targets (issue 22): pre-filled within 1.5x of warm; cross-host decode within 0.95 of same-host.

`--tls` (issue 32 item 7) measures instead what TLS between the hosts costs: a second peer
hydra on the peer host whose profile has `tls:` (its router takes TLS only; certificates made
by openssl, testing/tlscerts.py), and beside the plain `far` COMBINE a `far-tls` one whose
device has `tls:` (the head's llama-server through hydra's local tunnel). Interleaved runs of
each: `hydra up` to ready with the peer's cache emptied (cold: every weight crosses the link,
encrypted) and warm, and decode tokens/s; medians, TLS / plain.

    sudo .venv/bin/python bench/multihost.py [--model gemma3-270m] [--runs 3] [--rate 1gbit]
        [--burst 1mb] [--decode-only | --tls]

`--burst` is the tbf bucket: the default 1mb lets each token's messages through at veth speed
once the bucket has refilled between tokens; a small one (64kb, one veth GSO segment) charges
every byte at `--rate`. `--decode-only` measures just the two decode rows (cross-host and
same-host COMBINE), for a quick look at a link model.

Needs root (namespaces). Threads 1 per process: on a 2-core machine the head and the peer get a
core each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from hydra_supervisor.testing.harness import make_env, run_hydra  # noqa: E402
from hydra_supervisor.testing.netns import Hosts, NsUp, why_unavailable  # noqa: E402
from hydra_supervisor.testing.tlscerts import make_certs  # noqa: E402

try:
    from hydra_supervisor.tools import rpccache
except ImportError:  # another change adds it; the pre-filled row then says "not available"
    rpccache = None  # type: ignore[assignment]

PEER_PORT, HEAD_PORT, BARE_PORT, TLS_PORT = 8090, 8080, 50052, 8091
ARGS = ("server_args: {ctx-size: 2048, threads: 1, chat-template: gemma, no-jinja: true,"
        " n-predict: 64}\n")


class Bench:
    def __init__(self, net: Hosts, tmp: Path, model: str, split: str, tls: bool = False
                 ) -> None:
        self.net, self.tmp, self.model, self.split = net, tmp, model, split
        for d in ("peer", "head", *(("peer-tls",) if tls else ())):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        self.cache = tmp / "peer" / "llama-cache"
        self.peer_env = make_env(tmp / "peer")
        self.peer_env["LLAMA_CACHE"] = str(self.cache)
        endpoint = f"{net.addr('peer')}:{PEER_PORT}"
        bare = f"{net.addr('peer')}:{BARE_PORT}"
        devices = ("devices:\n  far: {endpoint: '" + endpoint +
                   "', allow_build_mismatch: true}\n  bare: {endpoint: '" + bare + "'}\n")
        lend = ("mode: peer\nhead: cpu-peer\nhost: 0.0.0.0\n"
                f"rpc_allow: ['{net.addr('head')}/32']\nserver_args: {{threads: 1}}\n")
        self.tls_env: dict[str, str] | None = None
        if tls:  # a second peer hydra, TLS only, sharing the rpc cache dir
            certs = make_certs(tmp / "certs", ["peer", "head"])

            def files(name: str) -> str:
                f = certs[name]
                return f"{{ca: '{f.ca}', cert: '{f.cert}', key: '{f.key}'}}"
            devices += (f"  far-tls: {{endpoint: '{net.addr('peer')}:{TLS_PORT}', "
                        f"allow_build_mismatch: true, tls: {files('head')}}}\n")
            (tmp / "peer-tls" / "lend.yaml").write_text(
                f"profile: lend-tls\n{lend}port: {TLS_PORT}\ntls: {files('peer')}\n")
            self.tls_env = make_env(tmp / "peer-tls")
            self.tls_env["LLAMA_CACHE"] = str(self.cache)
        self.head_env = make_env(tmp / "head", devices)
        (tmp / "peer" / "lend.yaml").write_text(f"profile: lend\n{lend}port: {PEER_PORT}\n")
        common = f"model: {model}\nhead: cpu\nhost: 0.0.0.0\nport: {HEAD_PORT}\n{ARGS}"
        self.profiles = {
            "solo": f"profile: solo\nmode: solo\n{common}",
            "far": f"profile: far\nmode: combine\npeers: [far]\nsplit: {split}\n{common}",
            "near": f"profile: near\nmode: combine\npeers: [cpu-peer]\nsplit: {split}\n{common}",
            "bare": f"profile: bare\nmode: combine\npeers: [bare]\nsplit: {split}\n{common}",
        }
        if tls:
            self.profiles["far-tls"] = (f"profile: far-tls\nmode: combine\npeers: [far-tls]\n"
                                        f"split: {split}\n{common}")
        for name, text in self.profiles.items():
            (tmp / "head" / f"{name}.yaml").write_text(text)
        self.peer: NsUp | None = None
        self.tls_peer: NsUp | None = None
        self.per_token: list[float] = []  # link bytes per token predicted, one per decode()

    def start_peer(self) -> None:
        self.peer = NsUp(self.net, "peer", self.peer_env,
                         ["--profile", str(self.tmp / "peer" / "lend.yaml")], self.tmp / "peer")
        self.peer.wait_ready(60)
        if self.tls_env is not None:
            self.tls_peer = NsUp(self.net, "peer", self.tls_env,
                                 ["--profile", str(self.tmp / "peer-tls" / "lend.yaml")],
                                 self.tmp / "peer-tls")
            self.tls_peer.wait_ready(60)

    def start_bare(self) -> subprocess.Popen[bytes]:
        """A ggml-rpc-server on the peer host bound to its address, no hydra, no router: what
        the router's relay costs per token is the difference to the `far` row."""
        from hydra_supervisor.tools import binaries

        exe = str(binaries.find("ggml-rpc-server").path)
        proc = self.net.popen("peer", [exe, "-H", "0.0.0.0", "-p", str(BARE_PORT), "-t", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def listening() -> bool:
            return self.net.run("peer", ["ss", "-ltn", f"sport = :{BARE_PORT}"],
                                check=False).stdout.count("LISTEN") > 0
        deadline = time.monotonic() + 30
        while not listening():
            if time.monotonic() > deadline:
                raise SystemExit("the bare ggml-rpc-server did not listen")
            time.sleep(0.1)
        return proc

    def up(self, name: str, then: Callable[[], Any] | None = None) -> tuple[float, Any]:
        """Seconds from `hydra up` to ready on the head host; `then()` runs while it serves."""
        t0 = time.monotonic()
        up = NsUp(self.net, "head", self.head_env,
                  ["--profile", str(self.tmp / "head" / f"{name}.yaml")], self.tmp / "head")
        try:
            up.wait_ready(300)
            took = time.monotonic() - t0
            return took, then() if then is not None else None
        finally:
            up.stop()
            up.kill_everything()

    def decode(self, runs: int) -> float:
        """Median decode tokens/s over `runs` completions of 64 tokens (after one warm-up);
        also notes the bytes the head host's link carried (both ways) per token predicted."""
        tokens = 0

        def one() -> float:
            nonlocal tokens
            r = requests.post(f"http://127.0.0.1:{HEAD_PORT}/completion", timeout=300,
                              json={"prompt": "Once upon a time", "n_predict": 64,
                                    "temperature": 0, "cache_prompt": False})
            r.raise_for_status()
            tokens += int(r.json()["tokens_predicted"])
            return float(r.json()["timings"]["predicted_per_second"])

        def body() -> float:
            one()  # warm-up
            nonlocal tokens
            tokens = 0
            before = self.link_bytes()
            tps = statistics.median(one() for _ in range(runs))
            self.per_token.append((self.link_bytes() - before) / max(tokens, 1))
            return tps
        return self.net.call("head", body)

    def link_bytes(self) -> int:
        """Bytes the head host's eth0 has sent and received (the link to the peer host)."""
        out = self.net.run("head", ["cat", "/sys/class/net/eth0/statistics/tx_bytes",
                                    "/sys/class/net/eth0/statistics/rx_bytes"]).stdout
        return sum(int(v) for v in out.split())

    def empty_cache(self) -> None:
        """The files go, not the directory: the running rpc-server made it at its start and
        writes no cache into one made after (a removed directory silently stops the cache)."""
        for f in (self.cache / "rpc").glob("*"):
            if f.is_file():
                f.unlink()

    def model_path(self) -> Path:
        res = run_hydra(self.head_env, "plan", "--profile",
                        str(self.tmp / "head" / "solo.yaml"), "--json")
        if res.returncode != 0:
            raise SystemExit(f"hydra plan: {res.stderr}")
        return Path(json.loads(res.stdout)["model_path"])


def _cache_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*") if f.is_file()) if d.is_dir() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--split", default="[9, 9]", help="COMBINE split, peer first")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--burst", default="1mb", help="tbf burst (bucket) on each host's link")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--decode-only", action="store_true",
                      help="only the decode rows (COMBINE cross-host vs same-host)")
    mode.add_argument("--tls", action="store_true",
                      help="TLS vs plain between the hosts: load (cold, warm) and decode")
    a = ap.parse_args()
    why = why_unavailable()
    if why:
        print(f"bench/multihost.py: {why}", file=sys.stderr)
        return 2
    med = statistics.median
    with tempfile.TemporaryDirectory(prefix="hydra-multihost-") as t, \
            Hosts(["head", "peer"], rate=a.rate, burst=a.burst) as net:
        b = Bench(net, Path(t), a.model, a.split, tls=a.tls)
        b.start_peer()
        if a.tls:
            return _tls_bench(a, b)
        gguf = b.model_path()
        rows: dict[str, list[float]] = {"solo": [], "cold": [], "warm": [], "prefilled": []}
        sent: dict[str, list[int]] = {"cold": [], "warm": [], "prefilled": []}
        prefill_s: list[float] = []
        decode: dict[str, list[float]] = {"near": [], "far": [], "bare": []}
        far_bytes: list[float] = []  # the head host's link, both ways, per token predicted
        bare = None if a.decode_only else b.start_bare()
        for i in range(a.runs):  # interleaved, so a busy moment does not fall on one row
            print(f"run {i + 1}/{a.runs} ...", file=sys.stderr, flush=True)
            if a.decode_only:
                decode["far"].append(b.up("far", lambda: b.decode(a.runs))[1])
                far_bytes.append(b.per_token[-1])
                decode["near"].append(b.up("near", lambda: b.decode(a.runs))[1])
                continue
            rows["solo"].append(b.up("solo")[0])
            b.empty_cache()
            rows["cold"].append(b.up("far")[0])
            sent["cold"].append(_cache_bytes(b.cache / "rpc"))
            took, tps = b.up("far", lambda: b.decode(a.runs))
            rows["warm"].append(took)
            decode["far"].append(tps)
            far_bytes.append(b.per_token[-1])
            if rpccache is not None:
                b.empty_cache()
                t0 = time.monotonic()
                rpccache.prefill(gguf, b.cache / "rpc")
                prefill_s.append(time.monotonic() - t0)
                rows["prefilled"].append(b.up("far")[0])
            decode["near"].append(b.up("near", lambda: b.decode(a.runs))[1])
            decode["bare"].append(b.up("bare", lambda: b.decode(a.runs))[1])
        if bare is not None:
            bare.kill()
            bare.wait(10)
        assert b.peer is not None
        b.peer.stop()
        b.peer.kill_everything()

    print(f"bench/multihost.py: {a.model}, COMBINE split {a.split} (peer first), head and peer "
          f"on 1 thread each, link {a.rate} (tbf burst {a.burst}), {a.runs} runs interleaved, "
          "medians")
    print()
    if a.decode_only:
        _decode_rows(a.rate, decode)
        _link_row(far_bytes)
        return 0
    solo = med(rows["solo"])
    print(f"{'hydra up -> ready on the head host':<52}{'seconds':>9}{'x SOLO':>9}   runs")
    lines = [("SOLO on the head host", "solo"),
             ("COMBINE, peer on the other host, cold cache", "cold"),
             ("COMBINE, peer on the other host, warm cache", "warm"),
             ("COMBINE, peer on the other host, pre-filled", "prefilled")]
    for label, key in lines:
        vals = rows[key]
        if not vals:
            print(f"{label:<52}{'not available (no hydra_supervisor.tools.rpccache)':>30}")
            continue
        runs = ", ".join(f"{v:.2f}" for v in vals)
        print(f"{label:<52}{med(vals):>9.2f}{med(vals) / solo:>9.2f}   {runs}")
    if prefill_s:
        print(f"  (the pre-fill itself, on the peer host before the start: "
              f"{med(prefill_s):.2f} s; cache after a cold load: "
              f"{med(sent['cold']) / 2**20:.0f} MiB)")
    if rows["prefilled"]:
        r = med(rows["prefilled"]) / med(rows["warm"])
        print(f"  pre-filled / warm = {r:.2f} (target <= 1.5)")
    print()
    near, far = _decode_rows(a.rate, decode)
    _link_row(far_bytes)
    bare_tps = med(decode["bare"])
    print(f"{'  same, head straight to a bare ggml-rpc-server':<52}{bare_tps:>9.1f}"
          f"{bare_tps / near:>9.2f}   " + ", ".join(f"{v:.1f}" for v in decode["bare"]))
    print(f"  through the peer's router / straight = {far / bare_tps:.2f}")
    return 0


def _tls_bench(a: argparse.Namespace, b: Bench) -> int:
    """`--tls`: plain and TLS COMBINEs, interleaved; the table (module doc)."""
    med = statistics.median
    rows: dict[str, dict[str, list[float]]] = {
        k: {"cold": [], "warm": [], "decode": []} for k in ("far", "far-tls")}
    try:
        for i in range(a.runs):
            for name in (("far", "far-tls") if i % 2 == 0 else ("far-tls", "far")):
                print(f"run {i + 1}/{a.runs} {name} ...", file=sys.stderr, flush=True)
                b.empty_cache()
                rows[name]["cold"].append(b.up(name)[0])
                took, tps = b.up(name, lambda: b.decode(a.runs))
                rows[name]["warm"].append(took)
                rows[name]["decode"].append(tps)
    finally:
        for peer in (b.peer, b.tls_peer):
            if peer is not None:
                peer.stop()
                peer.kill_everything()
    print(f"bench/multihost.py --tls: {a.model}, COMBINE split {a.split} (peer first), head "
          f"and peer on 1 thread each, link {a.rate} (tbf burst {a.burst}), {a.runs} runs "
          "interleaved, medians")
    print()
    print(f"{'':<44}{'plain':>9}{'TLS':>9}{'TLS/plain':>11}   runs plain | TLS")
    for label, key, fmt in (("hydra up -> ready, cold peer cache (s)", "cold", ".2f"),
                            ("hydra up -> ready, warm peer cache (s)", "warm", ".2f"),
                            ("decode tokens/s (64 tokens, via head router)", "decode", ".1f")):
        p, t = med(rows["far"][key]), med(rows["far-tls"][key])
        runs = (", ".join(f"{v:{fmt}}" for v in rows["far"][key]) + " | "
                + ", ".join(f"{v:{fmt}}" for v in rows["far-tls"][key]))
        print(f"{label:<44}{p:>9{fmt}}{t:>9{fmt}}{t / p:>11.2f}   {runs}")
    return 0


def _link_row(far_bytes: list[float]) -> None:
    print(f"  cross-host: the head host's link carried {statistics.median(far_bytes) / 1024:,.0f}"
          " KiB per token predicted (both ways; runs: "
          + ", ".join(f"{v / 1024:,.0f}" for v in far_bytes) + ")")


def _decode_rows(rate: str, decode: dict[str, list[float]]) -> tuple[float, float]:
    med = statistics.median
    print(f"{'decode tokens/s, 64 tokens, through the head router':<52}{'tok/s':>9}{'ratio':>9}"
          "   runs")
    near, far = med(decode["near"]), med(decode["far"])
    print(f"{'COMBINE, both processes on the head host':<52}{near:>9.1f}{1.0:>9.2f}   "
          + ", ".join(f"{v:.1f}" for v in decode["near"]))
    print(f"{'COMBINE, peer on the other host (' + rate + ')':<52}{far:>9.1f}"
          f"{far / near:>9.2f}   " + ", ".join(f"{v:.1f}" for v in decode["far"]))
    print(f"  cross-host / same-host = {far / near:.2f} (target >= 0.95)")
    return near, far


if __name__ == "__main__":
    raise SystemExit(main())
