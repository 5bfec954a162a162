#!/usr/bin/env bash
# One GPU session's worth of checks and benchmarks, in the order that gives the most per minute of device time.
#
#   bash scripts/gpu_bringup.sh                        # every phase
#   bash scripts/gpu_bringup.sh kernels step           # some phases
#   WHEELS=wheels bash scripts/gpu_bringup.sh setup    # install redraft's missing dependencies from local wheels
#       (on a machine without a package index: fetch them beforehand with `bash scripts/gpu_wheels.sh wheels`)
#
# Phases: setup, info, kernels, step, engine, moe, serve, serve-overlap, llada22. Logs, JSON and the updated docs/gpu.md go to $OUT (default
# ./gpu-out). Each phase has its own time limit, so one hang cannot eat the others' time; a phase's failure is
# recorded and the next one runs.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(setup info kernels step engine moe serve)
# the kernel suites by name: collecting every module would need the test-only packages (playwright, ...)
KERNEL_TESTS="tests/test_attention_kernel.py tests/test_moe_kernel.py tests/test_fp8.py tests/test_vocab_top1.py
              tests/test_engine_triton.py tests/test_block_routing.py"
status="$OUT/status.txt"

run_phase() {  # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "=== $name (limit ${limit}s): $*" | tee -a "$OUT/$name.log"
    timeout -k 10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name rc=$rc ${SECONDS}s-${t0}s=$((SECONDS - t0))s" | tee -a "$status"
    tail -n 25 "$OUT/$name.log"
}

setup() {
    if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl || return 1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    $PY -c "import redraft.engine, redraft.server.http_server; print('redraft imports')"
}

info() {
    nvidia-smi
    $PY -c "import torch, triton; p = torch.cuda.get_device_properties(0); print(torch.__version__, torch.version.cuda,
triton.__version__, torch.cuda.get_device_name(0), p.multi_processor_count, 'SMs', round(p.total_memory / 2**30, 1), 'GiB')"
    git log -1 --format='commit %H %s' 2>/dev/null || true
}

serve_bench() {
    local dir=/tmp/llada2.1-mini-dummy port=30000
    $PY -c "import sys; sys.path.insert(0, 'benchmarks'); from bench_gpu_step import write_model_dir
write_model_dir('$dir', 'mini')" || return 1
    $PY -m redraft serve --device cuda --kernel-backend triton --load-format dummy --model "$dir" --port $port \
        --max-running-requests 128 --cuda-graph-max-bs 128 --log-level info ${SERVE_FLAGS:-} \
        >"$OUT/serve${SERVE_TAG:-}_server.log" 2>&1 &
    local pid=$!
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        kill -0 $pid 2>/dev/null || { echo "server exited"; return 1; }
        sleep 1
    done
    echo "server ready after ${SECONDS}s"
    curl -s "http://127.0.0.1:$port/metrics" >"$OUT/metrics${SERVE_TAG:-}_before.txt"
    $PY -m redraft bench --base-url "http://127.0.0.1:$port" --concurrency ${SERVE_CONCURRENCY:-1 8 32 64 128} --num-requests 128 \
        --max-seconds ${SERVE_SECONDS:-25} --grace-seconds 10 --output-len 64 64 --ignore-eos --modes S --json "$OUT/serve${SERVE_TAG:-}_bench.json"
    local rc=$?
    curl -s "http://127.0.0.1:$port/metrics" >"$OUT/metrics${SERVE_TAG:-}_after.txt"
    kill -TERM $pid
    wait $pid
    return $rc
}

for phase in "${phases[@]}"; do
    case $phase in
        setup) setup >"$OUT/setup.log" 2>&1; echo "setup rc=$?" | tee -a "$status"; tail -n 5 "$OUT/setup.log" ;;
        info) run_phase info 60 bash -c "$(declare -f info); info" ;;
        kernels) run_phase kernels "${KERNELS_LIMIT:-200}" $PY -m pytest -q -m kernels -n 8 -p no:cacheprovider \
                     --timeout $(( ${KERNELS_LIMIT:-200} - 20 )) -rfE $KERNEL_TESTS ;;
        step) run_phase step "${STEP_LIMIT:-200}" $PY benchmarks/bench_gpu_step.py --write-docs \
                  --json-out "$OUT/step.json" ${STEP_ARGS:-} ;;
        llada22) run_phase llada22 "${LLADA22_LIMIT:-90}" $PY scripts/gpu_llada22_check.py ;;
        engine) run_phase engine "${ENGINE_LIMIT:-150}" $PY benchmarks/bench_gpu_engine.py \
                  --json-out "$OUT/engine.json" ${ENGINE_ARGS:-} ;;
        moe) run_phase moe "${MOE_LIMIT:-170}" $PY benchmarks/bench_moe.py --write-docs \
                 --json-out "$OUT/moe.json" ${MOE_ARGS:-} ;;
        serve) run_phase serve "${SERVE_LIMIT:-240}" bash -c "$(declare -f serve_bench); OUT='$OUT' PY='$PY' serve_bench" ;;
        serve-overlap) run_phase serve-overlap "${SERVE_LIMIT:-240}" bash -c "$(declare -f serve_bench); OUT='$OUT' PY='$PY' \
                           SERVE_FLAGS='--enable-overlap' SERVE_TAG=-overlap serve_bench" ;;
        *) echo "unknown phase $phase" ;;
    esac
done
cp docs/gpu.md "$OUT/gpu.md" 2>/dev/null
cat "$status"
