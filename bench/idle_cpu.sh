#!/usr/bin/env bash
# hydra's own CPU while its head decodes and while it idles: `hydra up -p PROFILE` from the
# tree TREE (a checkout of this repository), six /completion requests of 64 tokens, then 15 s
# idle; prints the hydra process's utime+stime (clock ticks, 10 ms each) for both.
#   bench/idle_cpu.sh /path/to/tree PORT [PROFILE]     (run it on two trees to compare)
set -euo pipefail
tree=$(cd "$1" && pwd); port=$2; profile=${3:-demo-combine}
py=${PYTHON:-$tree/.venv/bin/python}
[ -x "$py" ] || py=$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python
st=$(mktemp -d)
cd "$tree"
HYDRA_STATE_DIR=$st PYTHONPATH=$tree "$py" -m hydra_supervisor up -p "$profile" --port "$port" \
  > "$st/out.log" 2>&1 &
pid=$!
trap 'kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; rm -rf "$st"' EXIT
for _ in $(seq 120); do
  grep -q '^ready:' "$st/out.log" && break
  sleep 0.5
done
sleep 3
ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
a=$(ticks); t0=$(date +%s.%N)
for _ in 1 2 3 4 5 6; do
  curl -s "localhost:$port/completion" -d '{"prompt":"Hello there","n_predict":64}' >/dev/null
done
b=$(ticks); t1=$(date +%s.%N)
sleep 15
c=$(ticks)
echo "$tree ($profile): hydra CPU during 6 completions: $((b - a)) ticks over" \
  "$(echo "$t1 - $t0" | bc) s; 15 s idle: $((c - b)) ticks"
