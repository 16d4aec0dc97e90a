#!/usr/bin/env bash
# hydra's memory once `hydra up -p demo` is ready, started with an empty modelinfo cache (so the
# daemon reads the GGUF header itself), for each tree given: VmHWM (peak) and VmRSS (what it
# keeps). Issue 31 item 9: the code before the header reader (c31cf50) against this tree:
#   git archive c31cf50 hydra_supervisor profiles | tar -x -C build/r30/base
#   bench/up_rss.sh build/r30/base .                  # from the root
set -u
root=$PWD
for tree in "$@"; do
  tree=$(cd "$tree" && pwd)
  d=$(mktemp -d /tmp/uprss.XXXX)
  mkdir -p $d/cache $d/state
  for x in ${XDG_CACHE_HOME:-$HOME/.cache}/hydra/*; do  # the llama.cpp build and models, not modelinfo
    [ "$(basename $x)" = modelinfo ] || ln -s $x $d/cache/
  done
  port=$(python3 -c "import socket;s=socket.socket();s.bind(('127.0.0.1',0));print(s.getsockname()[1])")
  (cd $tree && HYDRA_CACHE_DIR=$d/cache HYDRA_STATE_DIR=$d/state PYTHONPATH=$tree \
     setsid ${PY:-$root/.venv/bin/python} -m hydra_supervisor up -p demo --port $port \
     > $d/up.log 2>&1) &
  for _ in $(seq 600); do grep -q "ready:" $d/up.log && break; sleep 0.5; done
  pid=$(pgrep -f "hydra_supervisor up -p demo --port $port" | head -1)
  sleep 2
  echo "$tree: $(grep -c ready: $d/up.log) ready; hydra $(grep -E 'VmHWM|VmRSS' /proc/$pid/status | tr -s ' \t' ' ' | tr '\n' ' ')"
  kill -INT $pid; sleep 3; rm -rf $d
done
