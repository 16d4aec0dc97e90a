#!/usr/bin/env python3
"""What an NVML reading costs: a session of its own (init + query + shutdown, what every status
snapshot paid before issue 31) vs through one held initialisation (devices.Nvml, what the
daemon does now), and whether an init/shutdown pair is cheap while another init is held (NVML
counts its initialisations: only the last shutdown tears down). Needs a GPU and pynvml.

    python3 bench/nvml_refcount.py [--n 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hydra_supervisor.plan import devices  # noqa: E402
from hydra_supervisor.proc import gpumem  # noqa: E402


def timed(fn: Callable[[], object], n: int) -> str:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000)
    return f"p50 {statistics.median(ts):8.3f} ms  max {max(ts):8.3f} ms  (n={n})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20)
    n = ap.parse_args().n
    import pynvml

    def pair() -> None:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()

    print("init + shutdown, nothing held:        ", timed(pair, n))
    print("used_by_pid(), a session of its own:  ", timed(gpumem.used_by_pid, n))
    nvml = devices.Nvml()
    gpumem.used_by_pid(nvml)  # opens it
    print("used_by_pid(nvml), held:              ", timed(lambda: gpumem.used_by_pid(nvml), n))
    print("init + shutdown while one is held:    ", timed(pair, n))
    print("used_by_pid(), own session, one held: ", timed(gpumem.used_by_pid, n))
    nvml.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
