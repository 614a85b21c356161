#!/usr/bin/env bash
# The CUDA tests on the H200, one pytest per file so that a slow file cannot take the others' reports
# with it (2026-12-01: one pytest over five files hit its timeout in the last test and printed no
# failure report at all; experiments/results/cuda_tests_h200_packing.txt). Each file gets its own
# timeout and its short tracebacks; everything lands in $OUT/cuda_tests.txt, a one-line summary per file
# at the end. Runs without the model (carry [".whl", ".device"], or beside a .stage/q* quarter):
#   bash .device/run_on_device.sh bash experiments/h200_cuda_tests.sh [FILE ...]
set -uo pipefail
FILES=("$@")
((${#FILES[@]})) || FILES=(tests/test_packing.py tests/test_eagle3_ttt.py tests/test_draft_step.py
  tests/test_families_cuda.py tests/test_kernels_cuda.py tests/test_fast_target.py tests/test_ttt_flex_buffer.py
  tests/test_gpu_memory_cuda.py)
PER=${PER_FILE_S:-150}
# the tests' SmolLM2 fixtures (tests/conftest.py) read the staged model where the machine has no asset wheel:
# beside the staged model, `h200_cuda_tests.sh tests/test_train_e2e.py` runs its CUDA test too
S=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -z ${NANOSPEC_SMOLLM2:-} && -f $S ]] && export NANOSPEC_SMOLLM2=$S
R=${OUT:-/tmp}/cuda_tests.txt
echo "# $(date -u '+%F %T') UTC, $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)" > "$R"
python3 -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__)" >> "$R"
summary=()
for f in "${FILES[@]}"; do
  echo "## $f" >> "$R"
  out=$(timeout "$PER" python3 -m pytest -q -m cuda -p no:cacheprovider -rfE --tb=short -W ignore "$f" 2>&1)
  rc=$?
  echo "$out" >> "$R"
  summary+=("$f rc=$rc$([[ $rc == 124 ]] && echo ' (timeout)') $(echo "$out" | grep -E '[0-9]+ (passed|failed|skipped)' | tail -1)")
done
printf '%s\n' "# summary" "${summary[@]}" >> "$R"
grep -E "^(FAILED|ERROR) " "$R" | cut -c1-200
printf '%s\n' "${summary[@]}"
