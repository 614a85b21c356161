#!/usr/bin/env bash
# Splits the default target's GGUF into N parts (.stage/q0 .. .stage/q{N-1}, SHA256 beside the
# last), because the repo and a half of the model no longer fit one 64 MiB carry. Each part then
# travels in its own call of `bash .device/run_on_device.sh bash experiments/h200_useful_draft.sh
# stage` (carry [".whl", ".device", ".stage/qI"]), and the script reassembles and checks the file on
# the GPU machine. Run on the CPU machine from the project root, after
# `bash ../shared/device/prepare.sh` (which writes the halves .stage/a/part00, .stage/b/part01):
#   bash experiments/device_parts.sh [N=6]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-6}
[[ $n =~ ^[1-9]$ ]] || { echo "error: N is 1..9 (one digit: the parts are named q0..q9)" >&2; exit 1; }
[[ -f .stage/a/part00 && -f .stage/b/part01 && -f .stage/b/SHA256 ]] ||
  { echo "error: no .stage/a/part00, .stage/b/part01 and .stage/b/SHA256: run bash ../shared/device/prepare.sh first" >&2; exit 1; }
name=$(awk '{print $2}' .stage/b/SHA256)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cat .stage/a/part00 .stage/b/part01 > "$tmp/$name"
(cd "$tmp" && sha256sum -c --quiet "$OLDPWD/.stage/b/SHA256")
rm -rf .stage/q?
(cd "$tmp" && split -n "$n" -d -a 1 "$name" q && sha256sum "$name" > SHA256)
for ((i = 0; i < n; i++)); do mkdir -p ".stage/q$i" && mv "$tmp/q$i" ".stage/q$i/"; done
mv "$tmp/SHA256" ".stage/q$((n - 1))/"
du -sh .stage/q?
