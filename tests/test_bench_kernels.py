"""CPU smoke of experiments/bench_kernels.py (tiny shapes, fp32): the TTT attention benchmarks run,
write their rows, and every implementation agrees with the reference of its benchmark."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_attention_benchmarks_smoke(tmp_path):
    out = tmp_path / "k.jsonl"
    p = subprocess.run(
        [sys.executable, "experiments/bench_kernels.py", "--smoke", "--only", "attn", "call", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    impls = {(r["name"], r["impl"]) for r in rows}
    assert {("ttt_attention", i) for i in ("eager", "lse", "flex", "flex_buf")} <= impls
    assert {("ttt_call", i) for i in ("eager_dense", "eager", "lse", "flex")} <= impls
    checked = [r for r in rows if r["check_err"] is not None]
    # each (benchmark, impl, TTT) but the reference is checked once: 3 + 3 impls x TTT 1 and 3
    assert len(checked) == 12 and all(r["check_err"] < 1e-4 for r in checked), [
        (r["name"], r["impl"], r["check_err"]) for r in checked
    ]
    assert all(r["ms"] > 0 and r["smoke"] for r in rows)
