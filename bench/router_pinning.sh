#!/usr/bin/env bash
# Issue 30: this tree's bench/router.py part h
# (CPU per event) at 32 and 64 streams with the routers' threads on one CPU (router_cpus: auto, the
# daemon's default) and not (HYDRA_ROUTER_CPUS=all), then part f (first byte), pinned. No --quick:
# 6 rounds of h, 300 + 150 one-stream trials and 20 rounds of 64 in f.
#   [PY=python3] bench/router_pinning.sh > out.txt   # from the root
set -u
PY=${PY:-$PWD/.venv/bin/python}
[ -x "$PY" ] || PY=python3
for cpus in auto all; do
  for s in 32 64; do
    echo "=== part h, $s streams, HYDRA_ROUTER_CPUS=$cpus ==="
    HYDRA_ROUTER_CPUS=$cpus $PY bench/router.py --parts h --streams $s 2>&1 | grep -E "^part h|^\(h\)"
  done
done
echo "=== part f, HYDRA_ROUTER_CPUS=auto ==="
$PY bench/router.py --parts f 2>&1 | grep -E "^part f|^\(f\)"
