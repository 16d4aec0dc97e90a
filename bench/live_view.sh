#!/usr/bin/env bash
# The operator's live view and hands, as an operator checks them (issue 29's "Done when"), on the
# real llama-server: prints what each step showed. Takes ~2 minutes on a 2-core machine.
#   bench/live_view.sh            (from the repository root; .venv from ./scripts/bootstrap)
# 1. one stream decoding through `hydra up -p demo --metrics-port M`: `hydra status --json`'s
#    lane (inflight, tokens_per_s, generated_tokens), the dashboard's /api/history, then the
#    request on record (`hydra status --requests --json`);
# 2. `hydra unload demo` on `hydra up -p demo -p demo-moe`, then a request for demo;
# 3. `hydra bench -p demo -n 2` with hydra on a non-default port;
# 4. bad ports (--port 99999, --metrics-port equal to --port, a metrics port in use);
# 5. `hydra plan` of a profile with `server_args: {no-such-flag: 1}`.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
hydra() { "$py" -m hydra_supervisor "$@"; }
st=$(mktemp -d); export HYDRA_STATE_DIR=$st
free() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; rm -rf "$st"; }
trap cleanup EXIT
start() {  # start hydra up ARGS in the background; wait for ready:
  hydra up "$@" > "$st/up.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 600); do grep -q '^ready:' "$st/up.log" && return 0; sleep 0.2; done
  echo "hydra up $* did not get ready:"; cat "$st/up.log"; exit 1
}
stop() { hydra down > /dev/null 2>&1; wait "${pids[@]}" 2>/dev/null; pids=(); }
chat() {  # chat PORT MODEL MAX_TOKENS STREAM
  curl -s --max-time 300 "http://127.0.0.1:$1/v1/chat/completions" \
    -H 'Content-Type: application/json' \
    -d "{\"model\":\"$2\",\"max_tokens\":$3,\"stream\":$4,\"messages\":[{\"role\":\"user\",\"content\":\"Tell me a long story about the sea.\"}]}"
}

show() {  # show WHAT < JSON: one line per item (the readings this script prints)
  "$py" - "$1" 3<&0 <<'PY'
import json, os, sys
what = sys.argv[1]
d = json.load(os.fdopen(3))
if what == "lanes":
    for p in d["daemon"]["ports"]:
        for l in p["lanes"]:
            print(f"   status --json: port {p['port']} lane {l['profile']}: state={l['state']} "
                  f"inflight={l['inflight']} queued={l['queued']} "
                  f"tokens_per_s={l['tokens_per_s']} generated_tokens={l['generated_tokens']}")
elif what == "history":
    for name, s in d["series"].items():
        print(f"   /api/history {name}: last 5 points tokens/s {s['tokens_per_s'][-5:]}, "
              f"in flight {s['inflight'][-5:]}")
elif what == "request":
    for r in d[-1:]:
        print(f"   the request on record: {r['profile']} status {r['status']} ended {r['ended']} "
              f"ttft_s={r['ttft_s']} prompt={r['prompt_tokens']} "
              f"generated={r['generated_tokens']} decode_tps={r['decode_tps']} "
              f"duration_s={r['duration_s']}")
elif what == "reply":
    print("   a request for demo after: " + (
        "finish_reason " + d["choices"][0]["finish_reason"] if "choices" in d else str(d)))
PY
}

echo "== 1. live load while one stream decodes (hydra up -p demo --metrics-port M)"
port=$(free); mport=$(free)
start -p demo --port "$port" --metrics-port "$mport"
chat "$port" demo 400 true > /dev/null &
cpid=$!
sleep 3
hydra status --json | show lanes
curl -s "http://127.0.0.1:$mport/api/history" | show history
wait $cpid
hydra status --requests --json | show request
stop

echo "== 2. hydra unload demo on hydra up -p demo -p demo-moe"
port=$(free)
start -p demo -p demo-moe --port "$port"
chat "$port" demo-moe 4 false > /dev/null
states() { hydra status --json | show lanes; }
states
echo "   \$ hydra unload demo"; hydra unload demo | sed 's/^/   /'; echo "   (exit $?)"
states
chat "$port" demo 4 false | show reply
states
stop

echo "== 3. hydra bench -p demo -n 2, hydra on a non-default port"
port=$(free)
start -p demo --port "$port"
hydra bench -p demo -n 2 --max-tokens 16 --prompt-words 20 2>&1 | sed 's/^/   /'
echo "   (exit ${PIPESTATUS[0]}; hydra serves on $port)"
stop

echo "== 4. bad ports: exit status and what is printed"
port=$(free)
for args in "--port 99999" "--port $port --metrics-port $port"; do
  echo "   \$ hydra up -p demo $args"
  hydra up -p demo $args 2>&1 | sed 's/^/   /'; echo "   (exit ${PIPESTATUS[0]})"
done
"$py" -c 'import socket,time,sys; s=socket.socket(); s.bind(("127.0.0.1",int(sys.argv[1]))); s.listen(); time.sleep(30)' "$port" &
holder=$!; sleep 0.5
echo "   \$ hydra up -p demo --metrics-port $port   (held by another process)"
hydra up -p demo --port "$(free)" --metrics-port "$port" 2>&1 | sed 's/^/   /'; echo "   (exit ${PIPESTATUS[0]})"
kill $holder; wait $holder 2>/dev/null

echo "== 5. hydra plan of a profile with server_args: {no-such-flag: 1}"
mkdir -p "$st/p"
printf 'profile: bad\nmodel: gemma3-270m\nserver_args:\n  no-such-flag: 1\n' > "$st/p/bad.yaml"
hydra plan -p "$st/p/bad.yaml" 2>&1 | sed 's/^/   /'; echo "   (exit ${PIPESTATUS[0]})"
