#!/usr/bin/env bash
# Issue 32 on one H200: train.py with its default options, as a user with a GPU runs it, in one device call
# (stage the model first: experiments/h200_scale.sh's header says how; carry [".whl", ".device", ".stage/qI"]):
#   NANOSPEC_COMMIT=<sha> bash .device/run_on_device.sh bash experiments/h200_defaults.sh
# 1. the README's main job (`train.py --strategy eagle3 --target <the GGUF>`, every other option default): its
#    wall time from start, the GGUF conversion and cold compile caches included;
# 2. every packaged chat with the defaults for FULL_S seconds (--time-limit) under experiments/stall_probe.py:
#    real tokens/s at the budget the defaults choose on this GPU, compiled graphs at the first and last step (no
#    recompiles after warm-up), torch.compile's time per phase at exit.
# 3. ONLY=8b (not run unless named): the Llama-3.1-8B shape (random weights, tools/random_target.py; ~1 min) with
#    the defaults at --max-len 4096 and a draft vocabulary of 32,000, 40 steps, as on an 80 GiB GPU
#    (--gpu-memory ${GPU_GIB:-79}: the allocator capped at what an 80 GB card offers, 79.2 GiB on an H100, which
#    refuses 80): the budget the defaults choose and the peak
#    (issue 32's goal: the 8B default run within 80 GiB).
# 4. ONLY="harness30b 30b" (not run unless named): the same for the Qwen3-30B-A3B shape, the harness at
#    HARNESS_BATCH_30B (4: SpecForge's) and train.py's defaults with no memory cap (its weights alone are 57 GiB:
#    an H200's run). Its target is written without weights (tools/random_target.py --no-weights: 61 GB would fill
#    the machine's disk) and drawn on the GPU when train.py loads it. Neither needs the staged model: carry
#    [".device", ".whl", ".whl-spec/tokenizer"] and TOKENIZER=.whl-spec/tokenizer (tools/speculators_wheels.sh).
# ONLY="main" (or "main_noeval", "main_flexbuf", "full", "full_eager", "harness8b", "8b", "8b_compile", "harness30b",
# "30b") runs
# those named. The runs go one after the other with nothing else on the GPU (nvidia-smi every 5 s to smi.log); each one's log,
# run.json and metrics.jsonl come back in $OUT.
set -uo pipefail
T=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
staged() { [[ -f $T ]] || { echo "no staged target at $T (ONLY=${ONLY:-main full})"; exit 1; }; }
for r in ${ONLY:-main full}; do [[ $r == *30b ]] || staged; done  # the 30B runs need no staged model
if [[ -n ${TOKENIZER:-} && -f $TOKENIZER/tokenizer.json.gz ]]; then  # .whl-spec/tokenizer travels gzipped
  mkdir -p /tmp/tokenizer && cp $TOKENIZER/* /tmp/tokenizer/ && gunzip -f /tmp/tokenizer/tokenizer.json.gz
  TOKENIZER=/tmp/tokenizer
fi
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 5; done) > $OUT/smi.log 2>&1 &
SMI=$!
run() {  # name, train.py flags...
  local name=$1; shift
  local t0=$SECONDS
  # a new user's machine: no converted model, no compile caches, new for every call (on 2026-12-04 a second call
  # found the first one's in a fixed directory, and the main job's cold start went unmeasured)
  local fresh; fresh=$(mktemp -d /tmp/fresh_${name}_XXXX)
  NANOSPEC_CACHE=$fresh TORCHINDUCTOR_CACHE_DIR=$fresh/inductor TRITON_CACHE_DIR=$fresh/triton \
  timeout -k 10 ${RUN_S:-280} python3 ${PROBE[$name]} \
    --target ${TARGET:-$T} --out /tmp/defaults_$name --overwrite --no-progress "$@" > $OUT/${name}_default.log 2>&1
  echo "$name rc=$? wall_s=$((SECONDS - t0))" | tee -a $OUT/${name}_default.log
  cp /tmp/defaults_$name/run.json $OUT/${name}_run.json; cp /tmp/defaults_$name/metrics.jsonl $OUT/${name}_metrics.jsonl
  grep -a "batching\|\[time\]\|\[data\] --batch\|eval @\|step 80\|compile\|error" $OUT/${name}_default.log | cut -c1-300 | tail -12
}
# the main job plain (under stall_probe it ended in a segfault at 90 s on 2026-12-04: its watchdog thread is the
# suspect, experiments/stall_probe.py); every chat under the probe, for torch.compile's times
declare -A PROBE=([main]=train.py [main_noeval]=train.py [main_flexbuf]=train.py [full]="experiments/stall_probe.py --stacks $OUT/stacks_full.txt --every 30 --")
[[ " ${ONLY:-main full} " == *" main "* ]] && run main --strategy eagle3
# ONLY=main_noeval: the same cold job without the evaluation before the first step (what that evaluation's
# shapes cost in compiling: its log's [time] line beside main's)
[[ " ${ONLY:-main full} " == *" main_noeval "* ]] && run main_noeval --strategy eagle3 --no-eval-at-start
# ONLY=main_flexbuf: the same cold job with --attention flex_buf (one flex shape for the whole TTT unroll: one
# compile forward and one backward instead of 7 + 7 at TTT 7; its log's [time] line beside main's)
[[ " ${ONLY:-main full} " == *" main_flexbuf "* ]] && run main_flexbuf --strategy eagle3 --attention flex_buf
# full: 20,000 steps planned, past --compile-after (2,000), so the defaults compile the draft step (since 2026-12-06;
# on 2026-12-05 that was ONLY=full_compile's --compile: results/defaults_h100_run2/); ONLY=full_eager: the same
# run with --compile-after 0, the eager step, beside it
[[ " ${ONLY:-main full} " == *" full "* ]] && run full --num-records 0 --steps 20000 --time-limit ${FULL_S:-150}
PROBE[full_eager]=${PROBE[full]/stacks_full/stacks_full_eager}
[[ " ${ONLY:-main full} " == *" full_eager "* ]] && run full_eager --num-records 0 \
  --steps 20000 --time-limit ${FULL_S:-150} --compile-after 0
# ONLY=harness8b: issue 32's harness on the same shape (experiments/throughput.py, compiled target, SpecForge's
# batch of 8 rows of 4,096, no search), for the 8B row back to back with it: "harness8b 8b" in one call or two.
# HARNESS_BATCH=4 on an 80 GiB GPU (8 rows need ~84 GiB; 2026-12-05 on an H100: results/defaults_h100/)
harness() {  # name, preset, rows a step
  local t0=$SECONDS
  timeout -k 10 ${RUN_S_H:-360} python3 experiments/throughput.py --target $2 --backends compiled \
    --batch-size $3 --no-search --no-attn-bench --out $OUT/$1.jsonl --figure $OUT/$1.png > $OUT/$1.log 2>&1
  echo "$1 rc=$? wall_s=$((SECONDS - t0))" | tee -a $OUT/$1.log
  cut -c1-400 $OUT/$1.jsonl 2>/dev/null | tail -3
}
[[ " ${ONLY:-main full} " == *" harness8b "* ]] && harness harness8b llama-3.1-8b ${HARNESS_BATCH:-8}
# ONLY=8b_compile: the same 8B run with --compile (1.34x the eager step for SmolLM2 on an H100, ~86 s more of
# compiling: results/defaults_h100_run2/), which the defaults do for runs of --compile-after (2,000) steps or more:
# whether that threshold suits this shape
for r8 in 8b 8b_compile; do
  [[ " ${ONLY:-main full} " == *" $r8 "* ]] || continue
  R8B=/tmp/llama8b
  [[ -f $R8B/config.json ]] || python3 tools/random_target.py llama-3.1-8b $R8B --tokenizer $T > $OUT/random_target.log 2>&1
  PROBE[$r8]=train.py
  TARGET=$R8B RUN_S=${RUN_S_8B:-420} run $r8 --num-records 4000 --max-len 4096 --steps 40 --log-every 5 \
    --draft-vocab-size 32000 --holdout 8 --gpu-memory ${GPU_GIB:-79} $([[ $r8 == 8b_compile ]] && echo --compile)
done
[[ " ${ONLY:-main full} " == *" harness30b "* ]] && harness harness30b qwen3-30b-a3b ${HARNESS_BATCH_30B:-4}
if [[ " ${ONLY:-main full} " == *" 30b "* ]]; then
  R30B=/tmp/qwen30b
  [[ -f $R30B/config.json ]] || python3 tools/random_target.py qwen3-30b-a3b $R30B --no-weights \
    --tokenizer ${TOKENIZER:-$T} > $OUT/random_target_30b.log 2>&1
  PROBE[30b]=train.py
  TARGET=$R30B RUN_S=${RUN_S_30B:-420} run 30b --num-records 4000 --max-len 4096 --steps 40 --log-every 5 \
    --draft-vocab-size 32000 --holdout 8 ${GPU_GIB_30B:+--gpu-memory $GPU_GIB_30B}
fi
kill $SMI 2>/dev/null
ls -la $OUT
(cd $OUT && tar czf /tmp/defaults_out.tgz . && rm -rf ./* && mv /tmp/defaults_out.tgz .)  # one file comes back
