#!/usr/bin/env bash
# The useful default draft on the H200, in device calls made back to back (the machine keeps /tmp
# only while it stays warm, ~30 s after a call): stage the target first (carry .stage/a, command
# `bash .device/run_on_device.sh true`), then carry [".whl", ".device", ".stage/b", ".stage/regen"]:
#   bash .device/run_on_device.sh bash experiments/h200_useful_draft.sh regen   # bench + regenerate (resumes)
#   bash .device/run_on_device.sh bash experiments/h200_useful_draft.sh train   # train + export the draft
# .stage/regen/prompts.jsonl.gz comes from `./dev python experiments/regen_sharegpt.py prepare`.
# Everything worth keeping is written to $OUT (files over 15 MB in parts: `cat X.part* > X`).
set -uo pipefail
PHASE=${1:?usage: h200_useful_draft.sh regen|train}
T=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
W=/tmp/useful  # survives between back-to-back calls
LIMIT=${LIMIT:-560}  # seconds of this call's work (the call itself may run 600)
mkdir -p $W/regen
[[ -f $T ]] || { echo "no staged target at $T: make the .stage/a call first"; exit 1; }
python3 -c "from models.target import resolve_target as r; r('$T')" > /dev/null 2>&1 || { echo "GGUF conversion failed"; exit 1; }
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 15; done) > $OUT/smi_$PHASE.log 2>&1 &
SMI=$!
left() { echo $((LIMIT - SECONDS)); }
parts() {  # $OUT keeps files up to 16 MiB
  local f=$1
  if (($(stat -c %s "$f") > 15000000)); then split -b 15000000 -d "$f" "$f.part" && rm "$f"; fi
}
case $PHASE in
  regen)
    [[ -f $W/regen/prompts.jsonl.gz ]] || cp .stage/regen/prompts.jsonl.gz $W/regen/
    if [[ ! -f $W/regen/bench_done ]]; then
      timeout 200 python3 experiments/regen_sharegpt.py bench --state $W/regen --out-dir $W/regen --target $T \
        --bench-n ${BENCH_N:-256} > $OUT/regen_bench.log 2>&1 && touch $W/regen/bench_done
      cp $W/regen/regen_bench.jsonl $OUT/ 2>/dev/null
    fi
    timeout $(left) python3 experiments/regen_sharegpt.py run --state $W/regen --out-dir $W/regen_out --target $T \
      --time-limit $(($(left) - 45)) >> $OUT/regen_run.log 2>&1
    cp $W/regen_out/regen.provenance.json $W/regen_out/regen.dropped.jsonl $OUT/ 2>/dev/null
    cp $W/regen_out/regen.jsonl.gz $OUT/ && parts $OUT/regen.jsonl.gz
    tail -3 $OUT/regen_run.log ;;
  train)
    D=${DATA:-$W/regen/regen.jsonl}
    [[ -f $D ]] || { echo "no regenerated data at $D: run the regen phase first (same warm machine)"; exit 1; }
    R=${RUN:-$W/run}
    timeout $(($(left) - 40)) python3 train.py --target $T --data $D --num-records 0 --holdout 256 \
      --max-len ${MAX_LEN:-1024} --pad-to-max-len --compile --batch-size ${BATCH:-32} --steps ${STEPS:-2000} \
      --lr ${LR:-3e-3} --eval-every ${EVAL_EVERY:-250} --ckpt-every ${EVAL_EVERY:-250} --out $R ${TRAIN_ARGS:-} \
      > $OUT/train.log 2>&1
    echo "train exit $?"
    python3 export.py $R > $OUT/export.log 2>&1  # the latest checkpoint, bf16, vLLM ids
    cp $R/run.json $R/metrics.jsonl $OUT/ 2>/dev/null
    (cd $R && tar czf $OUT/draft_export.tgz export-vllm) && parts $OUT/draft_export.tgz
    grep -h "eval @\|error" $OUT/train.log | tail -12 ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
kill $SMI 2>/dev/null
ls -la $OUT
