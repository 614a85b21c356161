#!/usr/bin/env bash
# Fill .whl-spec/ (git-ignored) with what experiments/speculators_anchor.py needs on the GPU machine
# beyond its image (torch, transformers, safetensors, numpy, tqdm, huggingface_hub + httpx/anyio/click,
# accelerate, pyarrow/pandas/xxhash) and beyond .whl/ (tyro, gguf, datasets: ../shared/device/prepare.sh):
#   - speculators 0.9.0 (vLLM's trainer) and hs-connectors 0.9.0, as py3.12 wheels, --no-deps;
#   - the modules their training path imports that the image may lack (read from the import chain of
#     speculators.train.cli + tqdm.rich in a venv holding only what the image has): loguru,
#     pydantic(-core, -settings), python-dotenv, openai 2.x (3.x wants httpx2) with jiter/distro/sniffio and
#     httpx/httpcore/h11 (huggingface_hub 2.x moved to httpx2, so the image may have no httpx),
#     rich + pygments/markdown-it-py/mdurl, typing-extensions/-inspection, annotated-types;
#   - tokenizer/: SmolLM2-135M-Instruct's tokenizer (tokenizer.json gzipped) and config.json (tools/random_target.py
#     --tokenizer takes it once unzipped), so the GPU call needs no staged model file.
# The anchor script installs the wheels with --no-deps into its --work/site-spec and puts that first on
# PYTHONPATH for their trainer's process only (train.py never sees them). Pins: the versions the CPU smoke
# (`experiments/speculators_anchor.py --smoke`) ran with. Usage, from the project root:
#   bash tools/speculators_wheels.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF /.whl-spec/ .git/info/exclude 2>/dev/null || echo /.whl-spec/ >> .git/info/exclude
rm -rf .whl-spec
mkdir -p .whl-spec
py312=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${py312[@]}" -d .whl-spec \
  speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 \
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
  openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 \
  rich==15.0.0 pygments==2.21.0 markdown-it-py==4.3.0 mdurl==0.1.2 2>&1 | grep -v "is ignored" || true
./dev python - <<'EOF'
import shutil
from models.target import load_tokenizer, resolve_target

src = resolve_target("smollm2")  # the packaged GGUF, converted once
load_tokenizer(src).save_pretrained(".whl-spec/tokenizer")
shutil.copy(src / "config.json", ".whl-spec/tokenizer/config.json")  # tools/random_target.py checks it
EOF
# gzipped (3.4 MB -> 0.6 MB): a call's tree is at most 64 MiB, and the repository (~52 MiB) + .whl-spec + the wheels
# of .whl the anchor needs came to ~66 MiB; experiments/h200_anchor.sh unzips it on the GPU machine
gzip -9f .whl-spec/tokenizer/tokenizer.json
ls -la .whl-spec .whl-spec/tokenizer
du -sh .whl-spec
kb=$(du -sk .whl-spec | cut -f1)
((kb < 20480)) || { echo ".whl-spec is ${kb} KB, over the 20 MB budget" >&2; exit 1; }
