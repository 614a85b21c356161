"""experiments/multi_gpu.py's bookkeeping, without running train.py: the timing read back from a
metrics.jsonl written the way train.py writes it, the parity verdict, and bad phase names.
(The whole runner on tiny models: `python experiments/multi_gpu.py all --cpu-smoke --out DIR`, minutes.)"""

import statistics

import pytest

from experiments.multi_gpu import loss_parity, main, predict_8gpu, throughput


def fake_metrics(step_s, real_tokens, dp=2, t0=1000.0, row_tokens=8 * 4096):
    """Rows as train.py logs them with --log-every 1: an eval row at step 0, then per step its own
    global token rates and seconds (runlog.Throughput), none for its first two warm-up steps."""
    rows, t = [{"time": t0, "step": 0, "split": "eval"}], t0
    for i, (s, n) in enumerate(zip(step_s, real_tokens)):
        t += s
        r = {"time": t, "step": i + 1, "split": "train", "loss": 10.0 - i}
        if i >= 2:
            r.update(real_tokens_per_s=n * dp / s, row_tokens_per_s=row_tokens / s, step_seconds=s)
        rows.append(r)
    return rows


def test_throughput_drops_warmup_and_counts_real_tokens():
    step_s = [95.0, 7.0, 2.0, 2.0, 2.1, 1.9, 2.2, 2.0, 1.8, 2.05]  # compile, recompile, then steady
    tokens = [900, 1000, 1100, 1200, 1300, 1400, 1500, 1600, 1700, 1800]  # rank 0's real tokens per step
    r = throughput(fake_metrics(step_s, tokens), batch=8, seq=4096, warmup=4)
    assert r["tokens_per_s"] == pytest.approx(2 * sum(tokens[4:]) / sum(step_s[4:]), rel=1e-4)
    assert r["step_s"] == pytest.approx(statistics.median(step_s[4:]), rel=1e-4)
    assert r["row_tokens_per_s"] == pytest.approx(8 * 4096 * len(step_s[4:]) / sum(step_s[4:]), rel=1e-4)
    assert r["first_step_s"] == pytest.approx(95.0, abs=0.1) and r["timed_steps"] == 6 and r["steps_logged"] == 10
    assert r["losses"][0] == 10.0 and r["window"][1] - r["window"][0] == pytest.approx(sum(step_s[4:]))


def test_throughput_of_a_run_killed_early():
    assert throughput(fake_metrics([90.0, 3.0, 2.0], [10, 10, 10]), 8, 4096, warmup=4) == {
        "steps_logged": 3,
        "losses": [10.0, 9.0, 8.0],
    }
    assert throughput([], 8, 4096, warmup=4) == {"steps_logged": 0, "losses": []}


def test_loss_parity():
    one = [11.0, 10.5, 10.0, 9.6]
    assert loss_parity([x * (1 + 1e-3) for x in one], one, 2e-2)["passed"]
    bad = loss_parity([11.0, 10.5, 10.6, 9.6], one, 2e-2)
    assert not bad["passed"] and bad["max_rel_diff"] == pytest.approx(0.06)
    assert not loss_parity([11.0, 11.0], [11.0, 11.0], 2e-2)["passed"]  # nothing trained: vacuous
    assert not loss_parity([11.0, 10.5], [11.0, 10.5, 10.0], 2e-2)["passed"]  # a run stopped early


def test_bad_phase_fails_clearly(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["dp", "fsdp8", "--out", str(tmp_path)])
    assert "invalid choice 'fsdp8'" in capsys.readouterr().err


def test_predict_8gpu_from_2gpu_rows():
    rows = [
        {"what": "dp_scaling", "speedup_real_tokens": 1.2, "tokens_per_s_1gpu": 10.0},  # an older call: superseded
        {"what": "dp_scaling", "speedup_real_tokens": 1.9, "tokens_per_s_1gpu": 1000.0},
        {"what": "tp_vs_dp", "tokens_per_s": 3000.0, "tokens_per_s_dp": 5000.0},
        {"what": "disagg_1p1c", "tokens_per_s": 2000.0, "producer_util": 50.0},
        {"what": "predict_8gpu", "predicted": True, "fsdp8_8b_tokens_per_s": [1, 2]},
    ]
    p = predict_8gpu(rows)
    assert p["fsdp8_8b_tokens_per_s"] == [round(8000 * 0.95**3), 7600]
    assert p["tp4x2_qwen_tokens_per_s"] == [6000, 12000] and p["dp8_qwen_tokens_per_s"] == 19000
    assert p["split3p5c_8b_tokens_per_s"] == 9500  # consumers bound: 5 x 2000 x 0.95 < 3 x 4000
    assert predict_8gpu([{"what": "tests", "passed": True}]) == {}
    noisy = predict_8gpu([{"what": "dp_scaling", "speedup_real_tokens": 2.3, "tokens_per_s_1gpu": 1000.0}])
    assert noisy["fsdp8_8b_tokens_per_s"] == [8000, 8000]  # above-linear 2-GPU noise is not extrapolated
