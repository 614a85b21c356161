"""Each command pointed at another command's output (issue 35): a draft export, a training run, a checkpoint,
a feature store or a gate run given where a target model, chats, a store or an --out goes is refused by name
before anything loads, as one `error:` line, and nothing is written or changed."""

import errno
import json
import re
import sys
import tempfile
from pathlib import Path

import pytest

import capture
import core.vllm_spec
import evaluate
import export
import gate
import train
from core import prompts
from core.runlog import output_kind
from core.vllm_spec import VENV_MARKER, VllmError, venv_problem
from models.target import target_context
from tests.test_bad_input import cfg_of, failed, main_fails, snapshot
from tests.test_export import make_checkpoint
from tests.test_speculative import tiny_eval_args
from tests.test_train_e2e import run_train

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "drafts" / "smollm2-135m-eagle3"  # export.py's output, shipped


def outputs(tmp_path: Path) -> dict[str, Path]:
    """Directories as each command leaves them (only the files that tell them apart)."""
    made = {
        "export": {".nanospec-export": "", "config.json": json.dumps({"architectures": ["LlamaForCausalLMEagle3"]})},
        "run": {"run.json": "{}", "metrics.jsonl": ""},
        "checkpoint": {"draft.safetensors": "", "config.json": json.dumps({"strategy": "eagle3", "draft": {}})},
        "store": {"store.json": "{}"},
        "gate": {"gate.json": "{}"},
    }
    out = {}
    for name, files in made.items():
        d = tmp_path / name
        d.mkdir()
        for f, text in files.items():
            (d / f).write_text(text)
        out[name] = d
    return out


def test_output_kind_names_each_command(tmp_path):
    kinds = {name: output_kind(d) for name, d in outputs(tmp_path).items()}
    assert kinds == {
        "export": "a draft export (export.py --out)",
        "run": "a training run (train.py --out)",
        "checkpoint": "a training checkpoint (train.py's ckpt/step_N)",
        "store": "a feature store (capture.py features --out)",
        "gate": "a gate.py run directory (gate.py --out)",
    }
    assert output_kind(SHIPPED) == "a draft export (export.py --out)"
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert output_kind(tmp_path / "hf") is None and output_kind(tmp_path / "none") is None
    (tmp_path / "spec").mkdir()
    (tmp_path / "spec" / "config.json").write_text(json.dumps({"architectures": ["Eagle3Speculator"]}))
    assert output_kind(tmp_path / "spec") == "a draft model (config.json: architectures ['Eagle3Speculator'])"


# ---------------------------------------------------------------- train.py
def test_train_target_that_is_a_draft_export(tmp_path, tiny_run_inputs, monkeypatch):
    """Was a RuntimeError traceback from transformers (ignore_mismatched_sizes) after --out was created."""
    monkeypatch.setattr(train, "Trainer", None)  # refused before the target or the data load
    _, data = tiny_run_inputs
    msg = main_fails(
        cfg_of(SHIPPED, data, tmp_path / "out"),
        f"error: --target {SHIPPED} is a draft export (export.py --out), not a target model: pass the model the "
        "draft is for (a Hugging Face causal-LM directory, a .gguf file or 'smollm2')",
    )
    assert msg.count("\n") == 0 and not (tmp_path / "out").exists()
    p = run_train(tmp_path / "out", SHIPPED, data, 0, ["--steps", "1"], check=False)  # the command line too
    failed(p, f"error: --target {SHIPPED} is a draft export (export.py --out), not a target model")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "field,given,message",
    [
        ("target", "run", "--target {} is a training run (train.py --out), not a target model"),
        ("data", "run", "--data {} is a training run (train.py --out), not chats"),
        ("data", "export", "--data {} is a draft export (export.py --out), not chats"),
        ("features", "export", "--features {} is a draft export (export.py --out), not a feature store"),
        ("init_draft", "export", "--init-draft {} is a draft export (export.py --out); --init-draft takes a "),
        ("init_draft", "store", "--init-draft {} is a feature store (capture.py features --out), not a training"),
        ("init_draft", "none", "--init-draft {}: no such checkpoint or run directory"),
        ("out", "export", "--out {} is a draft export (export.py --out): a run written there would mix with"),
        ("out", "store", "--out {} is a feature store (capture.py features --out): a run written there"),
        ("out", "checkpoint", "--out {} is a training checkpoint (train.py's ckpt/step_N): a run written"),
    ],
)
def test_train_refuses_other_outputs(tmp_path, tiny_run_inputs, monkeypatch, field, given, message):
    """The export, store and checkpoint as --out took a run among their files (export.py --out replaces an
    export's directory whole); the others failed after the target loaded with a message about their insides."""
    monkeypatch.setattr(train, "Trainer", None)
    made = outputs(tmp_path)
    path = made.get(given, tmp_path / given)
    before = {name: snapshot(d) for name, d in made.items()}
    target, data = tiny_run_inputs
    kw = {"target": target, "data": data, "out": tmp_path / "new", field: str(path)}
    main_fails(cfg_of(kw.pop("target"), kw.pop("data"), kw.pop("out"), **kw), "error: " + message.format(path))
    assert {name: snapshot(d) for name, d in made.items()} == before and not (tmp_path / "new").exists()


@pytest.mark.parametrize("given", ["", "user", "target"])
def test_train_out_that_holds_other_files(tmp_path, tiny_run_inputs, monkeypatch, given):
    """The probe: `--out ""` wrote the run into the current directory (a checkout's root took ckpt/, tb/,
    metrics.jsonl and run.json); a folder of a user's files or the target model's own folder took the run among
    their files. An empty directory, a new one or an earlier run's (with --resume / --overwrite) still do."""
    monkeypatch.setattr(train, "Trainer", None)
    target, data = tiny_run_inputs
    out = {"": "", "user": tmp_path / "user", "target": target}[given]
    if given == "user":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    before = snapshot(Path(out)) if out else None
    first = "notes.txt" if given == "user" else "chat_template.jinja, config.json"
    msg = (
        f"error: --out {out} holds files no run wrote ({first}"
        if out
        else "error: --out is empty: give the run's directory (a new or empty one, e.g. runs/NAME)"
    )
    main_fails(cfg_of(target, data, out), msg)
    assert not out or snapshot(Path(out)) == before


def test_train_out_holding_only_its_log_is_taken(tmp_path, tiny_run_inputs):
    """`mkdir runs/x && python train.py --out runs/x > runs/x/train.log` (and experiments/sweep.py's runs): the
    shell makes the log before train.py starts; a directory of nothing else is not somebody's files."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "train.log").write_text("")
    train.check_inputs(cfg_of(*tiny_run_inputs, out))  # no ConfigError
    (out / "notes.txt").write_text("mine")
    with pytest.raises(train.ConfigError, match="holds files no run wrote \\(notes.txt\\)"):
        train.check_inputs(cfg_of(*tiny_run_inputs, out))


# ---------------------------------------------------------------- gate.py
def gate_fails(capsys, message: str, **kw) -> str:
    assert gate.main(gate.GateConfig(**kw)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    return err


def test_gate_out_it_cannot_or_must_not_write(tmp_path, capsys, monkeypatch):
    """A file or a read-only --out was a FileExistsError / PermissionError traceback; a folder of other files
    (`--out runs`) had its train/ replaced by the overfit run and its train.jsonl overwritten."""
    made = outputs(tmp_path)
    f = tmp_path / "afile"
    f.write_text("x")
    gate_fails(capsys, f"error: --out {f} is a file, not a directory", out=str(f))
    gate_fails(capsys, f"--out {made['run']} is a training run (train.py --out): gate.py writes", out=str(made["run"]))
    runs = tmp_path / "runs"
    (runs / "train").mkdir(parents=True)
    (runs / "train" / "run.json").write_text("{}")
    (runs / "train.jsonl").write_text("mine\n")
    before = snapshot(runs)
    gate_fails(
        capsys, f"--out {runs} holds files an earlier gate run did not write (train, train.jsonl)", out=str(runs)
    )
    assert snapshot(runs) == before

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    gate_fails(
        capsys, f"error: --out {tmp_path / 'g'}: cannot write there (Read-only file system)", out=str(tmp_path / "g")
    )
    assert not (tmp_path / "g" / "gate.json").exists()


@pytest.mark.parametrize(
    "given,message",
    [
        ("file", "--ckpt {} is a file: give a training run or checkpoint (train.py --out, or its ckpt/step_N) or a"),
        ("store", "--ckpt {} is a feature store (capture.py features --out): give a training run"),
        ("empty", "--ckpt {}: not a training run, checkpoint or serving dir"),
        ("checkpoint", "--ckpt {}: a training run or checkpoint needs --sample (the gate run's sample.json)"),
    ],
)
def test_gate_ckpt_of_the_wrong_kind(tmp_path, capsys, given, message):
    """A file as --ckpt was an export failure or 'needs --sample' at the sample stage, a gate verdict."""
    made = outputs(tmp_path)
    (tmp_path / "file").write_text("{}")
    (tmp_path / "empty").mkdir()
    ckpt = made.get(given, tmp_path / given)
    gate_fails(capsys, message.format(ckpt), out=str(tmp_path / "g"), ckpt=str(ckpt), target="/no/target")
    report = json.loads((tmp_path / "g" / "gate.json").read_text())
    assert report["failed_stage"] == "input"


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"k": 0}, "error: --k must be at least 1, got 0"),  # ValueError traceback after the sample stage
        ({"max_steps": 0}, "error: --max-steps must be at least 1, got 0"),  # AttributeError traceback
        ({"strategy": "nope"}, "error: --strategy 'nope': the gate serves a draft on vLLM, which loads eagle3"),
        ({"export_dtype": "fp8"}, "error: --export-dtype must be bf16, fp16 or fp32, got 'fp8'"),  # after training
        ({"min_acc": 2.0}, "error: --min-acc must be a finite number in [0, 1], got 2.0"),  # could never pass
        ({"target": str(SHIPPED)}, f"error: --target {SHIPPED} is a draft export (export.py --out), not a target"),
        # the probe: a checkpoint or an export as --data was read as records ('GATE FAILED at sample: bad record')
        (
            {"data": str(SHIPPED)},
            f"error: --data {SHIPPED} is a draft export (export.py --out), not chats (a ShareGPT/messages JSON or "
            "JSONL)",
        ),
        # the probe: both decoded or drafted until killed
        (
            {"response_tokens": 10**12},
            "error: --max-prompt-tokens 64 + --response-tokens 1000000000000 must fit --max-len 256 (the sample is "
            "one training row)",
        ),
        ({"k": 10**12}, "error: --k 1000000000000 drafts more tokens a step than the 48 --response-tokens"),
        # the probe: both scanned every record, then failed stage 1 ('no valid sample') or stage 2 (train.py's line)
        (
            {"min_trainable": 10**12},
            "error: --min-trainable 1000000000000 can never be met: the sample is one row of --max-len 256 tokens, of "
            "which at most 254 are trained",
        ),
        (
            {"target": "TINY", "draft_vocab_size": 10**6},
            "error: --draft-vocab-size 1000000 is larger than the target's vocabulary",
        ),
        (
            {"vllm_timeout": 10**12},
            "error: --vllm-timeout must be at most 2592000 seconds (30 days), got 1000000000000",
        ),
        # the probe: flags train.py does not take failed stage 2 with tyro's box, after the sample stage
        (
            {"train_args": ("--fc-norm", "--nope")},
            "error: --train-args '--fc-norm --nope': not train.py flags (Unrecognized options; Unrecognized options: "
            "--nope)",
        ),
    ],
)
def test_gate_refuses_bad_options_before_loading(tmp_path, capsys, tiny_run_inputs, kw, message):
    if kw.get("target") == "TINY":  # a real target dir: its config.json names the vocabulary
        kw = {**kw, "target": str(tiny_run_inputs[0])}
    gate_fails(capsys, message, **{"out": str(tmp_path / "g"), "target": "/no/target", **kw})
    assert json.loads((tmp_path / "g" / "gate.json").read_text())["failed_stage"] == "input"


@pytest.mark.parametrize(
    "given,message",
    [
        ("user", "vLLM venv {} is a directory but no virtualenv (no pyvenv.cfg); nothing in it is touched"),
        ("file", "vLLM venv {} is a file: give a new path"),
        ("venv", "vLLM venv {} is a virtualenv without vllm, not built here; nothing in it is touched"),
    ],
)
def test_vllm_venv_that_is_not_ours_is_never_replaced(tmp_path, capsys, given, message):
    """The probe: a --vllm-venv that did not import vllm was deleted whole before the venv was built there, so
    `gate.py --vllm-venv runs` (a folder of runs) or `--vllm-venv .venv` (the project's venv) lost it. gate.py
    refuses it up front; ensure_venv (evaluate.py --vllm, capture.py --backend vllm: NANOSPEC_VLLM_VENV) too."""
    made = {"user": {"notes.txt": "mine"}, "venv": {"pyvenv.cfg": "home = /usr/bin", "bin/python": ""}}
    path = tmp_path / given
    if given == "file":
        path.write_text("mine")
    for name, text in made.get(given, {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    before = snapshot(path) if path.is_dir() else path.read_bytes()
    gate_fails(capsys, "error: --vllm-venv: " + message.format(path), out=str(tmp_path / "g"), vllm_venv=str(path))
    with pytest.raises(VllmError, match=re.escape(message.format(path))):
        core.vllm_spec.ensure_venv(path, log=lambda msg: None)  # through the module: a test here swaps it
    assert (snapshot(path) if path.is_dir() else path.read_bytes()) == before
    assert venv_problem(tmp_path / "new") is None  # built there
    if given == "venv":  # one this file started building (its marker) is rebuilt in place, as before
        (path / VENV_MARKER).write_text("")
        assert venv_problem(path) is None


def test_gate_serves_within_the_target_context(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    """The probe: on the tiny 256-position target vLLM refused the gate's max_model_len 1024 ('GATE FAILED at
    serve' for a draft that was never served); it is the target's context where that is smaller."""
    jobs = []
    monkeypatch.setattr(core.vllm_spec, "ensure_venv", lambda venv, log: None)
    monkeypatch.setattr(core.vllm_spec, "run_job", lambda job, *a, **kw: jobs.append(job) or {})
    target, _ = tiny_run_inputs
    gate.run_vllm(gate.GateConfig(), str(target), tmp_path, [1, 2], 4, tmp_path)
    gate.run_vllm(gate.GateConfig(), str(tmp_path), tmp_path, [1, 2], 4, tmp_path)  # a config naming no context
    assert jobs[0]["max_model_len"] == 256 and jobs[1]["max_model_len"] == 1024
    assert "[gate] stage 3 vLLM: serving the draft (K=3; the engine's start takes minutes" in capsys.readouterr().out


# ---------------------------------------------------------------- capture.py
def capture_fails(run, message: str):
    with pytest.raises(SystemExit) as e:
        run()
    assert str(e.value.code) == message, str(e.value.code)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"num_records": -1}, "error: --num-records must be at least 0 (0 = all), got -1"),  # said 'the file is empty'
        ({"shard_mb": 0}, "error: --shard-mb must be at least 1, got 0"),  # a shard per sample
        ({"batch_tokens": 0}, "error: --batch-tokens must be at least 64 (one sample of --max-len 64), got 0"),
        ({"max_len": -5}, "error: --max-len must be at least 2, got -5"),  # captured a store
        ({"time_limit": -1.0}, "error: --time-limit must be a finite number at least 0 (0 = none), got -1.0"),
        ({"aux_layers": (1, 1)}, "error: --aux-layers 1 1: distinct layer indices, 0 or more"),  # train.py refuses
        ({"target": str(SHIPPED)}, f"error: --target {SHIPPED} is a draft export (export.py --out), not a target"),
    ],
)
def test_capture_features_refuses_bad_options_before_anything(tmp_path, kw, message):
    cfg = capture.FeaturesConfig(
        **{"target": "/no/t", "data": "/no/d.jsonl", "out": str(tmp_path / "s"), "max_len": 64, **kw}
    )
    with pytest.raises(SystemExit) as e:
        capture.features(cfg)
    assert str(e.value.code).startswith(message), str(e.value.code)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("given", ["run", "export", "checkpoint", "gate", "folder"])
def test_capture_features_out_of_another_kind(tmp_path, given):
    """--out a training run (or an export, a model's folder, ...) took a feature store among its files."""
    made = outputs(tmp_path)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))  # e.g. the target
    (folder / "model.safetensors").write_text("")
    out = made.get(given, folder)
    before = snapshot(out)
    message = (
        f"error: --out {out} holds files that are not a feature store's (config.json, model.safetensors): give a "
        "new or empty directory"
        if given == "folder"
        else f"error: --out {out} is {output_kind(out)}, not a feature store: give a new or empty directory"
    )
    capture_fails(lambda: capture.features(capture.FeaturesConfig(target="/no/t", data="/no/d", out=str(out))), message)
    assert snapshot(out) == before
    # what a store's first write leaves before its store.json (a crash there) is resumed, not refused
    (tmp_path / "crashed" / "shards").mkdir(parents=True)
    (tmp_path / "crashed" / ".store.json.host-rank0.tmp").write_text("{}")
    capture.check_store_out(tmp_path / "crashed")
    capture.check_store_out(made["store"])


@pytest.mark.parametrize("command", ["features", "regenerate", "prompts"])
def test_capture_target_or_data_of_another_command(tmp_path, command):
    """A draft export as --target was a tokenizer error after seconds; a training run as --data an error about its
    metrics.jsonl not being chats."""
    run = outputs(tmp_path)["run"]
    out = str(tmp_path / ("s" if command == "features" else "o.jsonl"))
    make = {
        "features": lambda **kw: capture.features(capture.FeaturesConfig(out=out, **kw)),
        "regenerate": lambda **kw: capture.regenerate(capture.RegenConfig(out=out, **kw)),
        "prompts": lambda **kw: capture.write_prompts(capture.PromptsConfig(out=out, **kw)),
    }[command]
    capture_fails(
        lambda: make(target=str(SHIPPED)),
        f"error: --target {SHIPPED} is a draft export (export.py --out), not a target model (a Hugging Face model "
        "dir, a .gguf or 'smollm2')",
    )
    if command != "prompts":
        capture_fails(
            lambda: make(target="/no/t", data=str(run)),
            f"error: --data {run} is a training run (train.py --out), not chats (a ShareGPT/messages-style file or "
            "directory)",
        )
    assert not Path(out).exists()


def test_capture_engine_refused_before_loading(tmp_path):
    message = "error: --engine must be auto, slots or hf, got 'nope'"  # was refused after the target loaded
    capture_fails(lambda: capture.regenerate(capture.RegenConfig(target="/no/t", engine="nope")), message)
    capture_fails(lambda: capture.write_prompts(capture.PromptsConfig(target="/no/t", engine="nope")), message)
    capture_fails(
        lambda: capture.write_prompts(capture.PromptsConfig(target="/no/t", min_words=-1)),
        "error: --min-words must be at least 0, got -1",
    )


def test_capture_time_limit_exits_75(tmp_path, tiny_run_inputs, monkeypatch, capsys):
    """A run --time-limit stopped unfinished exited 0 like a finished one; now 75 (train.py's EX_TEMPFAIL), in
    each subcommand; finished (or stopped by --max-output-mb, as asked) is 0."""
    target, data = tiny_run_inputs

    def exit_code(*args) -> int:
        monkeypatch.setattr(sys, "argv", ["capture.py", *map(str, args)])
        try:
            capture.main()
        except SystemExit as e:
            return e.code
        return 0

    store = ["features", "--target", target, "--data", data, "--out", tmp_path / "s", "--num-records", 4]
    store += ["--max-len", 64]
    assert exit_code(*store, "--time-limit", 1e-3) == 75  # stops before the first shard
    assert exit_code(*store) == 0 and json.loads((tmp_path / "s" / "store.json").read_text())
    regen = ["regenerate", "--target", target, "--data", data, "--out", tmp_path / "r.jsonl", "--num-records", 2]
    regen += ["--max-new-tokens", 2, "--engine", "hf"]
    assert exit_code(*regen, "--time-limit", 1e-3) == 75
    assert exit_code(*regen, "--max-output-mb", 1e-9) == 0  # nothing written yet: it runs (as asked)
    sample = ["prompts", "--target", target, "--out", tmp_path / "p.jsonl", "--batch-size", 2, "--engine", "hf"]
    assert exit_code(*sample, "--time-limit", 1e-3) == 75
    prov = json.loads((tmp_path / "p.provenance.json").read_text())
    assert prov["runs"][-1]["status"] == "stopped_by_time_limit"
    for command in ("features", "regenerate", "prompts"):  # --help says so
        exit_code(command, "--help")
        text = " ".join(re.sub("[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
        assert "exit 75 when it stops so" in text, (command, text)


def test_capture_prompts_that_are_all_dropped_stop(tmp_path, tiny_run_inputs, monkeypatch):
    """--temperature 0 samples the same prompts again (dropped as repeats), a --max-new-tokens no prompt ends
    within drops them all: the loop never ended. Now it stops with an error naming the reasons."""
    target, _ = tiny_run_inputs
    monkeypatch.setattr(prompts, "ALL_DROPPED_STOP", 8)
    cfg = prompts.PromptsConfig(
        target=str(target), out=str(tmp_path / "p.jsonl"), batch_size=4, max_new_tokens=2, engine="hf", temperature=0
    )
    with pytest.raises(SystemExit) as e:
        prompts.write_prompts(cfg)
    msg = str(e.value.code)
    assert msg.startswith("error: the last 8 prompts sampled were all dropped ({'no_end_of_turn': 8}), so ")
    assert "--num-prompts 1000 would never be reached (0 kept in" in msg
    prov = json.loads((tmp_path / "p.provenance.json").read_text())
    assert prov["runs"][-1]["status"] == "stopped_all_dropped" and prov["counts"]["batches"] == 2


# ---------------------------------------------------------------- evaluate.py
def evaluate_fails(tmp_path, message: str, **kw):
    with pytest.raises(SystemExit) as e:  # the draft does not exist: refused before anything loads
        evaluate.main(evaluate.EvalArgs(str(tmp_path / "no_draft"), data=("mtbench",), **kw))
    assert str(e.value.code) == message, str(e.value.code)


def test_evaluate_target_that_is_a_draft_export(tmp_path):
    """Was a RuntimeError traceback from transformers after the prompt sets and the draft had loaded."""
    evaluate_fails(
        tmp_path,
        f"error: --target {SHIPPED} is a draft export (export.py --out), not a target model (the draft is the first "
        "argument)",
        target=str(SHIPPED),
    )


def test_evaluate_device_checked_before_loading(tmp_path):
    """--device tpu was a RuntimeError traceback once both models had loaded."""
    evaluate_fails(tmp_path, "error: --device must be cpu, cuda or cuda:N, got 'tpu'", device="tpu")
    evaluate_fails(tmp_path, "error: --device must be cpu, cuda or cuda:N, got 'cuda:x'", device="cuda:x")


def test_evaluate_out_appends_only_to_its_own_results(tmp_path):
    """--out a run's metrics.jsonl had evaluate's result line appended to the run's record."""
    run = outputs(tmp_path)["run"]
    metrics = run / "metrics.jsonl"
    metrics.write_text('{"step": 1, "split": "train", "loss": 2.5}\n')
    evaluate_fails(
        tmp_path,
        f"error: --out {metrics}:1 is not a result line of evaluate.py, and --out is appended to: give a new file "
        "name, or one that earlier evaluate.py runs wrote",
        out=str(metrics),
    )
    assert metrics.read_text() == '{"step": 1, "split": "train", "loss": 2.5}\n'
    ours = tmp_path / "results.jsonl"
    ours.write_text(json.dumps({"draft": "d", "results": {"mtbench": {}}}) + "\n")
    evaluate.check_out(ours)  # an earlier run's results: appended to
    # the probe: capture.py prompts' output with no prompt kept yet (empty) took a result line, which its next
    # run would have read back as a prompt
    (tmp_path / "p.jsonl").write_text("")
    (tmp_path / "p.provenance.json").write_text("{}")
    evaluate_fails(
        tmp_path,
        f"error: --out {tmp_path / 'p.jsonl'} is capture.py's output (its p.provenance.json beside it), and --out is "
        "appended to: give a new file name, or one that earlier evaluate.py runs wrote",
        out=str(tmp_path / "p.jsonl"),
    )
    assert (tmp_path / "p.jsonl").read_text() == ""


def test_evaluate_resume_file_in_a_new_directory(tiny_run_inputs, tmp_path):
    """--resume-file in a directory that did not exist was a FileNotFoundError traceback after the first dataset
    was decoded (its results lost); now the directory is made, and a place that cannot be written is refused
    before anything loads."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "Count to ten."}) + "\n")
    args = dict(tiny_eval_args(tiny_run_inputs, tmp_path), data=(str(tmp_path / "p.jsonl"),), max_new_tokens=4, k=(2,))
    resume = tmp_path / "new" / "sub" / "r.json"
    evaluate.main(evaluate.EvalArgs(**args, resume_file=str(resume)))
    assert set(json.loads(resume.read_text())["results"]) == {"p"}
    (tmp_path / "afile").write_text("x")
    evaluate_fails(
        tmp_path,
        f"error: --resume-file {tmp_path / 'afile' / 'r.json'}: cannot write there (Not a directory)",
        resume_file=str(tmp_path / "afile" / "r.json"),
    )


def test_evaluate_k_beyond_max_new_tokens(tmp_path):
    """-k 100000 drafted 100000 tokens a step, one draft forward each, with 4 to be verified: it looked hung."""
    message = "error: -k 100000 drafts more tokens a step than --max-new-tokens 4 lets be verified"
    evaluate_fails(tmp_path, message, k=(3, 100000), max_new_tokens=4)
    message = "error: --tree-depth 9 drafts more tokens a step than --max-new-tokens 4 lets be verified"
    evaluate_fails(tmp_path, message, tree_topk=2, tree_depth=9, max_new_tokens=4)


def test_evaluate_max_new_tokens_beyond_the_context(tiny_run_inputs, tmp_path):
    """--max-new-tokens 100000 on a 256-position target decoded for minutes past its context, printing nothing."""
    target, _ = tiny_run_inputs
    with pytest.raises(SystemExit) as e:
        evaluate.main(evaluate.EvalArgs(**tiny_eval_args(tiny_run_inputs, tmp_path), max_new_tokens=100000))
    assert str(e.value.code) == (
        f"error: --max-new-tokens 100000 does not fit the target's context of 256 tokens (max_position_embeddings in "
        f"{target / 'config.json'})"
    )


def test_evaluate_tree_topk_beyond_the_draft_vocab(tiny_run_inputs, tmp_path):
    """The probe: --tree-topk 10**12 was a RuntimeError traceback from topk once both models had loaded."""
    args = tiny_eval_args(tiny_run_inputs, tmp_path)
    with pytest.raises(SystemExit) as e:
        evaluate.main(evaluate.EvalArgs(**args, data=("mtbench",), max_new_tokens=8, tree_topk=10**12))
    assert str(e.value.code) == "error: --tree-topk 1000000000000 is more than the draft's vocabulary of 64"


def test_evaluate_vllm_failure_is_one_error_line(tiny_run_inputs, tmp_path, monkeypatch, capsys):
    """The probe: --vllm on the tiny target was a VllmError traceback after every dataset had been decoded (vLLM
    refused max_model_len 4096 on a 256-position target: it is the target's context now); the results print first."""

    def fails(*a, **kw):
        raise VllmError("vLLM exited 1: no vLLM here")

    monkeypatch.setattr(evaluate, "vllm_agreement", fails)
    args = tiny_eval_args(tiny_run_inputs, tmp_path)
    with pytest.raises(SystemExit) as e:
        evaluate.main(evaluate.EvalArgs(**{**args, "num_prompts": 1}, data=("mtbench",), max_new_tokens=4, vllm=True))
    assert str(e.value.code) == "error: --vllm: the replay in vLLM failed: vLLM exited 1: no vLLM here"
    printed = capsys.readouterr().out
    assert '"results": {"mtbench"' in printed and "[vllm] chain3: replaying 2 turns in vLLM" in printed

    assert target_context(tiny_run_inputs[0]) == 256 and target_context(tmp_path) is None


@pytest.mark.parametrize("command", ["regenerate", "prompts"])
def test_capture_generation_beyond_the_context(tmp_path, tiny_run_inputs, command):
    """--max-new-tokens 100000 on a 256-position target decoded past its context for as long as asked."""
    target, data = tiny_run_inputs
    out = str(tmp_path / "o.jsonl")
    if command == "regenerate":
        run = lambda: capture.regenerate(
            capture.RegenConfig(target=str(target), data=str(data), out=out, max_new_tokens=100000)
        )  # noqa: E731
        what = "--max-new-tokens (100000)"
    else:
        run = lambda: capture.write_prompts(capture.PromptsConfig(target=str(target), out=out, max_new_tokens=100000))  # noqa: E731
        what = "--max-new-tokens (100000)"
    capture_fails(
        run,
        f"error: {what} does not fit the target's context of 256 tokens (max_position_embeddings in "
        f"{target / 'config.json'})",
    )
    assert not list(tmp_path.iterdir())


def test_regenerate_prompts_fit_the_context_with_their_reply(tmp_path, tiny_run_inputs, capsys):
    """The probe: --max-prompt-len (2048 by default) past a 256-position target was accepted, so a long prompt and
    its reply ran the target past its context. A prompt may now take the context less --max-new-tokens (said in one
    line; a longer turn ends its conversation, counted as prompt_too_long); none left is an error before writing."""
    target, data = tiny_run_inputs
    out = tmp_path / "o.jsonl"
    kw = dict(target=str(target), data=str(data), out=str(out), num_records=4, batch_size=2, engine="hf")
    capture_fails(
        lambda: capture.regenerate(capture.RegenConfig(**kw, max_new_tokens=256)),
        "error: --max-new-tokens 256 leaves no room for a prompt in the target's context of 256 tokens",
    )
    assert not list(tmp_path.iterdir())
    capture.regenerate(capture.RegenConfig(**kw, max_new_tokens=236))
    said = capsys.readouterr().out
    assert "[regen] prompts up to 20 tokens: the target's context (256) less --max-new-tokens (236)" in said
    dropped = [json.loads(x) for x in (tmp_path / "o.dropped.jsonl").read_text().splitlines()]
    assert dropped and all("prompt_too_long" in json.dumps(d) for d in dropped)


# ---------------------------------------------------------------- export.py
@pytest.mark.parametrize(
    "given,message",
    [
        ("none", "target '{}' not found: pass an HF model directory, a .gguf file, or 'smollm2'"),
        ("file", "target file {} is not a .gguf file"),
        ("empty", "target directory {} has no config.json"),
        ("run", "--target {} is a training run (train.py --out), not a target model"),
        ("store", "--target {} is a feature store (capture.py features --out), not a target model"),
    ],
)
def test_export_target_given_must_be_a_target(tmp_path, given, message):
    """The probe: an --target without a config.json (a missing path, a file, another command's output, even
    'smollm2') was skipped without a word: the export skipped the check that the draft fits the target and the
    tokenizer digest, recorded the wrong path as its target, and exited 0."""
    run, _, _ = make_checkpoint(tmp_path)
    (tmp_path / "made").mkdir()
    made = outputs(tmp_path / "made")
    (tmp_path / "file").write_text("{}\n")
    (tmp_path / "empty").mkdir()
    path = made.get(given, tmp_path / given)
    with pytest.raises(SystemExit) as e:
        export.main(export.ExportArgs(ckpt=str(run), target=str(path), out=str(tmp_path / "x")))
    msg = str(e.value.code)
    assert msg.startswith("error: export failed: ") and message.format(path) in msg, msg
    assert not (tmp_path / "x").exists()
    export.main(export.ExportArgs(ckpt=str(run), target=str(tmp_path / "target"), out=str(tmp_path / "x")))
    assert json.loads((tmp_path / "x" / "config.json").read_text())["nanospec_export"]["target"] == str(
        tmp_path / "target"
    )
