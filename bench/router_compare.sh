#!/usr/bin/env bash
# Issue 30 item 3: this tree's bench/router.py part h (SSE streams through the request-aware leg, the byte
# relay and direct, a stand-in upstream) on the code before the body pump and on this tree,
# alternated in one run, at 1, 32 and 64 concurrent streams; then part f (first byte) on each.
#   staged (ignored): build/r30/base = `git archive c31cf50 hydra_supervisor bench`
#   [PY=python3] [ROUNDS=2] [QUICK=--quick] bench/router_compare.sh > out.txt   # from the root
set -u
PY=${PY:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
base=${BASE:-build/r30/base}  # another tree to compare with: BASE=DIR
cp bench/router.py $base/bench/router.py  # one bench for both trees: only the router differs
for r in $(seq ${ROUNDS:-2}); do
  for streams in 1 32 64; do
    for t in base after; do
      d=$([ $t = base ] && echo $base || echo .)
      echo "=== round $r, $streams streams, $t ==="
      (cd $d && PYTHONPATH=$PWD:${PYTHONPATH:-} $PY bench/router.py --parts h ${QUICK---quick} \
          --streams $streams 2>&1 | grep -E "^part h|^\(h\)")
    done
  done
  # Part f: time to a stream's first byte, many samples (1 back to back, 1 after a pause,
  # 64 at once), each tree's router against direct in its own interleaved run.
  for t in base after; do
    d=$([ $t = base ] && echo $base || echo .)
    echo "=== round $r, first byte, $t ==="
    (cd $d && PYTHONPATH=$PWD:${PYTHONPATH:-} $PY bench/router.py --parts f ${QUICK---quick} \
        2>&1 | grep -E "^part f|^\(f\)")
  done
done
