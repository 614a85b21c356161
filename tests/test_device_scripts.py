"""The device-side shell scripts (experiments/h200_*.sh and the rest): they only run on the GPU machine, where a
broken one wastes a scarce session, so here every one must parse, and h200_defaults.sh's runs that need no staged
model must issue the commands they name, with python3 and nvidia-smi stubbed out."""

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("experiments/*.sh"), *ROOT.glob("tools/*.sh")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(script):
    p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr


def stubbed_env(tmp_path: Path, **extra) -> dict:
    """The environment of a device script run here: python3 echoes its command line, nvidia-smi does nothing,
    $OUT is tmp_path/out; plus `extra`."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text('#!/bin/bash\necho "python3 $*"\n')
    (stub / "nvidia-smi").write_text("#!/bin/bash\nexit 0\n")
    for f in stub.iterdir():
        f.chmod(0o755)
    (tmp_path / "out").mkdir()
    return {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), **extra}


def test_defaults_30b_runs_without_a_staged_model(tmp_path):
    tok = tmp_path / "tok"  # .whl-spec/tokenizer's layout: tokenizer.json travels gzipped
    tok.mkdir()
    subprocess.run(["bash", "-c", f"echo '{{}}' > {tok}/tokenizer.json && gzip {tok}/tokenizer.json"], check=True)
    out = tmp_path / "out"
    env = stubbed_env(tmp_path, ONLY="harness30b 30b", TOKENIZER=str(tok))
    p = subprocess.run(
        ["bash", "experiments/h200_defaults.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and "no staged target" not in p.stdout, p.stdout + p.stderr
    with tarfile.open(out / "defaults_out.tgz") as t:
        logs = {Path(m.name).name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}
    assert "--target qwen3-30b-a3b --backends compiled --batch-size 4" in logs["harness30b.log"]
    made = logs["random_target_30b.log"]
    assert "tools/random_target.py qwen3-30b-a3b /tmp/qwen30b --no-weights --tokenizer /tmp/tokenizer" in made
    assert "train.py --target /tmp/qwen30b" in logs["30b_default.log"]
    assert "--gpu-memory" not in logs["30b_default.log"]  # the H200's whole memory unless GPU_GIB_30B says
    # a run that needs the staged model refuses without it
    if Path("/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf").exists():  # a GPU machine with the model staged
        return
    env["ONLY"] = "main"
    p = subprocess.run(["bash", "experiments/h200_defaults.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 1 and "no staged target" in p.stdout


@pytest.mark.skipif(not (ROOT / ".whl-spec/tokenizer").is_dir(), reason="no .whl-spec (tools/speculators_wheels.sh)")
def test_anchor_call_unzips_the_tokenizer(tmp_path):
    out, tok = tmp_path / "out", tmp_path / "tok"
    env = stubbed_env(tmp_path, ANCHOR_TOK=str(tok))
    p = subprocess.run(
        ["bash", "experiments/h200_anchor.sh", "--steps", "3"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr
    assert (tok / "tokenizer.json").is_file() and (tok / "config.json").is_file()
    log = (out / "anchor.log").read_text()
    assert (
        f"experiments/speculators_anchor.py --tokenizer {tok} --out {out}/speculators_anchor_h200.jsonl --steps 3"
        in log
    )
