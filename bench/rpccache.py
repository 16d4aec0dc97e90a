#!/usr/bin/env python3
"""What does pre-filling ggml-rpc-server's tensor cache buy? (rpccache.py; docs/multi-host.md
"Weights over the wire".)

On one synthetic F16 model whose weight matrices are over the 10 MiB threshold:
1. `rpccache.prefill` into an empty dir, with no memo of hashes (hash + copy), then again (all
   present): seconds and MB/s;
2. a CPU llama-server loading the model with every layer on a ggml-rpc-server -c (`--rpc`,
   `-ngl 99`) through a counting relay, three times: cold (empty cache), warm (the cache that
   load wrote, new rpc-server), pre-filled (a new rpc-server whose cache prefill wrote): bytes
   the head sent the peer, and time from spawn to /health 200.
Loopback only: the bytes are the figure; the times are this machine's, not a network's.

    .venv/bin/python bench/rpccache.py [--layers 8 --embd 1024 --ff 8192] [--load-mode none]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor.plan.ports import free_port  # noqa: E402
from hydra_supervisor.testing.rpcrelay import CountingRelay, wait_port  # noqa: E402
from hydra_supervisor.testing.synthhelp import running_server  # noqa: E402
from hydra_supervisor.tools import rpccache, rpchash, synth  # noqa: E402
from hydra_supervisor.tools.install import BuildOptions, bin_dir  # noqa: E402

MB = 1e6


def rpc_server(cache_root: Path, log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {**os.environ, "LLAMA_CACHE": str(cache_root), "GGML_NO_BACKTRACE": "1"}
    with open(log, "wb") as logf:
        proc = subprocess.Popen([str(bin_dir(BuildOptions()) / "ggml-rpc-server"), "-H",
                                 "127.0.0.1", "-p", str(port), "-c"], env=env, stdout=logf,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    wait_port(port, proc, log)
    return proc, port


def load(model: Path, port: int, log: Path, extra: tuple[str, ...],
         ngl: tuple[str, ...] = ("-ngl", "99")) -> tuple[int, float]:
    """Bytes the head sent the peer, and spawn to /health 200; `{rpc}` in `extra` is the
    peer's endpoint as the head sees it (for -ot ...=RPC0[{rpc}])."""
    relay = CountingRelay(("127.0.0.1", port))
    endpoint = f"127.0.0.1:{relay.port}"
    try:
        t0 = time.monotonic()
        with running_server(bin_dir(BuildOptions()) / "llama-server", model, log,
                            extra=("--rpc", endpoint, *ngl,
                                   *(a.replace("{rpc}", endpoint) for a in extra))):
            took = time.monotonic() - t0
        return relay.up, took
    finally:
        relay.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=1024)
    ap.add_argument("--ff", type=int, default=8192)
    ap.add_argument("--load-mode", default=None,
                    help="the head's llama-server --load-mode (auto, none, mmap, dio, ...)")
    args = ap.parse_args()
    extra = ("--load-mode", args.load_mode) if args.load_mode else ()
    with tempfile.TemporaryDirectory(prefix="hydra-rpccache-bench-") as tmp_s:
        tmp = Path(tmp_s)
        rpccache.own_dir = lambda: tmp / "memo"  # type: ignore[method-assign]  # no old memo
        model = synth.write_dense(tmp / "m.gguf", n_layers=args.layers, n_embd=args.embd,
                                  n_ff=args.ff, n_head=8, n_head_kv=4, ctx=512, seed=7)
        size = model.stat().st_size
        plan = rpccache.plan(model)  # also warms the page cache for what follows
        (tmp / "memo").rename(tmp / "memo.old")
        t0 = time.monotonic()
        rpccache.tensor_extents(model)
        header_s = time.monotonic() - t0
        arr = rpchash.mapped(str(model))
        t0 = time.monotonic()
        for e in plan.entries:
            rpchash.hash_extent(arr, e.offset, e.size)
        hash_s = time.monotonic() - t0
        del arr
        t0 = time.monotonic()
        plan = rpccache.plan(model)
        plan_s = time.monotonic() - t0
        print(f"model {size / MB:.0f} MB, {plan.tensors} of {plan.tensors_total} tensors over "
              f"10 MiB ({plan.bytes / MB:.0f} MB)")
        print(f"hash (FNV-1a 64, {'C' if rpchash._build_native() else 'pure Python'}, page "
              f"cache warm): {hash_s:.2f} s, {plan.bytes / MB / hash_s:.0f} MB/s; GGUF header "
              f"parse {header_s:.2f} s; plan() with no memo {plan_s:.2f} s")
        (tmp / "memo").rename(tmp / "memo.2")
        res = rpccache.prefill(model, tmp / "pre" / "rpc")
        print(f"prefill, no memo, empty dir: {res.seconds:.2f} s, "
              f"{res.bytes_written / MB / res.seconds:.0f} MB/s ({res.written} files)")
        again = rpccache.prefill(model, tmp / "pre" / "rpc")
        print(f"prefill again (all present): {again.seconds * 1000:.0f} ms, "
              f"{again.written} written")

        rows = []
        for tag, root in (("cold", tmp / "srv"), ("warm (its own cache)", tmp / "srv"),
                          ("pre-filled", tmp / "pre")):
            proc, port = rpc_server(root, tmp / f"rpc-{len(rows)}.log")
            try:
                sent, took = load(model, port, tmp / f"head-{len(rows)}.log", extra)
            finally:
                proc.terminate()
                proc.wait(timeout=10)
            rows.append((tag, sent, took))
        print(f"head: llama-server --rpc -ngl 99 {' '.join(extra)}; "
              "bytes head -> peer, spawn to /health 200:")
        for tag, sent, took in rows:
            print(f"  {tag:22s} {sent / MB:9.1f} MB  {took:6.2f} s")


if __name__ == "__main__":
    main()
