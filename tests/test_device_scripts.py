"""The device-side shell scripts (experiments/h200_*.sh and the rest): they only run on the GPU machine, where a
broken one wastes a scarce session, so here every one must parse, and h200_defaults.sh's runs that need no staged
model must issue the commands they name, with python3 and nvidia-smi stubbed out."""

import lzma
import os
import subprocess
import sys
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


def scale_env(tmp_path: Path, **extra) -> dict:
    """stubbed_env for experiments/h200_scale.sh: an empty stand-in target and its work directory under tmp_path."""
    target = tmp_path / "target.gguf"
    target.write_text("")
    return stubbed_env(tmp_path, TARGET=str(target), SCALE_DIR=str(tmp_path / "scale"), **extra)


def run_scale(env: dict, phase: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "experiments/h200_scale.sh", phase], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def test_scale_train_recipes_and_resume_skips_evaluated_runs(tmp_path):
    """h200_scale.sh train: the default run is the shipped draft's recipe (32 unpacked conversations a step, not
    train.py's token budget); RUNS' own flags reach train.py; with RESUME=1 a run already evaluated is skipped."""
    env = scale_env(tmp_path, LIMIT="200")
    p = run_scale(env, "train")
    assert p.returncode == 0, p.stdout + p.stderr
    with tarfile.open(tmp_path / "out/train_out.tgz") as t:
        log = t.extractfile("./train_c.log").read().decode()
    assert "--steps 5600 --lr 3e-3 --warmup 200 --batch-tokens 0" in log and "--overwrite" in log, log
    (tmp_path / "out/train_out.tgz").unlink()
    env |= {"RUNS": "g:mix_data:8192:2000:--warmup,200 c:mix_data:8192:5600", "RESUME": "1"}
    (tmp_path / "scale/run_c").mkdir(parents=True)
    (tmp_path / "scale/run_c/evaluated").touch()
    p = run_scale(env, "train")
    assert p.returncode == 0 and "run c: finished and evaluated in an earlier call" in p.stdout, p.stdout + p.stderr
    with tarfile.open(tmp_path / "out/train_out.tgz") as t:
        names = {Path(m.name).name for m in t.getmembers()}
        log = t.extractfile("./train_g.log").read().decode()
    assert "train_c.log" not in names and "--steps 2000 --lr 3e-3 --warmup 200 --eval-every" in log, log
    # every run evaluated: the call ends at once (a bare `wait` waited for the GPU monitor loop, forever)
    env["RUNS"] = "c:mix_data:8192:5600"
    p = run_scale(env, "train")
    assert p.returncode == 0 and "run c: finished and evaluated in an earlier call" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("mib,slots", [("81559", 768), ("143771", 1024)])
def test_scale_gen_sizes_slots_from_the_gpu(tmp_path, mib, slots):
    """h200_scale.sh gen: each generator's slots from the card's memory (768 on an 80 GiB H100, 1,024 on the
    H200), so the calls can be planned before the card is known."""
    env = scale_env(tmp_path, LIMIT="200", GEN_S="150")
    (tmp_path / "bin/nvidia-smi").write_text(f"#!/bin/bash\necho {mib}\n")
    p = run_scale(env, "gen")
    assert p.returncode == 0, p.stdout + p.stderr
    with tarfile.open(tmp_path / "out/gen_out.tgz") as t:
        log = t.extractfile("./answers_code.log").read().decode()
    assert f"capture.py regenerate --target {tmp_path / 'target.gguf'}" in log and f"--slots {slots} " in log, log


def test_scale_gen_reads_the_packaged_prompts(tmp_path):
    """h200_scale.sh gen: the prompts it answers are the committed .xz files, seed 7's then the other seeds',
    read with Python (python3 -c runs for real here; the rest stays stubbed)."""
    env = scale_env(tmp_path, LIMIT="200", GEN_S="150")
    (tmp_path / "bin/python3").write_text(
        f'#!/bin/bash\n[[ $1 == -c ]] && exec {sys.executable} "$@"\necho "python3 $*"\n'
    )
    p = run_scale(env, "gen")
    assert p.returncode == 0, p.stdout + p.stderr
    for d in ("code", "math", "chat"):
        files = [
            ROOT / f"data/smollm2_domains/prompts_{d}.jsonl.xz",
            *sorted(ROOT.glob(f"data/smollm2_domains/prompts_{d}_seed*.jsonl.xz")),
        ]
        want = b"".join(lzma.open(f).read() for f in files)
        assert len(files) == 3 and (tmp_path / f"scale/p_{d}.jsonl").read_bytes() == want, d


def test_scale_train_goes_on_eagerly_when_the_compiled_run_fails(tmp_path):
    """h200_scale.sh train: a run whose compiled step fails (exit 1) is run again without --compile in the same
    call, and later calls keep it eager; a run that fails eagerly is not retried."""
    env = scale_env(tmp_path, LIMIT="400", RUNS="g:mix_data:8192:2000:--warmup,200")
    # python3: train.py with --compile fails, everything else echoes its command line
    (tmp_path / "bin/python3").write_text(
        '#!/bin/bash\necho "python3 $*"\n[[ "$*" == *train.py* && " $* " == *" --compile "* ]] && exit 1\nexit 0\n'
    )

    def train_log():
        with tarfile.open(tmp_path / "out/train_out.tgz") as t:
            log = t.extractfile("./train_g.log").read().decode()
        (tmp_path / "out/train_out.tgz").unlink()
        return log

    p = run_scale(env, "train")
    assert p.returncode == 0 and "the compiled run failed; again without --compile" in p.stdout, p.stdout + p.stderr
    calls = [line for line in train_log().splitlines() if line.startswith("python3 train.py")]
    assert len(calls) == 2 and " --compile " in calls[0] and "--compile-after 0" in calls[1], calls
    assert (tmp_path / "scale/run_g/eager").exists()
    env["RESUME"] = "1"  # a later call: eager from the start, once
    run_scale(env, "train")
    calls = [line for line in train_log().splitlines() if line.startswith("python3 train.py")]
    assert len(calls) == 1 and "--compile-after 0" in calls[0] and " --compile " not in calls[0], calls


def test_scale_refuses_to_train_without_the_benchmark_prompts(tmp_path):
    """h200_scale.sh gen train: without the benchmarks' asset wheels (experiments/device_wheels.sh) τ cannot be
    measured, so the call stops before generating or training, not after (run g, 2026-12-06)."""
    env = scale_env(tmp_path, LIMIT="200")
    # python3: the asset check fails as on a machine without the wheels, everything else echoes
    (tmp_path / "bin/python3").write_text(
        '#!/bin/bash\necho "python3 $*"\n[[ "$*" == *asset_path* ]] && exit 1\nexit 0\n'
    )
    p = run_scale(env, "gen train")
    assert p.returncode == 1 and "experiments/device_wheels.sh" in p.stdout, p.stdout + p.stderr
    assert "regenerate" not in p.stdout and not (tmp_path / "out/train_out.tgz").exists()
    p = run_scale(env, "gen")  # generating alone needs no prompts of the benchmarks
    assert p.returncode == 0, p.stdout + p.stderr
