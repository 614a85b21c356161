"""train.py / export.py on bad options, bad --out dirs, damaged checkpoints and full disks (issue 17):
each fails with one message naming the cause, a non-zero exit, no traceback, and nothing of an
earlier run overwritten or lost."""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import evaluate
import export
import train
from capture import FeaturesConfig, features
from core.config import DeployConfig
from core.train_config import TrainConfig
from tests.test_train_e2e import ROOT, run_train, train_rows

FAST = ["--num-records", "16", "--holdout", "2", "--batch-size", "2", "--draft-vocab-size", "512", "--ttt-length", "2"]


def failed(p, *messages):
    text = p.stdout + p.stderr
    assert p.returncode != 0, text[-3000:]
    for m in messages:
        assert m in text, (m, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    return text


def cfg_of(target, data, out, **kw):
    base = dict(
        target=str(target),
        data=str(data),
        out=str(out),
        num_records=16,
        holdout=2,
        max_len=64,
        batch_size=2,
        draft_vocab_size=512,
        ttt_length=2,
        lr=1e-3,
        warmup=1,
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def main_fails(cfg, *messages) -> str:
    """train.main in this process: the SystemExit message (what the user sees on stderr)."""
    with pytest.raises(SystemExit) as e:
        train.main(cfg)
    msg = str(e.value.code)
    for m in messages:
        assert m in msg, (m, msg)
    return msg


def snapshot(out: Path) -> dict:
    return {
        str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and "tb" not in p.parts
    }


# ---------------------------------------------------------------- numeric options, up front
@pytest.mark.parametrize(
    "extra,message",
    [
        (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
        (["--steps", "-1"], "--steps must be at least 0 (0 = one epoch), got -1"),
    ],
)
def test_bad_numbers_fail_before_anything(tmp_path, tiny_run_inputs, extra, message):
    target, data = tiny_run_inputs
    p = run_train(tmp_path / "out", target, data, 0, [*extra], check=False)
    failed(p, message)
    assert not (tmp_path / "out").exists()  # nothing written (today --steps -1 wrote ckpt/step_-1)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"lr": float("nan")}, "--lr must be a finite number in (0, inf), got nan"),
        ({"lr": -1e-3}, "--lr must be a finite number"),
        ({"grad_clip": 0.0}, "--grad-clip must be a finite number"),
        ({"min_lr_ratio": 1.5}, "--min-lr-ratio must be a finite number in [0, 1]"),
        ({"gpu_memory": -8.0}, "--gpu-memory must be a finite number in [0, inf), got -8.0"),
        ({"log_every": 0}, "--log-every must be at least 1"),
        ({"eval_batch_size": 0}, "--eval-batch-size must be at least 1"),
        ({"ttt_length": 0}, "--ttt-length must be at least 1"),
        ({"holdout": -1}, "--holdout must be at least 0"),
        ({"moe_experts": 2, "moe_top_k": 3}, "--moe-top-k 3 is more than --moe-experts 2"),
        ({"aux_layers": (3, 3, 3)}, "--aux-layers 3 3 3: distinct layer indices, 0 or more"),
        ({"aux_layers": (-1, 1, 2)}, "--aux-layers -1 1 2: distinct layer indices"),
        ({"ttt_length": 100}, "--ttt-length 100 needs rows longer than it: at --max-len 64 TTT steps 63 and later"),
        (
            {"resume": True, "overwrite": True},
            "--resume continues the run in --out and --overwrite replaces it: pass one of them",
        ),
        ({"resume": True, "init_draft": "runs/other"}, "--resume continues the run in --out with its own weights"),
        # --attention and --loss belong to the families that read them (issue 34): refused, never ignored
        (
            {"attention": "nope"},
            "--attention 'nope' is no attention of any family; for --strategy eagle3 it takes auto, eager, lse, flex",
        ),
        (
            {"strategy": "dflash", "draft_vocab_size": 8192, "loss": "triton"},
            "--loss triton applies to --strategy eagle3, not dflash (it reads no",
        ),
        (
            {"strategy": "dflash", "draft_vocab_size": 8192, "attention": "lse"},
            "--attention lse applies to --strategy eagle3, not dflash (it takes auto, eager, flex)",
        ),
        (
            {"strategy": "peagle", "attention": "flex_buf"},
            "--attention flex_buf applies to --strategy eagle3, not peagle",
        ),
    ],
)
def test_bad_option_values(tmp_path, tiny_run_inputs, kw, message, monkeypatch):
    monkeypatch.setattr(train, "Trainer", None)  # never reached: validated before the target or data load
    main_fails(cfg_of(*tiny_run_inputs, tmp_path / "out", **kw), "error: " + message)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kw,message",
    [  # refused in Trainer.__init__ before anything loads; these lacked the 'error: ' prefix (issue 35)
        ({"objective": "foo"}, "error: --objective 'foo' is not one of eagle3's: kl, "),
        ({"backend": "nope"}, "error: --backend must be auto or one of "),
        ({"attention": "flex", "device": "cpu"}, "error: --attention flex has no backward on CPU"),
        ({"device": "nope"}, "error: --device must be auto, cpu or cuda, got 'nope'"),  # ran on the CPU silently
        ({"gpu_memory": 80.0, "device": "cpu"}, "error: --gpu-memory 80 caps a GPU's memory, and this run is on"),
    ],
)
def test_family_option_refusals_are_error_lines(tmp_path, tiny_run_inputs, kw, message):
    msg = main_fails(cfg_of(*tiny_run_inputs, tmp_path / "out", **kw), message)
    assert msg.startswith(message)


def test_compiled_divergences_on_an_old_torch_cpu(tmp_path, tiny_run_inputs, monkeypatch):
    """torch 2.11's inductor compiled the JSD step on CPU with wrong gradients (tests/test_draft_step.py on the device
    machine's CPU, 2026-12-05): train.py refuses --compile with the divergences there instead of training on them."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cpu")
    kw = {"compile": True, "objective": "jsd", "device": "cpu"}
    msg = main_fails(cfg_of(*tiny_run_inputs, tmp_path / "out", **kw), "error: --compile with --objective jsd on CPU")
    assert "needs torch >= 2.13 (this is 2.11.0+cpu)" in msg


def test_batch_must_split_over_ranks(monkeypatch, tiny_run_inputs, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "4")

    with pytest.raises(train.ConfigError, match="--batch-size 6 is the global batch: it must split evenly over the 4"):
        train.validate(cfg_of(*tiny_run_inputs, tmp_path / "o", batch_size=6))


def test_draft_vocab_larger_than_target_vocab(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    p = run_train(tmp_path / "out", target, data, 0, ["--steps", "1", "--draft-vocab-size", "60000"], check=False)
    failed(p, "--draft-vocab-size 60000 is larger than the target's vocabulary (49152 tokens in")
    assert not (tmp_path / "out" / "run.json").exists()


def test_max_len_past_the_target_context(tmp_path, tiny_run_inputs):
    """The probe: --max-len beyond the target's context (the tiny target has 256 positions) was accepted, and a long
    conversation ran the target past it; train.py and capture.py features refuse it once the target is found."""
    target, data = tiny_run_inputs
    p = run_train(tmp_path / "out", target, data, 0, ["--steps", "1", "--max-len", "300"], check=False)
    failed(p, "--max-len (300) does not fit the target's context of 256 tokens (max_position_embeddings in")
    assert not (tmp_path / "out" / "run.json").exists()
    with pytest.raises(SystemExit, match="error: --max-len \\(300\\) does not fit the target's context of 256"):
        features(FeaturesConfig(target=str(target), data=str(data), out=str(tmp_path / "s"), max_len=300))
    assert not (tmp_path / "s" / "store.json").exists()


# ---------------------------------------------------------------- --out
def test_out_under_a_file(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    f = tmp_path / "afile"
    f.write_text("x")
    failed(
        run_train(f / "run", target, data, 0, ["--steps", "1"], check=False),
        f"--out {f / 'run'}: {f} is a file, not a directory",
    )
    failed(run_train(f, target, data, 0, ["--steps", "1"], check=False), f"--out {f} is a file, not a directory")
    assert f.read_text() == "x"


def test_out_read_only_fails_before_loading(tmp_path, tiny_run_inputs, monkeypatch):
    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    monkeypatch.setattr(train, "Trainer", None)  # the model and data are never loaded
    main_fails(
        cfg_of(*tiny_run_inputs, tmp_path / "ro"),
        f"--out {tmp_path / 'ro'}: cannot write the run there: it is on a read-only file system",
    )


def test_out_where_writes_are_refused(tmp_path, tiny_run_inputs):
    """A real mount that refuses new entries (sysfs here); skipped where it does not."""
    out = Path("/sys/nanospec_test_out")
    try:
        os.mkdir(out)
    except OSError:
        pass
    else:
        os.rmdir(out)
        pytest.skip("/sys accepts new directories here")
    target, data = tiny_run_inputs
    failed(run_train(out, target, data, 0, ["--steps", "1"], check=False), f"--out {out}: cannot write the run there")


# ---------------------------------------------------------------- an earlier run in --out
def test_rerun_refused_then_overwrite_replaces_it(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    run_train(out, target, data, 0, [*FAST, "--steps", "2", "--ckpt-every", "1"])
    before = snapshot(out)
    assert {
        "run.json",
        "metrics.jsonl",
        "ckpt/step_1/draft.safetensors",
        "ckpt/step_2/draft.safetensors",
    } <= before.keys()
    p = run_train(out, target, data, 0, [*FAST, "--steps", "1"], check=False)
    failed(
        p,
        f"--out {out} holds a previous run (run.json, metrics.jsonl, tb/, ckpt/; checkpoint step_2): "
        "pass --resume to continue it, --overwrite to replace it",
    )
    assert snapshot(out) == before  # nothing touched
    # the disaggregated launcher refuses too, before it starts any process
    failed(
        run_train(out, target, data, 0, [*FAST, "--steps", "1", "--producers", "1"], check=False),
        "holds a previous run",
    )
    assert snapshot(out) == before and not (out / "pipeline").exists()

    (out / "notes.txt").write_text("mine")  # not the run's: kept
    p = run_train(out, target, data, 0, [*FAST, "--steps", "1", "--overwrite", "--progress"])
    assert "[out] --overwrite: removed the previous run's run.json, metrics.jsonl, tb/, ckpt/" in p.stdout
    assert sorted(d.name for d in (out / "ckpt").iterdir()) == [
        "latest",
        "step_1",
    ]  # no step_2 of the old run beside it
    assert [r["step"] for r in train_rows(out)] == [1]  # only the new run's rows
    assert json.loads((out / "run.json").read_text())["config"]["steps"] == 1
    assert (out / "notes.txt").read_text() == "mine"
    # progress for the silent minutes (tokenizing, first evaluation) and where the outputs went
    assert "tokenize" in p.stderr and "eval" in p.stderr
    assert f"[out] {out}: checkpoint {out / 'ckpt' / 'step_1'}, metrics {out / 'metrics.jsonl'}" in p.stdout


# ---------------------------------------------------------------- damaged checkpoints
@pytest.fixture
def two_checkpoints(tmp_path, tiny_run_inputs):
    """A run stopped after step 2 with checkpoints step_1 and step_2 (latest)."""
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    run_train(out, target, data, 0, [*FAST, "--steps", "3", "--ckpt-every", "1", "--stop-after", "2"])
    assert (out / "ckpt" / "latest").read_text() == "step_2"
    return out


def truncate(f: Path, keep: float = 0.5):
    b = f.read_bytes()
    f.write_bytes(b[: int(len(b) * keep)])


@pytest.mark.parametrize("damaged", ["train_state.pt", "draft.safetensors"])
def test_resume_falls_back_to_intact_checkpoint(two_checkpoints, tiny_run_inputs, damaged):
    target, data = tiny_run_inputs
    out = two_checkpoints
    truncate(out / "ckpt" / "step_2" / damaged)
    p = run_train(out, target, data, 0, [*FAST, "--steps", "3", "--ckpt-every", "1", "--resume"])
    assert f"[resume] {out / 'ckpt' / 'step_2' / damaged} is damaged or unreadable" in p.stdout
    assert f"[resume] falling back to the previous intact checkpoint {out / 'ckpt' / 'step_1'}" in p.stdout
    assert f"[resume] {out / 'ckpt' / 'step_1'} at step 1" in p.stdout
    assert (out / "ckpt" / "latest").read_text() == "step_3"
    load_file(out / "ckpt" / "step_2" / "draft.safetensors")  # retrained and saved again, whole


def test_resume_with_no_intact_checkpoint_fails_clearly(two_checkpoints, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = two_checkpoints
    truncate(out / "ckpt" / "step_2" / "train_state.pt")
    truncate(out / "ckpt" / "step_1" / "draft.safetensors", 0.0)
    before = snapshot(out)
    p = run_train(out, target, data, 0, [*FAST, "--steps", "3", "--resume"], check=False)
    failed(
        p,
        f"--resume: no intact checkpoint in {out / 'ckpt'}",
        str(out / "ckpt" / "step_2" / "train_state.pt"),
        str(out / "ckpt" / "step_1" / "draft.safetensors"),
    )
    assert snapshot(out) == before


def test_resume_without_checkpoint_fails_up_front(tmp_path, tiny_run_inputs, monkeypatch):
    monkeypatch.setattr(train, "Trainer", None)
    main_fails(
        cfg_of(*tiny_run_inputs, tmp_path / "none", resume=True),
        f"--resume: no checkpoint in {tmp_path / 'none' / 'ckpt'}",
    )


def test_export_names_the_damaged_file(two_checkpoints):
    out = two_checkpoints
    f = out / "ckpt" / "step_2" / "draft.safetensors"
    truncate(f)
    with pytest.raises(SystemExit) as e:
        export.main(export.ExportArgs(str(out)))
    assert f"export failed: {f} is damaged or unreadable" in str(e.value.code) and "step_1" in str(e.value.code)
    cfg = out / "ckpt" / "step_1" / "config.json"
    cfg.write_text(cfg.read_text()[:40])
    with pytest.raises(SystemExit, match=f"export failed: {cfg} is damaged or unreadable"):
        export.main(export.ExportArgs(str(out / "ckpt" / "step_1")))
    p = subprocess.run([sys.executable, "export.py", str(out)], cwd=ROOT, capture_output=True, text=True)
    failed(p, f"{f} is damaged or unreadable")


# ---------------------------------------------------------------- disk full while saving
def test_disk_full_during_checkpoint(tmp_path, tiny_run_inputs, monkeypatch):

    out = tmp_path / "run"
    real_save = torch.save

    def save(obj, f, *a, **k):
        if "step_2" in str(f):
            Path(f).write_bytes(b"\0" * 1000)  # a partial file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    msg = main_fails(
        cfg_of(*tiny_run_inputs, out, steps=3, ckpt_every=1),
        f"error: cannot write checkpoint {out / 'ckpt' / 'step_2'} (no space left on the device;",
        "removed the partial step_2.tmp; earlier checkpoints kept: step_1 (continue with --resume)",
    )
    assert "Traceback" not in msg
    assert sorted(d.name for d in (out / "ckpt").iterdir()) == ["latest", "step_1"]  # no step_2.tmp left behind
    assert (out / "ckpt" / "latest").read_text() == "step_1"
    load_file(out / "ckpt" / "step_1" / "draft.safetensors")
    torch.load(out / "ckpt" / "step_1" / "train_state.pt", weights_only=False)


# ---------------------------------------------------------------- non-finite loss, data, help
def test_nan_loss_names_an_existing_checkpoint(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    run_train(out, target, data, 0, [*FAST, "--steps", "3", "--stop-after", "1"])
    bad = tmp_path / "nan_target"
    shutil.copytree(target, bad)
    w = load_file(bad / "model.safetensors")
    w["model.norm.weight"][:] = float("nan")
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    p = run_train(out, bad, data, 0, [*FAST, "--steps", "3", "--resume"], check=False)
    failed(
        p,
        "non-finite loss at step 1",
        f"Last good checkpoint: {out / 'ckpt' / 'step_1'} (continue from it with --resume",
    )
    assert (out / "ckpt" / "step_1" / "draft.safetensors").exists()


def test_no_usable_examples_says_why(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    p = run_train(
        tmp_path / "out", target, data, 0, [*FAST, "--steps", "1", "--max-len", "40", "--holdout", "4"], check=False
    )
    failed(
        p,
        "only 4 usable examples, cannot hold out 4. [data]",
        "at --max-len 40: {",
        '"kept": 4',
        '"records": 16',
        '"skipped_nothing_trainable_within_max_len": 12',
    )
    assert not (tmp_path / "out" / "run.json").exists()
    # (nothing trainable at all is data/datasets.py's own message, with the same counts)
    failed(
        run_train(tmp_path / "out", target, data, 0, [*FAST, "--steps", "1", "--max-len", "4"], check=False),
        "none of the 16 records has anything to train on (max_len 4)",
        "skipped_nothing_trainable_within_max_len",
    )


def test_help_shows_config():
    p = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "--config" in p.stdout and "--overwrite" in p.stdout


def test_holdout_0_skips_held_out_evaluation(tmp_path, tiny_run_inputs):
    """No held-out split: say so, instead of printing and logging accuracies of 0.000 over no examples."""
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    p = run_train(out, target, data, 0, [*FAST, "--holdout", "0", "--steps", "2", "--eval-every", "1"])
    assert "[eval] --holdout 0: no held-out examples, so no held-out evaluation" in p.stdout
    assert "[eval @" not in p.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["split"] for r in rows] == ["train", "train"]
    assert "eval_end" not in json.loads((out / "run.json").read_text())["results"]


def test_no_eval_at_start(tmp_path, tiny_run_inputs):
    """--no-eval-at-start: the held-out split is evaluated during and after training, not before the first step."""
    target, data = tiny_run_inputs
    out = tmp_path / "run"
    p = run_train(out, target, data, 0, [*FAST, "--holdout", "4", "--steps", "2", "--no-eval-at-start"])
    assert "[eval @0]" not in p.stdout and "[eval @2]" in p.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [(r["step"], r["split"]) for r in rows] == [(1, "train"), (2, "train"), (2, "eval")]
    assert "eval_start" not in json.loads((out / "run.json").read_text())["results"]


def test_aux_layers_out_of_range(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    p = run_train(tmp_path / "o", target, data, 0, [*FAST, "--steps", "1", "--aux-layers", "0", "1", "9"], check=False)
    failed(p, "error: aux_layers [0, 1, 9] out of range for a 4-layer target (--aux-layers takes 0..3)")


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"k": (0,)}, "error: -k takes draft tokens per step, at least 1 each, got 0"),
        ({"k": (3, -1)}, "got -1"),
        ({"max_new_tokens": 0}, "error: --max-new-tokens must be at least 1, got 0"),
        ({"num_prompts": -1}, "error: --num-prompts must be at least 0 (0 = all), got -1"),
        ({"batch": 0}, "error: --batch must be at least 1, got 0"),
        ({"dtype": "fp16"}, "error: --dtype must be fp32 or bf16, got 'fp16'"),
        # the probe: -k 1 1 decoded every prompt twice; a --data given twice was read once, without a word
        ({"k": (1, 2, 1)}, "error: -k names 1 more than once (each value is one run)"),
        ({"data": ("mtbench", "mtbench")}, "error: --data names mtbench more than once (each value is one run)"),
        ({"tree_depth": 9}, "error: --tree-depth applies to the tree run: pass --tree-topk N too"),  # was ignored
        ({"threads": 10**12}, "--threads must be at most 1024 (this machine has"),  # an overflow traceback
    ],
)
def test_evaluate_refuses_bad_numbers_before_loading(tmp_path, kw, message):
    with pytest.raises(SystemExit) as e:
        evaluate.main(evaluate.EvalArgs(str(tmp_path / "no_draft"), **kw))  # refused before the draft is read
    assert str(e.value.code) == message if message.startswith("error") else message in str(e.value.code)


@pytest.mark.parametrize(
    "kw,message",
    [  # the probe (issue 35): options of the MoE MLP on the dense one were read by nothing, without a word
        ({"moe_top_k": 2}, "--moe-top-k applies to a mixture-of-experts draft: pass --moe-experts N too"),
        ({"moe_shared": True}, "--moe-shared applies to a mixture-of-experts draft"),
        ({"moe_mode": "params"}, "--moe-mode applies to a mixture-of-experts draft"),
        ({"moe_aux_coef": 1e12}, "--moe-aux-coef applies to a mixture-of-experts draft"),
        # a RuntimeError traceback from the allocator (the router's 10**12 outputs) once the target had loaded
        ({"moe_experts": 10**12}, "--moe-experts 1000000000000: at most 256 (every expert runs on every token"),
    ],
)
def test_moe_options_checked_before_anything(tmp_path, tiny_run_inputs, kw, message, monkeypatch):
    monkeypatch.setattr(train, "Trainer", None)
    main_fails(cfg_of(*tiny_run_inputs, tmp_path / "out", **kw), "error: " + message)
    assert not (tmp_path / "out").exists()


def test_moe_experts_too_many_for_the_target(tmp_path, tiny_run_inputs):
    """--moe-mode params splits the dense MLP (the tiny target's: 128 wide) over the experts: 200 left them 0
    wide, a draft with no MLP at all."""
    main_fails(
        cfg_of(*tiny_run_inputs, tmp_path / "out", moe_experts=200, moe_mode="params"),
        "error: --moe-experts 200 on this target: moe_experts 200 (params mode): the dense intermediate size 128 "
        "split 200 ways leaves experts 0 wide",
    )


@pytest.mark.parametrize(
    "kw,message",
    [  # the probe (issue 35): both were found only once the target had loaded
        ({"tp": 10**12}, "--tp 1000000000000 must divide the number of ranks (1) and needs --backend compiled"),
        ({"tp": 2, "features": "/a/store"}, "--tp 2 must divide the number of ranks (1)"),  # (was no 'error: ')
        ({"pack_row_multiple": 10**12}, "--pack-row-multiple 1000000000000 is more rows than a batch holds (2)"),
        ({"pack_row_multiple": 3, "batch_tokens": 128}, "--pack-row-multiple 3 is more rows than a batch holds (2)"),
    ],
)
def test_tp_and_row_padding_checked_before_anything(tmp_path, tiny_run_inputs, kw, message, monkeypatch):
    monkeypatch.setattr(train, "Trainer", None)
    main_fails(cfg_of(*tiny_run_inputs, tmp_path / "out", **kw), "error: " + message)
    assert not (tmp_path / "out").exists()
    train.validate(cfg_of(*tiny_run_inputs, tmp_path / "out", tp=2), world=2)  # one tp group of 2: fine


@pytest.mark.parametrize(
    "kw,message",
    [  # the probe (issue 35): --producers -1 was a ZeroDivisionError, 10**12 started processes until killed
        ({"producers": -1}, "--producers must be at least 0 and at most 1024 (the launcher starts them all on"),
        ({"producers": 10**12}, "--producers must be at least 0 and at most 1024"),
        (
            {"producers": 1, "consumer_ranks": 0},
            "--consumer-ranks must be at least 1 and at most 1024 (the launcher starts them all on this host), got 0",
        ),
        ({"producers": 1, "heartbeat": float("nan")}, "--heartbeat must be a finite number of seconds above 0"),
        ({"producers": 1, "lease_timeout": 0.0}, "--lease-timeout must be a finite number of seconds above 0"),
        ({"producers": 1, "max_attempts": 0}, "--max-attempts must be at least 1, got 0"),
        # every deployment option without --producers or --role was read by nothing, without a word
        ({"consumer_ranks": 2}, "--consumer-ranks applies to disaggregated training (--producers N, or --role"),
        ({"lease_size": -1}, "--lease-size must be at least 0, got -1"),
        ({"lease_size": 8}, "--lease-size applies to disaggregated training"),
        ({"control": "/tmp/ctl"}, "--control applies to disaggregated training"),
    ],
)
def test_deploy_options_checked_before_anything(tmp_path, tiny_run_inputs, kw, message, monkeypatch):
    monkeypatch.setattr(train, "Trainer", None)
    cfg = cfg_of(*tiny_run_inputs, tmp_path / "out", deploy=DeployConfig(**kw))
    main_fails(cfg, "error: " + message)
    assert not (tmp_path / "out").exists()


def test_control_dir_of_other_files_is_refused(tmp_path, tiny_run_inputs):
    """A fresh disaggregated run deletes the control.db and features/ of its --control: `--control runs` took
    runs/features, capture.py features' default store. Refused before anything starts."""
    ctl = tmp_path / "runs"
    (ctl / "features").mkdir(parents=True)
    (ctl / "features" / "store.json").write_text("{}")
    cfg = cfg_of(*tiny_run_inputs, tmp_path / "out", deploy=DeployConfig(producers=1, control=str(ctl)))
    with pytest.raises(train.ConfigError, match="holds files of no run's control directory \\(features\\)"):
        train.check_inputs(cfg)
    assert (ctl / "features" / "store.json").read_text() == "{}"
