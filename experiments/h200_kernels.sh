#!/usr/bin/env bash
# Issue 3's open H200 measurements in one device call (~5-8 minutes), meant for the `.stage/a` call
# that stages the target anyway (experiments/README.md, "Running on the H200"):
#   bash .device/run_on_device.sh bash experiments/h200_kernels.sh
# 1. SpecForge's protocol: one attention call, the last TTT step's, our flex vs their dense eager.
# 2. The whole TTT-7 unroll at seq 4096 under a few flex kernel settings (the 20x time goal).
# Rows go to $OUT/kernels.jsonl (append them to experiments/results/kernels_h200.jsonl), the
# printed tables to $OUT/kernels.log. Every configuration is its own process under a timeout, so a
# setting the kernel refuses costs only its own row.
set -uo pipefail
J=$OUT/kernels.jsonl
L=$OUT/kernels.log
timeout 150 python3 experiments/bench_kernels.py --only call --max-len 4096 --ttt-length 1 3 7 --out $J >> $L 2>&1
for opts in '{"BLOCK_M": 128, "BLOCK_N": 128}' '{"BLOCK_M": 64, "BLOCK_N": 64}' '{"num_stages": 2}' '{"ROWS_GUARANTEED_SAFE": true}'; do
  echo "== kernel_options $opts" >> $L
  timeout 90 python3 experiments/bench_kernels.py --only attn --max-len 4096 --ttt-length 7 --attention flex \
    --flex-kernel-options "$opts" --out $J >> $L 2>&1 || echo "failed or timed out: $opts" >> $L
done
grep -h "^ttt_\|^name\|==\|failed" $L
