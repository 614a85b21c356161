#!/usr/bin/env bash
# Training options side by side on this CPU at equal steps: issue 23's item 4 at CPU scale (the
# H200 version, at the shipped recipe's scale, is `h200_useful_draft.sh ablate`).
#
# Every variant trains the same EAGLE-3 draft from scratch on the shipped draft's data
# (sharegpt-greedy, all records, the last $HOLDOUT held out) with the recipe's lr, one after another
# with the same seed, so the data order is the same; only the variant's flags differ. On this CPU a
# step of 4 chats at --max-len 384 takes 6-8 s, so 300 steps are ~0.3% of the recipe's tokens.
# Their run.json and metrics.jsonl go to $DEST/<name>/, and one summary line per variant (held-out
# acc_0..6 at the end and mid-way) to $DEST/summary.jsonl.
#
#   bash experiments/cpu_ablate.sh        # STEPS=300 BATCH=4 MAXLEN=384 HOLDOUT=64: 35-45 min per variant
#   VARIANTS="base:|muon:--optimizer muon" bash experiments/cpu_ablate.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-300}
BATCH=${BATCH:-4}
MAXLEN=${MAXLEN:-384}
HOLDOUT=${HOLDOUT:-64}
DEST=${DEST:-experiments/results/ablation_cpu}
IFS='|' read -ra VS <<< "${VARIANTS:-base:|muon:--optimizer muon|lk:--objective lk-alpha}"
mkdir -p "$DEST"
for v in "${VS[@]}"; do
  name=${v%%:*}
  R=runs/ablate_$name
  # shellcheck disable=SC2086
  ./dev python train.py --data sharegpt-greedy --num-records 0 --holdout "$HOLDOUT" --max-len "$MAXLEN" \
    --batch-size "$BATCH" --steps "$STEPS" --lr 3e-3 --eval-every $((STEPS / 2)) --out "$R" --overwrite \
    --no-progress ${v#*:} > "$DEST/train_$name.log" 2>&1 || { echo "[$name] train.py failed: $DEST/train_$name.log"; exit 1; }
  mkdir -p "$DEST/$name"
  cp "$R/run.json" "$R/metrics.jsonl" "$DEST/$name/"
  ./dev python - "$name" "${v#*:}" "$R" "$DEST/summary.jsonl" << 'EOF'
import json, sys
name, flags, run, out = sys.argv[1:]
rows = [json.loads(x) for x in open(f"{run}/metrics.jsonl")]
held = [r for r in rows if r.get("split") == "eval"]
train = [r for r in rows if r.get("split") == "train"]
cfg = json.load(open(f"{run}/run.json"))
keep = lambda r: {k: round(v, 4) for k, v in r.items() if k.startswith(("acc_", "loss"))}
line = {
    "variant": name,
    "flags": flags,
    "steps": train[-1]["step"] if train else 0,
    "heldout": {str(r["step"]): keep(r) for r in held},
    "train_last": keep(train[-1]) if train else {},
    "git_commit": cfg.get("git_commit"),
    "hardware": cfg.get("hardware"),
    "versions": cfg.get("versions"),
    "date": cfg.get("date"),
}
open(out, "a").write(json.dumps(line) + "\n")
print(json.dumps({k: line[k] for k in ("variant", "steps", "heldout")}))
EOF
done
