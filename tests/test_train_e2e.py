"""train.py end to end on a tiny random target: two gloo ranks == one rank, exact resume (both
one conversation per row and packed), bad inputs fail clearly (more of them: tests/test_bad_input.py)."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from core.config import DeployConfig
from core.distributed import all_min
from core.train_config import (
    GPU_MEMORY_SHARE,
    GPU_TOKENS_CAP,
    TrainConfig,
    auto_batch_tokens,
    auto_compile,
    draft_state_bytes,
    gpu_batch_tokens,
    step_bytes_per_token,
)
from core.trainer import EXIT_STOPPED
from tests.tiny import TINY_TRAIN

ROOT = Path(__file__).resolve().parents[1]


def run_train(out, target, data, nproc=1, extra=(), check=True):
    args = ["--target", str(target), "--data", str(data), "--out", str(out), *TINY_TRAIN, *extra]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    cmd = [sys.executable, *launcher, "train.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"train.py failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def train_rows(out):
    return [r for r in map(json.loads, open(Path(out) / "metrics.jsonl")) if r["split"] == "train"]


def final_params(out):
    ck = Path(out) / "ckpt"
    return load_file(ck / (ck / "latest").read_text().strip() / "draft.safetensors")


def assert_runs_agree(one, two, keys=("loss", "loss_0", "loss_2", "acc_0"), params=True):
    """Two runs (e.g. one rank and two) logged the same metrics at every step and, with params, end with
    the same draft weights."""
    r1, r2 = train_rows(one), train_rows(two)
    assert len(r1) == len(r2)
    for a, b in zip(r1, r2):
        for k in keys:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), (a["step"], k)
    if params:
        p1, p2 = final_params(one), final_params(two)
        for k in p1:
            torch.testing.assert_close(p1[k], p2[k], rtol=1e-4, atol=1e-5, msg=k)


# one conversation per row; packed rows (at --max-len 256 the tiny chats, 76..218 tokens, share rows);
# tokens: a fixed token budget a step (--batch-tokens: 4 rows of 256, filled first-fit; data/packing.TokenBatches)
LAYOUTS = {
    "rows": ["--pack", "off"],
    "packed": ["--pack", "on", "--max-len", "256"],
    "tokens": ["--pack", "on", "--max-len", "256", "--batch-tokens", "1024"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_match_one_rank(tmp_path, tiny_run_inputs, layout):
    target, data = tiny_run_inputs
    run_train(tmp_path / "one", target, data, 1, ["--steps", "5", *LAYOUTS[layout]])
    run_train(tmp_path / "two", target, data, 2, ["--steps", "5", *LAYOUTS[layout]])
    one = train_rows(tmp_path / "one")
    assert len(one) == 5
    assert_runs_agree(tmp_path / "one", tmp_path / "two")
    assert (
        all(r["loss"] > 0 for r in one) and one[-1]["loss"] != one[0]["loss"]
    )  # every step trained tokens; it learned


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_exact(tmp_path, tiny_run_inputs, layout):
    target, data = tiny_run_inputs
    run_train(tmp_path / "full", target, data, 1, ["--steps", "6", *LAYOUTS[layout]])
    run_train(tmp_path / "split", target, data, 1, ["--steps", "6", "--stop-after", "3", *LAYOUTS[layout]])
    assert (tmp_path / "split" / "ckpt" / "latest").read_text() == "step_3"
    run_train(tmp_path / "split", target, data, 1, ["--steps", "6", "--resume", *LAYOUTS[layout]])
    full, split = final_params(tmp_path / "full"), final_params(tmp_path / "split")
    for k in full:
        assert torch.equal(full[k], split[k]), k
    assert [r["loss"] for r in train_rows(tmp_path / "split")] == [r["loss"] for r in train_rows(tmp_path / "full")]


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--target", "/no/such/model"], "not found"),
        (["--data", "/no/such/chats.jsonl"], "not found"),
        (["--strategy", "medusa"], "unknown strategy 'medusa'"),
    ],
)
def test_bad_inputs_fail_clearly(tmp_path, tiny_run_inputs, extra, message):
    target, data = tiny_run_inputs
    p = run_train(
        tmp_path / "bad", target, data, 0, ["--steps", "1", *extra], check=False
    )  # plain python: torchrun adds its own traceback
    assert p.returncode != 0
    assert message in p.stderr + p.stdout
    assert "Traceback" not in p.stderr


def test_no_chat_template_fails_clearly(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    bare = tmp_path / "bare"
    shutil.copytree(target, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    p = run_train(tmp_path / "bad", bare, data, 0, ["--steps", "1"], check=False)
    assert p.returncode != 0 and "no chat template" in p.stderr + p.stdout


def test_nan_loss_stops_without_updating(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    bad = tmp_path / "nan_target"
    shutil.copytree(target, bad)
    weights = load_file(bad / "model.safetensors")
    weights["model.norm.weight"][:] = float("nan")  # final hidden -> NaN target distribution
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    p = run_train(tmp_path / "nan", bad, data, 0, ["--steps", "2"], check=False)
    assert p.returncode != 0
    assert "non-finite loss at step 0" in p.stderr + p.stdout and "Traceback" not in p.stderr
    assert (
        f"No checkpoint was saved before it ({tmp_path / 'nan' / 'ckpt'} has none" in p.stderr
    )  # names none that does not exist
    assert not (tmp_path / "nan" / "ckpt").exists()  # (a run with a checkpoint: tests/test_bad_input.py)
    run = json.loads((tmp_path / "nan" / "run.json").read_text())  # the record says how it ended
    assert run["status"] == "failed" and run["error"].startswith("non-finite loss at step 0")


def test_time_limit_stops_with_a_checkpoint(tmp_path, tiny_run_inputs):
    """--time-limit (start-up counts, so a tiny limit stops after the first step) saves and says how to go on;
    an unfinished run exits EXIT_STOPPED (75), not 0, and run.json says it stopped and why."""
    target, data = tiny_run_inputs
    p = run_train(tmp_path / "t", target, data, 0, ["--steps", "6", "--time-limit", "0.001"], check=False)
    assert p.returncode == EXIT_STOPPED == 75, (p.stdout + p.stderr)[-2000:]
    assert (tmp_path / "t" / "ckpt" / "latest").read_text() == "step_1"
    assert "[stop] --time-limit: after step 1" in p.stdout + p.stderr
    run = json.loads((tmp_path / "t" / "run.json").read_text())
    assert run["status"] == "stopped" and run["results"]["stopped_by"] == "--time-limit"
    first = run["results"]["train_seconds"]
    assert first > 0
    # start-up's clock: each stage done after the one before, the first step last, and its line printed
    clock = run["results"]["startup_seconds"]
    assert list(clock) == ["target", "data", "draft", "eval_start", "first_step"], clock
    assert 0 < clock["target"] <= clock["data"] <= clock["draft"] <= clock["eval_start"] <= clock["first_step"]
    assert f"[time] first step done {clock['first_step']:.0f} s after start (target" in p.stdout
    # --resume finishes it: exit 0, and run.json now says finished; its train_seconds count both starts (a resumed
    # sweep row reported only its last start's, 2026-12-07): the first start's made long here, so the sum shows
    run["results"]["train_seconds"] = first + 1000.0
    (tmp_path / "t" / "run.json").write_text(json.dumps(run))
    run_train(tmp_path / "t", target, data, 0, ["--steps", "6", "--resume"])
    run = json.loads((tmp_path / "t" / "run.json").read_text())
    assert run["status"] == "finished"
    assert first + 1000.0 < run["results"]["train_seconds"] < first + 1000.0 + 600
    assert list(run["results"]["startup_seconds"]) == ["target", "data", "draft", "first_step"]  # no eval at resume


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_after_the_step_with_a_checkpoint(tmp_path, tiny_run_inputs, sig):
    """A scheduler's (or `timeout`'s) SIGTERM, or Ctrl-C, ends the run at a step boundary with a checkpoint;
    the exit status (75) tells scripts the run is unfinished, and run.json says it stopped and why."""
    target, data = tiny_run_inputs
    out = tmp_path / "s"
    args = ["--target", str(target), "--data", str(data), "--out", str(out), *TINY_TRAIN, "--steps", "100000"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 300
        while not ((out / "metrics.jsonl").exists() and len(train_rows(out)) >= 2):
            assert p.poll() is None and time.time() < deadline, "train.py ended or stalled before training"
            time.sleep(0.2)
        p.send_signal(sig)
        log, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == EXIT_STOPPED, log[-2000:]
    assert "Traceback" not in log, log[-2000:]
    step = int((out / "ckpt" / "latest").read_text().removeprefix("step_"))
    assert 2 <= step < 100000 and f"[stop] {sig.name}: after step {step}" in log
    assert train_rows(out)[-1]["step"] == step  # the checkpoint is the last step trained
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "stopped" and run["results"] == {
        **run["results"],
        "stopped_by": sig.name,
        "stopped_at": step,
    }


def test_batch_tokens_needs_packing(tmp_path, tiny_run_inputs):
    """--batch-tokens with --pack off: one error line before any tokenizing, no traceback, nothing written."""
    p = run_train(tmp_path / "r", *tiny_run_inputs, 0, ["--pack", "off", "--batch-tokens", "256"], check=False)
    text = p.stdout + p.stderr
    assert p.returncode != 0 and "--batch-tokens fills packed rows" in text and "Traceback" not in text, text[-2000:]
    assert not any(line.startswith("[data]") for line in text.splitlines())  # refused before tokenizing
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_auto_batch_tokens():
    """--batch-tokens -1 (the default): a token budget of --batch-size rows of --max-len only on a GPU with packed
    rows; conversations on CPU, unpacked, explicit values kept, disaggregated runs keep -1 (conversations there)."""
    cfg = TrainConfig(batch_size=8, max_len=512)
    assert cfg.batch_tokens == -1
    assert auto_batch_tokens(cfg, "cuda", True) == 8 * 512
    assert auto_batch_tokens(cfg, "cuda", False) == 0
    assert auto_batch_tokens(cfg, "cpu", True) == 0
    for explicit in (0, 4096):
        assert auto_batch_tokens(dataclasses.replace(cfg, batch_tokens=explicit), "cuda", True) == explicit
    consumer = dataclasses.replace(cfg, deploy=DeployConfig(role="consumer"))
    assert auto_batch_tokens(consumer, "cuda", True) == -1
    assert auto_batch_tokens(cfg, "cuda", True, lambda: 12 * 512) == 12 * 512  # train.py's sizing from memory
    assert auto_batch_tokens(cfg, "cpu", True, lambda: 12 * 512) == 0


def test_auto_compile():
    """Without --compile a long run compiles its draft step only where that was measured to pay: eagle3, kl, flex,
    no MoE, a token budget, on one GPU, at least --compile-after steps; --compile-after 0 and the rest: eager."""
    run = TrainConfig(strategy="eagle3", objective="kl", attention="flex", batch_tokens=65280)
    assert "2000 steps >= --compile-after 2000" in auto_compile(run, "cuda", 2000)
    assert auto_compile(dataclasses.replace(run, attention="flex_buf"), "cuda", 20000)
    assert auto_compile(run, "cuda", 1999) is None  # the main job's 80 steps: eager, the compile would not pay
    for other in (
        dict(compile_after=0),
        dict(compile=True),  # compiled already, nothing to say
        dict(strategy="dflash"),
        dict(objective="lk-alpha"),
        dict(objective="jsd"),
        dict(moe_experts=4),
        dict(attention="eager"),
        dict(batch_tokens=0),  # conversations a step: the row count varies
    ):
        assert auto_compile(dataclasses.replace(run, **other), "cuda", 20000) is None, other
    assert auto_compile(run, "cpu", 20000) is None
    assert auto_compile(run, "cuda", 20000, world=2) is None  # FSDP2's compiled draft: not yet timed on GPUs


def test_auto_compile_is_applied_before_batching(tmp_path, tiny_run_inputs, monkeypatch, capsys):
    """Trainer takes auto_compile's answer once the run's length is known and before the batcher is built: the
    draft step compiled, batches padded as with --compile, the reason printed (auto_compile answers yes only on a
    GPU: forced here)."""
    import core.trainer as trainer_mod  # heavy (the whole training stack): this test builds a Trainer in-process

    target, data = tiny_run_inputs
    cfg = TrainConfig(
        target=str(target), data=str(data), num_records=24, holdout=4, max_len=128, batch_tokens=256, pack="on",
        ttt_length=2, device="cpu", out=str(tmp_path / "run"), progress=False, steps=3,
    )  # fmt: skip
    plain = trainer_mod.Trainer(cfg)
    assert not plain.cfg.compile and plain.draft_step is plain.draft
    monkeypatch.setattr(trainer_mod, "auto_compile", lambda c, kind, steps, world: f"{steps} steps (forced)")
    tr = trainer_mod.Trainer(dataclasses.replace(cfg, out=str(tmp_path / "run2")))
    assert tr.cfg.compile and tr.batcher.cfg.compile
    assert isinstance(tr.draft_step, torch._dynamo.eval_frame.OptimizedModule)
    assert "[draft] compiling the draft step: 3 steps (forced)" in capsys.readouterr().out


def test_gpu_batch_tokens():
    """--batch-tokens -1 on a GPU is sized from its memory: the 8B shape at --max-len 4096 gets rows whose
    estimated peak fits GPU_MEMORY_SHARE of an 80 GiB GPU (the issue's 80 GiB goal) and of the H200, the
    estimate lies above both H200 peaks measured at 32,768 tokens a step (106.1 GiB for the 8B shape, 11.6 for
    SmolLM2), SmolLM2 is capped, a GPU too small says so, data-parallel ranks each take a share."""
    gib = 2**30
    llama8b = {"hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256}
    cfg8b = TrainConfig(max_len=4096, draft_vocab_size=32000, ttt_length=7)
    weights = 16_060_000_000  # Llama-3.1-8B in bf16
    per_token = step_bytes_per_token(4096, 14336, 128256, 32000, 7)
    fixed = weights + draft_state_bytes(4096, 14336, 32000, 1)
    assert (fixed + 32768 * per_token) / gib > 106.1  # the estimate is on the safe side of the measured peak
    small = {"hidden_size": 576, "intermediate_size": 1536, "vocab_size": 49152}
    assert step_bytes_per_token(576, 1536, 49152, 8192, 7) * 32768 / gib > 11.6
    for total in (80 * gib, 140 * gib):
        tokens, why = gpu_batch_tokens(cfg8b, llama8b, total, weights, dp=1)
        assert tokens % 4096 == 0 and tokens >= 4096 and f"{total / gib:.1f} GiB" in why
        assert fixed + tokens * per_token <= GPU_MEMORY_SHARE * total
        assert fixed + (tokens + 4096) * per_token > GPU_MEMORY_SHARE * total  # one row more would not fit
    assert gpu_batch_tokens(cfg8b, llama8b, 140 * gib, weights, dp=1)[0] == 32768  # 8 rows on an H200
    assert gpu_batch_tokens(cfg8b, llama8b, 140 * gib, weights, dp=2)[0] == 2 * 32768
    tokens, why = gpu_batch_tokens(TrainConfig(max_len=384), small, 140 * gib, 300 * 2**20, dp=1)
    assert tokens == GPU_TOKENS_CAP // 384 * 384 and "capped" in why
    tokens, why = gpu_batch_tokens(cfg8b, llama8b, 24 * gib, weights, dp=1)
    assert tokens == 4096 and "not even one row" in why
    # --gpu-memory 80 on the H200: the 80 GiB GPU's budget, said to come from the option
    capped = dataclasses.replace(cfg8b, gpu_memory=80.0)
    tokens, why = gpu_batch_tokens(capped, llama8b, 80 * gib, weights, dp=1)
    assert tokens == gpu_batch_tokens(cfg8b, llama8b, 80 * gib, weights, dp=1)[0] < 32768
    assert why.startswith("sized from --gpu-memory's 80.0 GiB")


def _min_rank(rank: int, store: str, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    out[rank] = int(all_min(torch.tensor([65280 - 384 * 10 * rank])).item())  # rank 1 measured less memory
    dist.destroy_process_group()


def test_all_min_agrees_over_ranks(tmp_path):
    """train.py's GPU budget is measured on every rank; all_min makes them agree on the smallest (two gloo ranks)."""
    out = mp.Manager().dict()
    mp.spawn(_min_rank, args=(str(tmp_path / "store"), out), nprocs=2)
    assert dict(out) == {0: 65280 - 3840, 1: 65280 - 3840}


@pytest.mark.parametrize("code,status,err", [(None, 0, ""), (3, 3, ""), ("error: no data", 1, "error: no data\n")])
def test_exit_without_teardown_keeps_the_status_and_the_output(code, status, err):
    """A torchrun rank of train.py ends through exit_without_teardown: the exit status and the error message are
    SystemExit's, and what was printed (buffered, as under a pipe) is flushed first."""
    prog = f"from core.distributed import exit_without_teardown; print('done'); exit_without_teardown({code!r})"
    p = subprocess.run([sys.executable, "-c", prog], cwd=ROOT, capture_output=True, text=True)
    assert (p.returncode, p.stdout, p.stderr) == (status, "done\n", err)


def test_two_ranks_fail_clearly_on_bad_data(tmp_path, tiny_run_inputs):
    """Under torchrun a bad input still ends each rank with the one-line error and exit status 1, run.json says so."""
    target, _ = tiny_run_inputs
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [}\n')
    p = run_train(tmp_path / "two", target, bad, 2, ["--steps", "2"], check=False)
    assert p.returncode != 0 and "error: " in p.stderr and "malformed JSON" in p.stderr, p.stderr[-2000:]
    ours = p.stderr.split("torch/distributed/elastic")[0]  # before torchrun's own report (which has a traceback)
    assert "error: " in ours and "Traceback" not in ours, p.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_run_logs_its_running_peak(tmp_path, tiny_run_inputs):
    """On a GPU every train row carries the peak allocated so far (GiB): never falling, and at the end no more than
    run.json's peak (an eager SmolLM2 run's peak rose from 23.5 to 40.2 GiB between two commits on 2026-12-06 with
    nothing to say at which step)."""
    target, data = tiny_run_inputs
    # --batch-tokens 0: conversations a step; the GPU default sizes a token budget from the card (65,536 tokens),
    # more than the tiny chats fill at --max-len 64 (2026-12-07 on an H100: the run refused to start)
    run_train(tmp_path / "run", target, data, 0, ["--steps", "3", "--device", "cuda", "--batch-tokens", "0"])
    peaks = [r["peak_gib"] for r in train_rows(tmp_path / "run")]
    assert len(peaks) == 3 and all(p > 0 for p in peaks) and peaks == sorted(peaks)
    final = json.loads((tmp_path / "run" / "run.json").read_text())["peak_memory"]["cuda_max_allocated_bytes"]
    assert peaks[-1] <= final / 2**30 + 1e-3
