#!/usr/bin/env bash
# Issue 33's planning probe for a session with too little device time to train a family to its budget (the runs
# do not outlive the machine): what each unmeasured setting's step costs, in time and memory, at the study's batch
# (families.py: 32,768 tokens a step), in the groups a later session would run at once. The packaged v3 chats, no
# generation; each group trains GROUP_S seconds (start-up included) and stops with a checkpoint; nothing is evaluated.
# After staging (h200_scale.sh's header), carrying the last part:
#   bash .device/run_on_device.sh bash experiments/families_probe.sh
# $OUT: one archive, families_probe.tgz (a call brings back at most 8 files; 2026-12-07's first run lost all but
# 8 of its 20): probe_<group>.log, per run its run.json, train.log and metrics.jsonl, smi.log (nvidia-smi).
set -uo pipefail
shopt -s nullglob
T=${TARGET:-/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf}
[[ -e $T ]] || { echo "no staged target at $T"; exit 1; }
GROUP_S=${GROUP_S:-200}
# dflash-specforge (13x dflash's trained slots a step: unknown cost) beside peagle, the pair a session runs first;
# then the five small settings at once
# (GROUP_A= or GROUP_B= set empty: that group is skipped)
GROUPS_=("${GROUP_A-dflash-specforge peagle}" "${GROUP_B-dflash-dpace domino dspark eagle3.1 eagle3-lk}")
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 10; done) > $OUT/smi.log 2>&1 &
SMI=$!
disown $SMI
i=0
for g in "${GROUPS_[@]}"; do
  i=$((i + 1)); n=$(wc -w <<< "$g"); ((n)) || continue
  echo "# group $i: $g ($(date -u +%T))" >> $OUT/smi.log
  timeout -k 10 $((GROUP_S + 60)) python3 experiments/families.py --target $T --only $g --seeds 0 --parallel $n \
    --time-limit $GROUP_S --budget-minutes 0 --eval-device cuda --runs-dir /tmp/probe$i --csv /tmp/probe$i.csv \
    > $OUT/probe_$i.log 2>&1
  echo "families.py exit $?" >> $OUT/probe_$i.log
  for R in /tmp/probe$i/families/*/; do
    r=$(basename $R)
    for f in run.json train.log metrics.jsonl; do cp $R/$f $OUT/${r}_$f 2>/dev/null; done
  done
  grep -a "^\[families\]" $OUT/probe_$i.log | cut -c1-250 | tail -8
done
kill $SMI 2>/dev/null
(cd $OUT && tar czf /tmp/families_probe.tgz . && rm -rf ./* && mv /tmp/families_probe.tgz .)
