#!/usr/bin/env python3
"""Fault-injection summary: runs every scenario of testing/faults.py on real processes
and prints fault, detected after, recovered after, requests lost, orphans.

Rows: head killed / SIGSTOPped, hydra killed -9, crash loop, peer port taken, log dir gone,
degrade, and (issue 8) peer killed while the head loads, frozen peer (SIGSTOP), two peers killed
at once, a remote peer killed and started again, and a burst of 200 requests straight to the
head's internal port (must read "not killed", lost 0).

    .venv/bin/python bench/faults.py [--only kill_head,sigstop_head]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hydra_supervisor.testing.faults import SCENARIOS, FaultResult  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SCENARIOS)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"hydra-fault-{name}-") as d:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            try:
                rows.append(SCENARIOS[name](Path(d)))
            except AssertionError as exc:  # one failed scenario still leaves the others' rows
                rows.append(FaultResult(name, 0.0, None, None, 0, 0,
                                        notes=f"FAILED: {str(exc)[:200]}"))

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}s"

    print(f"\n{'fault':38} {'load':>6} {'detected':>9} {'recovered':>10} {'lost/sent':>10} "
          f"{'orphans':>8}  notes")
    for r in rows:
        print(f"{r.fault:38} {s(r.load_s):>6} {s(r.detected_s):>9} {s(r.recovered_s):>10} "
              f"{r.requests_lost:>4}/{r.requests_sent:<5} {len(r.orphans):>8}  {r.notes}")
    print("\nrecovered = all engines READY again and a completion answered; lost = client "
          "requests (one every 0.25 s, plus the stream in flight) that failed meanwhile "
          "(new requests are held while a head restarts); burst: lost = of the 200 sent")
    return 0 if all(not r.orphans and not r.notes.startswith("FAILED") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
