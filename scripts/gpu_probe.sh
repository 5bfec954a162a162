#!/usr/bin/env bash
# Issue 38's one prepared GPU call (at most ~8 minutes): every phase has its own time limit and writes its JSON
# into $OUT as soon as it ends, so a phase that hangs or fails costs only its own time.
#
#   WHEELS=.whl OUT=/tmp/p bash scripts/gpu_probe.sh            # every phase (wheels: bash scripts/gpu_wheels.sh .whl)
#   bash scripts/gpu_probe.sh info step-uniform                  # some phases
#   bash scripts/gpu_probe.sh --dry-run                          # list the phases, their limits and commands
#
# Phases (limit in seconds):
#   setup 40         missing dependencies from local wheels (WHEELS), redraft importable from this checkout
#   info 30          device, copy bandwidth, bf16 matmul rate                    -> info.json
#   kernels 75       the new kernels' tests compiled (norms, QK-norm/rotary, split-KV, alignment, launch budget,
#                    swap-AB MoE tiles, activations quantised once per token)    -> kernels.xml
#   step-uniform 100 the step at batch 1 / 8 / 64, uniform routing, random block, kernel-class breakdown
#                                                                                -> step_uniform.json
#   step-model 55    the same at batch 1 with the model's routing and an all-MASK block (the old, collapsed case)
#                                                                                -> step_model.json
#   moe-sweep 80     the fused MoE's configurations in CUDA graphs (four per cell around the seeds, the unswapped
#                    16-row tile among them), token counts outer, both formats per count; writes
#                    kernels/moe_configs/<device>.json and moe_sweep.json after every cell
#                                                                                -> moe_sweep.json
#   attention 35     split-KV against the unsplit kernel and SDPA, contexts 1k and 8k, batch 1 / 8 / 64
#                                                                                -> attention.json
#   fp8 60           the MoE layer at 32 tokens and the batch-1 step, FP8 against bf16, with the swept table
#                    (the layer's JSON written before the steps, then after each) -> fp8.json
# step-uniform and step-model time the old decision (full logits, the step on the host) and the new one (inside
# the graph) side by side.
# ---- the decision inside the CUDA graph (issue 38 item 3; opt-in, it would take the call past 8 minutes):
#   graph-decision 60  greedy tokens with graphs == without; steady steps: 0 H2D and 1 D2H memcpy (profiler) and
#                      one synchronizing call (set_sync_debug_mode) each       -> graph_decision.json
#   bash scripts/gpu_probe.sh graph-decision
set -u
OUT=${OUT:-gpu-out}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's redraft, whatever is installed
DRY=0
phases=()
for a in "$@"; do
    if [ "$a" = "--dry-run" ]; then DRY=1; else phases+=("$a"); fi
done
[ ${#phases[@]} -eq 0 ] && phases=(setup info kernels step-uniform step-model moe-sweep attention fp8)
mkdir -p "$OUT"
status="$OUT/status.txt"
NEW_TESTS="tests/test_norm_kernels.py tests/test_launch_budget.py tests/test_attention_kernel.py tests/test_moe_kernel.py
  tests/test_fp8.py::test_quantize_act_triton_is_the_twin_bit_for_bit tests/test_fp8.py::test_fp8_moe_swapped_and_plain_16_row_tiles"
STEP="benchmarks/bench_gpu_step.py --skip-prefill --profile --iters 20 --warmup 3"

limit_of() {
    case $1 in
        setup) echo 40 ;; info) echo 30 ;; kernels) echo 75 ;; step-uniform) echo 100 ;; step-model) echo 55 ;;
        moe-sweep) echo 80 ;; attention) echo 35 ;; fp8) echo 60 ;;
        graph-decision) echo 60 ;;  # (the decision inside the graph)
        *) echo 0 ;;
    esac
}

command_of() {
    case $1 in
        setup) echo "setup_wheels" ;;
        info) echo "$PY -c 'import sys, json, torch; sys.path.insert(0, \"benchmarks\"); import bench_gpu_step as g;
p = torch.cuda.get_device_properties(0); bw = g.measure_copy_bandwidth(10); mm = g.measure_matmul_rate(torch.bfloat16, 10);
d = dict(device=torch.cuda.get_device_name(0), sms=p.multi_processor_count, torch=torch.__version__,
         copy_bw=bw, mm_rate=mm); print(d); json.dump(d, open(\"$OUT/info.json\", \"w\"))'" ;;
        kernels) echo "$PY -m pytest -q -p no:cacheprovider -m 'kernels and not slow' -x --junitxml $OUT/kernels.xml $NEW_TESTS -k 'norm or launch or split or align or route or fused or quantize_act_triton'" ;;
        step-uniform) echo "$PY $STEP --routing uniform --block random --batches 1,8,64 --skip-attention --json-out $OUT/step_uniform.json" ;;
        step-model) echo "$PY $STEP --routing model --block mask --batches 1 --skip-attention --json-out $OUT/step_model.json" ;;
        moe-sweep) echo "$PY benchmarks/moe_config_sweep.py --write --tokens 32,128,512,2048 --iters 10 --out $OUT/moe_sweep.json" ;;
        attention) echo "$PY $STEP --batches 1,8,64 --attn-contexts 1024,8192 --skip-steps --json-out $OUT/attention.json" ;;
        fp8) echo "$PY benchmarks/bench_moe.py --tokens 32 --methods auto --json-out $OUT/fp8.json" ;;
        graph-decision) echo "$PY scripts/gpu_graph_decision_check.py --json-out $OUT/graph_decision.json" ;;
    esac
}

setup_wheels() {
    if [ -n "${WHEELS:-}" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$WHEELS"/*.whl || return 1
    fi
    PYTHONPATH=/tmp/site:$PYTHONPATH $PY -c "import redraft.engine, redraft.kernels.norm_triton; print('redraft imports')"
}

run_phase() {  # name
    local name=$1 limit cmd t0=$SECONDS rc
    limit=$(limit_of "$name")
    cmd=$(command_of "$name")
    if [ "$limit" = 0 ]; then echo "unknown phase $name" | tee -a "$status"; return; fi
    if [ $DRY = 1 ]; then printf '%-13s %4ss  %s\n' "$name" "$limit" "$cmd"; return; fi
    echo "=== $name (limit ${limit}s): $cmd" >>"$OUT/$name.log"
    if [ "$name" = setup ]; then
        timeout -k 5 "$limit" bash -c "$(declare -f setup_wheels); PY='$PY' WHEELS='${WHEELS:-}' setup_wheels" \
            >>"$OUT/$name.log" 2>&1
    else
        PYTHONPATH=/tmp/site:$PYTHONPATH timeout -k 5 "$limit" bash -c "$cmd" >>"$OUT/$name.log" 2>&1
    fi
    rc=$?
    echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$status"
    printf '{"phase": "%s", "rc": %d, "seconds": %d}\n' "$name" "$rc" "$((SECONDS - t0))" >"$OUT/$name.status.json"
    tail -n 15 "$OUT/$name.log"
}

total=0
for phase in "${phases[@]}"; do
    total=$((total + $(limit_of "$phase")))
    run_phase "$phase"
done
if [ $DRY = 1 ]; then echo "total limit ${total}s"; exit 0; fi
cp docs/gpu.md "$OUT/gpu.md" 2>/dev/null
cp kernels/moe_configs/*.json "$OUT/" 2>/dev/null
cat "$status"
