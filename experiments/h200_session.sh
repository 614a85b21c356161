#!/usr/bin/env bash
# One phase of the paper sweeps on the H200, inside a device call (see experiments/README.md,
# "Running on the H200"): stage the target first (call with .stage/a), then call this with carry
# [".whl", ".device", ".stage/b", ".stage/regen"]:
#   bash .device/run_on_device.sh bash experiments/h200_session.sh ttt    # TTT sweep (14 runs at once)
#   bash .device/run_on_device.sh bash experiments/h200_session.sh moe    # MoE sweep (8 at once) + data regeneration (4)
# Each sweep stops itself before the 10-minute call limit (timeout); the same call again continues
# it while the machine is warm: trained runs in /tmp/runs are only evaluated, and rows already in
# the committed CSVs (copied to $OUT first) are skipped. Commit the CSVs that come back in $OUT.
# EVAL_DEVICE=cuda evaluates on the GPU, one run at a time, instead of on the host's CPU cores;
# TRAIN_ARGS replaces the sweeps' extra train.py flags (default "--pad-to-max-len"; part of the scale).
set -uo pipefail
PHASE=${1:?usage: h200_session.sh ttt|moe}
T=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
LIMIT=${LIMIT:-540}
EVAL=(--eval-device "${EVAL_DEVICE:-cpu}" --runs-dir /tmp/runs)
[[ -n ${TRAIN_ARGS:-} ]] && EVAL+=("--train-args=$TRAIN_ARGS")  # e.g. TRAIN_ARGS="--pad-to-max-len --attention flex_buf"
[[ -f $T ]] || { echo "no staged target at $T: make the .stage/a call first"; exit 1; }
python3 -c "from models.target import resolve_target as r; r('$T')" > /dev/null 2>&1 || { echo "GGUF conversion failed"; exit 1; }
for f in ttt_scaling moe_drafts data_regen; do
  [[ -f experiments/results/$f.csv && ! -f $OUT/$f.csv ]] && cp experiments/results/$f.csv $OUT/
done
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; uptime; sleep 20; done) > $OUT/smi.log 2>&1 &
SMI=$!
case $PHASE in
  ttt)  # ~102 GB at once with TTT 13; data_regen does not fit beside it
    timeout $LIMIT python3 experiments/ttt_scaling.py --target $T --parallel 14 --csv $OUT/ttt_scaling.csv "${EVAL[@]}" > $OUT/ttt.log 2>&1 ;;
  moe)
    if [[ ! -d /tmp/runs/data_regen/data ]]; then
      mkdir -p /tmp/runs/data_regen && tar xzf .stage/regen/data.tgz -C /tmp/runs/data_regen || { echo "carry .stage/regen (README step 2)"; exit 1; }
    fi
    timeout $LIMIT python3 experiments/moe_drafts.py --target $T --parallel 8 --csv $OUT/moe_drafts.csv "${EVAL[@]}" > $OUT/moe.log 2>&1 &
    P=$!
    timeout $LIMIT python3 experiments/data_regen.py --target $T --parallel 4 --csv $OUT/data_regen.csv "${EVAL[@]}" > $OUT/regen.log 2>&1
    wait $P ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
kill $SMI
(cd /tmp && tar czf $OUT/runs_$PHASE.tgz --exclude='*.safetensors' --exclude='*.pt' --exclude='tb' --exclude='data' runs 2>/dev/null)
grep -h "tau\|FAILED\|budget\|done in" $OUT/*.log | cut -c1-300
