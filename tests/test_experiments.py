"""CPU smoke of the paper-reproduction sweeps on a tiny random target: each script trains and
evaluates one run and appends one row, a second call skips it, and plot.py draws every figure."""

import csv
import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from core.config import DeployConfig, cli, to_flags
from core.train_config import TrainConfig, parse_cli
from experiments.multi_gpu import train_flags

ROOT = Path(__file__).resolve().parents[1]


def run(args, timeout=300):
    p = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, f"{args[0]} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny_run_inputs):
    """The three sweeps' smoke runs, into one results dir."""
    target, data = tiny_run_inputs
    res = tmp_path_factory.mktemp("results")
    for study, setting in (("ttt_scaling", "ttt13"), ("moe_drafts", "shared-e4"), ("data_regen", "regenerated")):
        common = [
            f"experiments/{study}.py",
            "--smoke",
            "--target",
            str(target),
            "--csv",
            str(res / f"{study}.csv"),
            "--runs-dir",
            str(res / "runs"),
        ]
        if study != "data_regen":  # data_regen builds its own matched data files
            common += ["--data", str(data)]
        out = run(common)
        assert f"{setting} seed 0: tau" in out
        assert "0 runs to do, 1 already in" in run(common)  # finished runs are skipped
    return res


@pytest.fixture(scope="module")
def families(tmp_path_factory, tiny_run_inputs):
    """families.py's smoke for one chain drafter and one block drafter: its CSV."""
    target, data = tiny_run_inputs
    results = tmp_path_factory.mktemp("families")
    common = [
        "experiments/families.py",
        "--smoke",
        "--only",
        "eagle3",
        "dflash",
        "--target",
        str(target),
        "--data",
        str(data),
        "--csv",
        str(results / "families_h200.csv"),
        "--runs-dir",
        str(results / "runs"),
    ]
    out = run(common)
    print(out)  # the smoke output, for -s
    assert "eagle3 seed 0: tau" in out and "dflash seed 0: tau" in out
    assert "0 runs to do, 2 already in" in run(common)
    return results / "families_h200.csv"


def test_families_one_row_per_run(families):
    """One row per run; per K, τ >= 1 on every benchmark, a measured draft cost c > 0 (its batch-1 pass), speed-up
    = τ / (1 + c) per benchmark, and per-position acceptance rates that fall with the position and add up to τ - 1."""
    rows = list(csv.DictReader(open(families)))
    assert sorted(r["setting"] for r in rows) == ["dflash", "eagle3"]
    for r in rows:
        cfg = json.loads(r["config"])
        assert cfg["strategy"] == r["setting"] and cfg["steps"] == 2 and cfg["ttt_length"] == 7
        # one token budget for every family (the smoke's: two packed rows of its max-len), in the row's skip key
        assert cfg["batch_tokens"] == 128 and "--batch-tokens 128" in r["train_cmd"]
        assert json.loads(r["scale"])["batch_tokens"] == 128
        assert r["eval_ks"] == "3 7" and float(r["draft_params_m"]) > 0
        for k in (3, 7):
            c = float(r[f"draft_cost_k{k}"])
            assert math.isfinite(c) and c > 0 and float(r[f"draft_ms_k{k}"]) > 0 and float(r[f"target_ms_k{k}"]) > 0
            acc = json.loads(r[f"accept_pos_k{k}"])
            for b in ("mtbench", "humaneval", "gsm8k"):
                tau = float(r[f"tau_{b}_k{k}"])
                assert math.isfinite(tau) and tau >= 1.0
                assert len(acc[b]) == k and all(x >= y for x, y in zip(acc[b], acc[b][1:]))
                assert sum(acc[b]) == pytest.approx(tau - 1, abs=1e-3)
                assert 0 < float(r[f"speedup_{b}_k{k}"]) <= tau + 1e-4
            assert float(r[f"tau_mean_k{k}"]) == pytest.approx(
                sum(float(r[f"tau_{b}_k{k}"]) for b in ("mtbench", "humaneval", "gsm8k")) / 3, abs=1e-3
            )
        assert "-k 3 7" in r["eval_cmd"] and ("--draft-vocab-size" in r["train_cmd"]) == (r["setting"] == "eagle3")
        # τ from the batched pass, c from a batch-1 pass of --cost-prompts (batched steps are not timed)
        assert "--batch 64" in r["eval_cmd"] and "--batch 1 " in r["eval_cmd"] and "eval_cost.jsonl" in r["eval_cmd"]


@pytest.mark.parametrize(
    "study,setting", [("ttt_scaling", "ttt13"), ("moe_drafts", "shared-e4"), ("data_regen", "regenerated")]
)
def test_one_row_per_run(results, study, setting):
    rows = list(csv.DictReader(open(results / f"{study}.csv")))
    assert len(rows) == 1
    r = rows[0]
    assert r["study"] == study and r["setting"] == setting and r["seed"] == "0"
    taus = [float(r[f"tau_{b}"]) for b in ("mtbench", "humaneval", "gsm8k")]
    assert all(t >= 1.0 for t in taus) and float(r["tau_mean"]) == pytest.approx(sum(taus) / 3, abs=1e-3)
    assert float(r["train_seconds"]) > 0 and float(r["peak_memory_gib"]) > 0 and r["peak_memory_kind"] == "max_rss"
    cfg = json.loads(r["config"])
    assert cfg["steps"] == 2 and cfg["seed"] == 0
    # conversations a step, as the rows say, passed explicitly: train.py's own default on a GPU is a budget sized
    # from the card's memory, which the rows' batch_size would not describe
    assert cfg["batch_size"] == 2 and cfg["batch_tokens"] == 0 and "--batch-tokens 0" in r["train_cmd"]
    if study == "ttt_scaling":
        assert cfg["ttt_length"] == 13
    if study == "moe_drafts":
        assert (cfg["moe_experts"], cfg["moe_shared"], cfg["moe_mode"]) == (4, True, "flops")
    if study == "data_regen":
        assert cfg["data"].endswith("regen.jsonl")
        info = json.loads((results / "runs" / "data_regen" / "data" / "matched.json").read_text())
        assert info["kept"] == 40
    for k in ("git_commit", "hardware", "versions", "date", "train_cmd", "eval_cmd"):
        assert r[k], k
    # the evaluation saved each benchmark as it finished, for a cut-off evaluation to resume from
    partial = json.loads((Path(r["run_dir"]) / "eval_partial.json").read_text())["results"]
    assert {
        b: partial[b][f"eagle3-chain{r['eval_k']}"]["tau"] for b in ("mtbench", "humaneval", "gsm8k")
    } == pytest.approx(dict(zip(("mtbench", "humaneval", "gsm8k"), taus)), abs=1e-4)


def test_matched_data_are_the_same_chats(results):
    d = results / "runs" / "data_regen" / "data"
    orig = [json.loads(x) for x in open(d / "original.jsonl")]
    regen = [json.loads(x) for x in open(d / "regen.jsonl")]
    assert [o["id"] for o in orig] == [r["id"] for r in regen]
    for o, r in zip(orig, regen):
        assert [m for m in o["messages"] if m["role"] != "assistant"] == [
            m for m in r["messages"] if m["role"] != "assistant"
        ]
        assert [m["role"] for m in o["messages"]] == [m["role"] for m in r["messages"]]
    assert (
        sum(a != b for o, r in zip(orig, regen) for a, b in zip(o["messages"], r["messages"])) > 0
    )  # the answers differ


def test_plots(results, families, tmp_path):
    row = {
        "model": "tiny-llama",
        "backend": "hf",
        "seq": 64,
        "batch": 2,
        "ttt": 3,
        "tokens_per_s": 100.0,
        "target_fwd_s": 0.1,
        "make_batch_s": 0.01,
        "draft_fwd_s": 0.1,
        "draft_bwd_s": 0.2,
        "optim_s": 0.01,
        "device": "cpu",
        "torch": "x",
        "date": "2026",
    }
    (results / "throughput_h200.jsonl").write_text(json.dumps(row) + "\n")
    shutil.copy(families, results / "families_h200.csv")
    figs = tmp_path / "figures"
    out = run(["experiments/plot.py", "--results", str(results), "--figures", str(figs)])
    for name in (
        "ttt_tau.png",
        "ttt_cost.png",
        "moe_tau.png",
        "regen_tau.png",
        "backends_h200.png",
        "families_h200.png",
    ):
        assert (figs / name).stat().st_size > 1000, name
        assert name in out


def test_parallel_runs(tiny_run_inputs, tmp_path):
    """--parallel 2: two trainings at once, one row each, and a second call skips both."""
    target, data = tiny_run_inputs
    common = [
        "experiments/ttt_scaling.py",
        "--smoke",
        "--only",
        "ttt1",
        "ttt2",
        "--parallel",
        "2",
        "--target",
        str(target),
        "--data",
        str(data),
        "--csv",
        str(tmp_path / "t.csv"),
        "--runs-dir",
        str(tmp_path / "runs"),
    ]
    out = run(common)
    assert "ttt1 seed 0: tau" in out and "ttt2 seed 0: tau" in out
    rows = list(csv.DictReader(open(tmp_path / "t.csv")))
    assert sorted(r["setting"] for r in rows) == ["ttt1", "ttt2"] and all(r["parallel"] == "2" for r in rows)
    assert sorted(json.loads(r["config"])["ttt_length"] for r in rows) == [1, 2]
    assert "0 runs to do, 2 already in" in run(common)


def test_train_args_string_reaches_train_py(tiny_run_inputs, tmp_path):
    """--train-args is one shell-split string: flags that start with -- survive tyro."""
    target, data = tiny_run_inputs
    out = run(
        [
            "experiments/ttt_scaling.py",
            "--smoke",
            "--dry-run",
            "--target",
            str(target),
            "--data",
            str(data),
            "--train-args=--pad-to-max-len --attention eager",
            "--csv",
            str(tmp_path / "t.csv"),
        ]
    )
    assert "--pad-to-max-len --attention eager --ttt-length 13" in out


def test_reply_stats(tmp_path):
    """The repetition measure behind the data-regeneration reading: a reply looping one 4-word
    phrase scores high, a reply with no repeated 4-gram scores 0; only assistant turns count."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import data_regen  # after sys.path.insert: experiments/ is not a package

    assert data_regen.repetition("a b c d a b c d") == pytest.approx(1 / 5)  # 5 four-grams, abcd twice
    assert data_regen.repetition("one two three") == 0.0  # shorter than one 4-gram
    loop = " ".join(["I am here to help."] * 20)
    chats = [
        {"messages": [{"role": "user", "content": "x " * 50}, {"role": "assistant", "content": loop}]},
        {
            "messages": [
                {"role": "user", "content": "y"},
                {"role": "assistant", "content": " ".join(map(str, range(30)))},
            ]
        },
    ]
    f = tmp_path / "m.jsonl"
    f.write_text("".join(json.dumps(c) + "\n" for c in chats))
    s = data_regen.reply_stats(f)
    assert s["replies"] == 2 and s["replies_over_0.2_repeated"] == 0.5 and s["words_mean"] == 65.0
    assert 0.4 < s["repeated_4gram_share_mean"] < 0.5  # (~0.85 + 0) / 2


def test_train_throughput_rows():
    """experiments/train_throughput.py --smoke: train.py packed on the packaged chats (by conversations and by
    --batch-tokens), one row each with the fields
    the throughput table needs, taken from the run's own metrics (after the warm-up steps)."""
    out = Path("/tmp/train_throughput_smoke.jsonl")
    run(["experiments/train_throughput.py", "--smoke"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["pack", "tokens"]
    for row in rows:
        for k in ("model", "path", "seq", "batch", "padded_tokens_per_s", "packing_efficiency", "command", "date"):
            assert k in row, k
        assert row["path"] == "train.py" and row["seq"] == 256 and "--pack on" in row["command"]
        assert row["padded_tokens_per_s"] >= row["real_tokens_per_s"] > 0 and 0.5 < row["packing_efficiency"] <= 1
    # conversations a step said explicitly (train.py's GPU default would be a budget from memory); the harness's rows
    assert "--batch-tokens 0" in rows[0]["command"] and "--batch-tokens 1024" in rows[1]["command"]


def test_train_throughput_takes_the_ratio_from_an_earlier_call(tmp_path):
    """A comparison split over device calls: train.py's row finds the latest harness row of the same model,
    length, TTT and GPU in --out, and no other."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from train_throughput import earlier_harness  # after sys.path.insert: experiments/ is not a package

    common = {"model": "llama-3.1-8b", "seq": 4096, "ttt": 7, "hardware": {"gpu": "NVIDIA H200"}}
    rows = [
        {**common, "path": "harness", "real_tokens_per_s": 1.0},
        {**common, "path": "harness", "real_tokens_per_s": 2.0},
        {**common, "path": "train.py", "real_tokens_per_s": 3.0},
        {**common, "seq": 2048, "path": "harness", "real_tokens_per_s": 4.0},
        {**common, "hardware": {"gpu": "NVIDIA H100"}, "path": "harness", "real_tokens_per_s": 5.0},
    ]
    out = tmp_path / "tt.jsonl"
    assert earlier_harness(out, common) is None
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert earlier_harness(out, common)["real_tokens_per_s"] == 2.0
    assert earlier_harness(out, {**common, "ttt": 9}) is None


def test_train_flags_come_from_train_config():
    """config.to_flags: the flags that give a TrainConfig (what experiment scripts start train.py with) read back
    as that config through train.py's own CLI; multi_gpu.py builds its runs' flags so."""
    cfg = TrainConfig(
        steps=3,
        lr=1e-4,
        aux_layers=(1, 4, 7),
        compile=True,
        eval_at_start=False,
        deploy=DeployConfig(producers=2, lease_timeout=5.0),
    )
    f = to_flags(cfg)
    assert "--no-eval-at-start" in f and "--producers" in f and "--aux-layers" in f
    assert cli(TrainConfig, f) == cfg and to_flags(TrainConfig()) == []
    args = SimpleNamespace(data="sharegpt-greedy", compile=False, train_args="--attention eager")
    f = train_flags(args, "/t", "/o", 8, seq=64, ttt=3, steps=4)
    got = cli(TrainConfig, f)
    assert (got.target, got.out, got.batch_size, got.max_len, got.ttt_length, got.steps) == ("/t", "/o", 8, 64, 3, 4)
    assert got.pad_to_max_len and not got.compile and not got.progress and got.overwrite and got.holdout == 0
    assert got.backend == "compiled" and got.attention == "eager" and got.num_records == 200
    assert got.batch_tokens == 0  # `batch` conversations a rank, not the GPU default's budget from memory


def test_sweep_resumes_a_run_stopped_by_its_time_limit(tmp_path):
    """--time-limit reaches train.py; a run stopped with a checkpoint (ckpt/latest, no eval_end) resumes from it
    in the next call, a finished one or one without a checkpoint starts over (--overwrite)."""
    from experiments.families import SETTINGS, FamiliesArgs, FamiliesSweep  # only this test builds its commands

    sweep = FamiliesSweep("families", SETTINGS, FamiliesArgs(target="smollm2", csv=str(tmp_path / "f.csv")))
    run = tmp_path / "eagle3-s0"
    fresh = sweep.train_cmd([], 0, run, time_limit=300)
    assert "--overwrite" in fresh and "--resume" not in fresh and fresh[fresh.index("--time-limit") + 1] == "300"
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "latest").write_text("step_400")
    (run / "run.json").write_text(json.dumps({"status": "stopped", "results": {"stopped_by": "time_limit"}}))
    again = sweep.train_cmd([], 0, run)
    assert "--resume" in again and "--overwrite" not in again and "--time-limit" not in again
    (run / "run.json").write_text(json.dumps({"status": "finished", "results": {"eval_end": {"acc_0": 0.5}}}))
    assert "--overwrite" in sweep.train_cmd([], 0, run)


def test_every_families_setting_is_a_valid_train_command():
    """Each setting's flags parse as train.py's (a flag of another family's is refused there): a typo in a
    setting would otherwise surface only on the GPU, after the other runs of its call."""
    from experiments.families import SETTINGS  # only this test and the one above build its commands

    for name, flags in SETTINGS:
        cfg = parse_cli(["--target", "t", *flags])
        assert cfg.strategy == (flags[flags.index("--strategy") + 1] if "--strategy" in flags else "eagle3"), name
    spec = parse_cli(["--target", "t", *dict(SETTINGS)["dflash-specforge"]])
    assert (spec.num_anchors, spec.loss_decay) == (512, 7.0)
    deep = parse_cli(["--target", "t", *dict(SETTINGS)["dflash-dpace-3l"]])
    assert (deep.objective, deep.draft_layers) == ("dpace", 3)


def test_vllm_speed_serves_each_family_with_its_vllm_method():
    """experiments/vllm_speed.py times a families draft with the method vLLM serves that family by (issue 33's
    vLLM wall-clock): EAGLE-3 as eagle3, P-EAGLE as eagle3 with parallel drafting, DFlash as dflash; a family
    vLLM has no loader for (domino) is refused before any engine starts."""
    from experiments.vllm_speed import Args, jobs  # only this test builds its runs
    from export import ExportError  # heavy (torch): only this test

    def draft_runs(strategy):
        runs = jobs(Args(strategy=strategy, draft="/d", k=(3, 7)))
        assert [n for n, _ in runs] == ["plain", "ngram-k3", f"{strategy}-k3", f"{strategy}-k7"]
        assert runs[0][1] == {"draft": None} and runs[1][1]["method"] == "ngram"
        return [job for _, job in runs[2:]]

    eagle = [(j["method"], j["k"], j["draft"]) for j in draft_runs("eagle3")]
    assert eagle == [("eagle3", 3, "/d"), ("eagle3", 7, "/d")]
    assert all(j["method"] == "eagle3" and j["speculative_extra"]["parallel_drafting"] for j in draft_runs("peagle"))
    assert all(j["method"] == "dflash" for j in draft_runs("dflash"))
    with pytest.raises(ExportError, match="vLLM has no loader"):
        jobs(Args(strategy="domino"))


def test_families_timed_pass_has_the_gpu_to_itself(tmp_path, monkeypatch):
    """With several evaluations at once on a GPU, each run's timed batch-1 pass (the draft cost c) takes the study's
    lock exclusively and its τ pass shares it, so no c is timed beside another evaluation; one at a time, or on
    the CPU, the commands are plain."""
    from experiments.families import SETTINGS, FamiliesArgs, FamiliesSweep  # only these tests build its commands

    def chain(**kw) -> str:
        a = FamiliesArgs(target="smollm2", csv=str(tmp_path / "f.csv"), **kw)
        return FamiliesSweep("families", SETTINGS, a).eval_cmd(tmp_path / "runs" / "eagle3-s0")[-1]

    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")  # flock(1) there, whatever this machine has
    lock = str(tmp_path / "runs" / ".timed_pass.lock")
    shared = chain(eval_device="cuda", eval_parallel=3)
    tau, cost = shared.split(" && ")
    assert tau.startswith(f"flock -s {lock} ") and "--batch 64" in tau
    assert cost.startswith(f"flock -x {lock} ") and "--batch 1 " in cost and "eval_cost.jsonl" in cost
    for alone in (chain(eval_device="cuda"), chain(eval_device="cpu", eval_parallel=2, parallel=2)):
        assert "flock" not in alone and " && " in alone
    one = FamiliesArgs(target="smollm2", csv=str(tmp_path / "f.csv"), eval_device="cuda", eval_parallel=3)
    timed_tau = dataclasses.replace(one, cost_prompts=0, eval_batch=1)  # the τ pass is the timed one
    assert FamiliesSweep("families", SETTINGS, timed_tau).eval_parallel == 1
    monkeypatch.setattr("shutil.which", lambda name: None)  # no flock(1): one evaluation at a time instead
    assert FamiliesSweep("families", SETTINGS, one).eval_parallel == 1
