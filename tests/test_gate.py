"""gate.py end to end (slow: overfit through train.py, export, vLLM CPU), and its failures on
broken checkpoints: d2t removed fails at export, a scrambled fc fails at serve on acceptance.
The vLLM virtualenv (.venv-vllm) is created by the gate when missing (several minutes)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]


def run_gate(*args, timeout=1500):
    p = subprocess.run(
        [sys.executable, str(ROOT / "gate.py"), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    return p.returncode, p.stdout + p.stderr


def broken_copy(ckpt: Path, dst: Path, fn) -> Path:
    shutil.copytree(ckpt, dst)
    sd = load_file(dst / "draft.safetensors")
    fn(sd)
    save_file(sd, dst / "draft.safetensors")
    return dst


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate")
    rc, log = run_gate("--out", str(out))
    return out, rc, log


@pytest.mark.slow
def test_gate_passes_end_to_end(gate_run):
    out, rc, log = gate_run
    assert rc == 0, log[-3000:]
    assert "GATE PASSED" in log
    rep = json.loads((out / "gate.json").read_text())
    sample = json.loads((out / "sample.json").read_text())
    k = rep["config"]["k"]
    s = rep["serve"]
    assert rep["passed"] and s["served_equals_greedy"]
    assert s["vllm_tau"] - 1 >= rep["config"]["min_accept"] * k
    # the engine's counters and our PyTorch decoder agree on the same draft and prompt
    assert abs(s["vllm_tau"] - s["pytorch_tau"]) <= 0.05 * s["pytorch_tau"]
    # the auditable sample: prompt + greedy continuation, the one-record training set
    assert sample["prompt_ids"] and len(sample["greedy_ids"]) >= sample["served_tokens"]
    assert json.loads((out / "train.jsonl").read_text())["messages"] == sample["messages"]
    assert Path(rep["checkpoint"]).name.startswith("step_")


@pytest.mark.slow
def test_gate_fails_at_export_without_d2t(gate_run, tmp_path):
    out, rc, _ = gate_run
    assert rc == 0
    ckpt = json.loads((out / "gate.json").read_text())["checkpoint"]
    bad = broken_copy(Path(ckpt), tmp_path / "no_d2t", lambda sd: sd.pop("d2t"))
    rc, log = run_gate("--out", str(tmp_path / "g"), "--ckpt", str(bad), "--sample", str(out / "sample.json"))
    assert rc == 1
    assert "GATE FAILED at export" in log and "d2t" in log, log[-2000:]
    assert json.loads((tmp_path / "g" / "gate.json").read_text())["failed_stage"] == "export"


@pytest.mark.slow
def test_gate_fails_at_serve_with_shuffled_fc(gate_run, tmp_path):
    out, rc, _ = gate_run
    assert rc == 0
    ckpt = json.loads((out / "gate.json").read_text())["checkpoint"]

    def shuffle(sd):
        g = torch.Generator().manual_seed(0)
        w = sd["fc.weight"]
        sd["fc.weight"] = w[:, torch.randperm(w.shape[1], generator=g)].contiguous()

    bad = broken_copy(Path(ckpt), tmp_path / "shuffled", shuffle)
    rc, log = run_gate("--out", str(tmp_path / "g"), "--ckpt", str(bad), "--sample", str(out / "sample.json"))
    assert rc == 1
    assert "GATE FAILED at serve" in log and "drafts per step" in log, log[-2000:]
