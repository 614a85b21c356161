#!/usr/bin/env bash
# Issue 32's offline comparison on one GPU, with no staged model (the verifier has random weights):
# experiments/speculators_anchor.py, speculators' own trainer against train.py --features (its defaults, then
# one packed row a step like theirs). One call, made from the CPU machine after `bash tools/speculators_wheels.sh`:
#   carry [".device", ".whl-spec", and from .whl the wheels of tyro, docstring_parser, typeguard, datasets, dill,
#          multiprocess] (the repository ~52 MiB + these ~8 MiB stay under a call's 64 MiB; all of .whl would not),
#   command `bash .device/run_on_device.sh bash experiments/h200_anchor.sh [the anchor's flags]`.
# The Qwen3-30B-A3B shape (an H200: its weights alone are 57 GiB on the GPU): `--preset qwen3-30b-a3b --heads-only`,
# the verifier's embeddings, final norm and lm_head on disk (1.2 GB) and its layers drawn by capture.py on the GPU,
# since its 61 GB of weights would fill the machine's disk.
# A call cut at LIMIT keeps the rows written so far ($OUT/speculators_anchor_h200.jsonl); /tmp/speculators_anchor
# lasts ~30 s after the call, so a call made at once reuses the verifier, the store and their data dir (pass
# --trainers / --ours for the runs left).
set -uo pipefail
TOK=${ANCHOR_TOK:-/tmp/anchor_tok}  # the tokenizer unzipped
mkdir -p $TOK
cp .whl-spec/tokenizer/* $TOK/
[[ -f $TOK/tokenizer.json.gz ]] && gunzip -f $TOK/tokenizer.json.gz
(while true; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 10; done) \
  > $OUT/smi_anchor.log 2>&1 &
SMI=$!
timeout -k 10 ${LIMIT:-555} python3 experiments/speculators_anchor.py --tokenizer $TOK \
  --out $OUT/speculators_anchor_h200.jsonl "$@" > $OUT/anchor.log 2>&1
echo "anchor exit $?" >> $OUT/anchor.log
(cd /tmp/speculators_anchor && tar czf $OUT/anchor_logs.tgz *.log nanospec_*/run.json nanospec_*/metrics.jsonl 2>/dev/null)
kill $SMI 2>/dev/null
tail -c 2500 $OUT/anchor.log
