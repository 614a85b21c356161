"""Disaggregated online training (core/disagg/): the control plane in-process, then producers and
consumers as real processes on a tiny target: a killed producer, a killed and restarted
consumer, back-pressure, the loss of every producer, two consumer ranks, and the loss curve of
the colocated run."""

import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from core.config import cli
from core.disagg.control import Controller, PipelineError, plan_items
from core.train_config import TrainConfig
from data.datasets import GlobalBatches
from data.feature_store import SampleRef
from tests.test_train_e2e import final_params, run_train
from tests.tiny import TINY_TRAIN

ROOT = Path(__file__).resolve().parents[1]
STEPS = 7
# fast heartbeats so that deaths are noticed in seconds; a small window so back-pressure bites
FAST = [
    "--heartbeat",
    "0.2",
    "--lease-timeout",
    "2",
    "--lease-size",
    "2",
    "--high-watermark",
    "8",
    "--low-watermark",
    "4",
]


# ---------------------------------------------------------------- the control plane
def make_ctl(tmp_path, n=12, B=4, steps=3, n_eval=2, **kw):
    ctl = Controller(tmp_path / "ctl", **{"lease_timeout": 0.5, "max_attempts": 2, **kw})
    ctl.init_plan(plan_items(GlobalBatches(n, B, 0), steps, n_eval), {"plan": 1}, B)
    return ctl


def publish(ctl, wid, items, key="k"):
    return ctl.publish(wid, [(pos, SampleRef(s, key, j, 1)) for j, (pos, s, _) in enumerate(items)])


def test_plan_is_global_batches_order(tmp_path):
    b = GlobalBatches(12, 4, 0)
    items = plan_items(b, 5, 2)  # 5 steps: into the second epoch
    assert [p for p, _, _ in items] == list(range(2 + 20))
    assert items[:2] == [(0, -1, 12), (1, -1, 13)]
    assert [s for _, st, s in items if st == 4] == b.indices(4)
    with pytest.raises(PipelineError, match="another run"):
        make_ctl(tmp_path).init_plan([], {"plan": 2}, 4)


def test_leases_are_disjoint_and_windowed(tmp_path):
    ctl = make_ctl(tmp_path)
    a, b = ctl.register("producer", "a"), ctl.register("producer", "b")
    assert [(p, s) for p, s, _ in ctl.lease(a, 3, high=8, low=3)] == [(0, 12), (1, 13)]  # eval first, not mixed
    got = [ctl.lease(w, 3, 8, 3) for w in (a, b, a)]
    pos = [p for g in got for p, _, _ in g]
    assert pos == list(range(2, 10))  # disjoint, in data order, up to the high watermark (8)
    assert ctl.lease(b, 3, 8, 3) == [] and ctl.stats()["pauses"] == 1
    for w, g in zip((a, b, a), got):
        assert publish(ctl, w, g, key=f"s{g[0][0]}")
    assert ctl.step_refs(0) is not None and ctl.step_refs(1) is not None and ctl.step_refs(2) is None
    assert ctl.ack(0) == ["s2"]  # s5 still holds step 1's samples
    assert ctl.lease(a, 3, 8, 3) == []  # 4 in flight: paused until <= low (3)
    ctl.ack(1)
    assert [p for p, _, _ in ctl.lease(a, 3, 8, 3)] == [10, 11, 12] and ctl.stats()["resumes"] == 1
    assert ctl.stats()["max_inflight"] == 8
    assert [s for _, st, s in ctl.ledger() if st == 0] == GlobalBatches(12, 4, 0).indices(0)


def test_ack_frees_whole_shards_only(tmp_path):
    ctl = make_ctl(tmp_path, n_eval=0)
    w = ctl.register("producer")
    items = ctl.lease(w, 6, 8, 4)  # step 0 and half of step 1 in one shard
    assert publish(ctl, w, items[:2], "x") and publish(ctl, w, items[2:], "y")
    rest = ctl.lease(w, 2, 8, 4)
    assert publish(ctl, w, rest, "z")
    assert ctl.ack(0) == ["x"]  # y also holds step 1's first samples
    assert ctl.ack(1) == ["y", "z"]
    with pytest.raises(sqlite3.IntegrityError):  # the ledger never records a position twice
        ctl.db.execute("INSERT INTO ledger VALUES (2, 0, 0, 0)")


def test_control_plane_refuses_tensors(tmp_path):
    ctl = make_ctl(tmp_path)
    w = ctl.register("producer")
    (pos, s, _), *_ = ctl.lease(w, 1, 8, 4)
    for bad in ({"aux_hidden": torch.zeros(3)}, torch.zeros(3), SampleRef(s, "k", torch.tensor(0), 1)):
        with pytest.raises(TypeError, match="only SampleRef"):
            ctl.publish(w, [(pos, bad)])


def test_dead_producer_leases_return_then_budget_fails_the_run(tmp_path):
    ctl = make_ctl(tmp_path, n_eval=0)
    dead, alive = ctl.register("producer", "dead"), ctl.register("producer", "alive")
    first = ctl.lease(dead, 2, 8, 4)
    time.sleep(0.6)  # 'dead' stops heartbeating; 'alive' leases and so beats
    again = ctl.lease(alive, 2, 8, 4)
    assert [p for p, _, _ in again] == [p for p, _, _ in first] and again[0][2] == 2  # second attempt
    assert not publish(ctl, dead, first)  # the zombie's late publish is refused
    assert publish(ctl, alive, again)
    # a prompt that stalls every producer it meets exhausts the retry budget (2) and fails the run
    bad = ctl.lease(alive, 1, 8, 4)
    time.sleep(0.6)
    other = ctl.register("producer", "other")
    assert ctl.lease(other, 1, 8, 4)[0][0] == bad[0][0]
    time.sleep(0.6)
    ctl.lease(ctl.register("producer", "third"), 1, 8, 4)
    with pytest.raises(
        PipelineError, match=rf"sample {bad[0][1]} .* leased 2 times.*stopped heartbeating.*--max-attempts 2"
    ):
        ctl.check()


def test_consumer_wait_fails_without_producers(tmp_path):
    ctl = make_ctl(tmp_path)
    t0 = time.time()
    with pytest.raises(PipelineError, match="all producers are gone"):
        ctl.wait_step(0, producer_timeout=0.5)
    assert time.time() - t0 < 5


def test_rollback_requeues_untrained_steps(tmp_path):
    ctl = make_ctl(tmp_path, n_eval=0)
    w = ctl.register("producer")
    for _ in range(3):
        items = ctl.lease(w, 4, 12, 4)
        assert publish(ctl, w, items, f"k{items[0][0]}")
    for s in range(3):
        ctl.ack(s)
    assert ctl.rollback(1) == 8  # checkpoint after step 0: steps 1 and 2 are redone
    assert sorted({st for _, st, _ in ctl.ledger()}) == [0]
    assert [p for p, _, _ in ctl.lease(w, 8, 12, 4)] == list(range(4, 12))


def test_yaml_config_with_overrides(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("lr: 0.01\naux_layers: [1, 2]\ndeploy:\n  producers: 2\n  high_watermark: 64\nrole: consumer\n")
    cfg = cli(TrainConfig, ["--config", str(y), "--lr", "0.5", "--low-watermark", "8"])
    assert (cfg.lr, cfg.aux_layers, cfg.steps) == (0.5, (1, 2), TrainConfig().steps)
    d = cfg.deploy
    assert (d.producers, d.high_watermark, d.low_watermark, d.role) == (2, 64, 8, "consumer")
    y.write_text("lr: 0.01\nlearning_rate: 3\n")
    with pytest.raises(SystemExit, match="unknown config key 'learning_rate'"):
        cli(TrainConfig, ["--config", str(y)])


# ---------------------------------------------------------------- real processes
ARGS = ["--steps", str(STEPS), "--ckpt-every", "2"]


def train_cmd(out, target, data, extra=()):
    return [
        sys.executable,
        "train.py",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        *TINY_TRAIN,
        *ARGS,
        *map(str, extra),
    ]


def start(cmd, log, fault=""):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NANOSPEC_FAULT": fault}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_until(pred, timeout=600, what="", proc=None, log=None):
    """Poll for an event the run will reach, within a bound generous for a loaded 2-core runner; a
    process that exits first fails the wait at once, with its log (how CI showed that a named
    producer may never reach its third lease: the other one, started sooner, took them all)."""
    t0 = time.time()
    while not pred():
        tail = Path(log).read_text()[-3000:] if log else ""
        assert proc is None or proc.poll() is None, f"exited ({proc.returncode}) before {what}:\n{tail}"
        assert time.time() - t0 < timeout, f"timed out after {timeout} s waiting for {what}:\n{tail}"
        time.sleep(0.2)


def worker_pid(ctl_dir, name):
    row = (
        sqlite3.connect(Path(ctl_dir) / "control.db")
        .execute("SELECT pid FROM workers WHERE name=?", (name,))
        .fetchone()
    )
    return row[0] if row else None


def finish(p, log, timeout=300):
    rc = p.wait(timeout=timeout)
    text = Path(log).read_text()
    assert rc == 0, text[-4000:]
    return text


def curve(out):
    rows = {}
    for r in map(json.loads, open(Path(out) / "metrics.jsonl")):
        if r["split"] == "train":
            rows[r["step"]] = r  # a restarted consumer rewrites the steps it redoes
    return [rows[s] for s in sorted(rows)]


def assert_same_curve(a, b, rel):
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    assert len({r["loss"] for r in a}) > 1 and all(r["loss"] > 0 for r in a)  # it trains on real rows
    for x, y in zip(a, b):
        for k in ("loss", "loss_0", "loss_2", "acc_0", "grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=rel, abs=1e-7), (x["step"], k)


def assert_exactly_once(ctl_dir, n_samples=STEPS * 4):
    ctl = Controller(ctl_dir)
    ledger = ctl.ledger()
    assert [p for p, _, _ in ledger] == list(range(4, 4 + n_samples))  # every position once (after 4 eval samples)
    batches = GlobalBatches(28, 4, 0)  # 32 usable examples of the tiny data, 4 held out
    assert [s for _, _, s in ledger] == [i for st in range(STEPS) for i in batches.indices(st)]
    return ctl


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, tiny_run_inputs):
    out = tmp_path_factory.mktemp("colo") / "run"
    run_train(out, *tiny_run_inputs, 0, ARGS)
    return out


def test_killed_producer_same_curve_as_colocated(tmp_path, colocated, tiny_run_inputs):
    """Two producers, one hangs holding a lease and is killed: the run finishes, each sample is
    trained once, the loss curve is the colocated one, and the fast producers never had more
    than the high watermark in flight."""
    out, log = tmp_path / "dis", tmp_path / "dis.log"
    # the first producer to reach its third lease hangs (which one depends on who started sooner)
    p = start(train_cmd(out, *tiny_run_inputs, ["--producers", 2, *FAST]), log, fault="hang:first-producer:3")
    hung = re.compile(r"\[fault\] (p\d) hangs at 3")
    wait_until(lambda: hung.search(log.read_text()), what="a producer to hang", proc=p, log=log)
    name = hung.search(log.read_text()).group(1)
    os.kill(worker_pid(out / "pipeline", name), signal.SIGKILL)
    text = finish(p, log)
    assert f"producer {name} exited (-9)" in text
    ctl = assert_exactly_once(out / "pipeline")
    s = ctl.stats()
    assert s["max_inflight"] <= 8 and s["pauses"] >= 1 and s["resumes"] >= 1, s
    assert ctl.db.execute("SELECT MAX(attempts) FROM items").fetchone()[0] == 2  # p0's lease was redone
    assert not list((out / "pipeline" / "features" / "shards").glob("*.safetensors"))  # all acked and deleted
    assert_same_curve(curve(colocated), curve(out), rel=1e-5)
    for k, v in final_params(colocated).items():
        torch.testing.assert_close(final_params(out)[k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_killed_consumer_restarts_from_ledger(tmp_path, colocated, tiny_run_inputs):
    """Pools started separately (--role); the consumer is killed after acking step 2 (its last
    checkpoint is step 2, so step index 2 is trained but not saved) and restarted: the ledger
    rolls back that step, producers redo it, and the run ends as the uninterrupted one."""
    out, ctl_dir = tmp_path / "run", tmp_path / "ctl"
    roles = ["--control", ctl_dir, "--store", tmp_path / "store", *FAST]
    prod = start(train_cmd(out, *tiny_run_inputs, ["--role", "producer", *roles]), tmp_path / "p.log")
    cons = start(
        train_cmd(out, *tiny_run_inputs, ["--role", "consumer", *roles]), tmp_path / "c1.log", fault="hang:consumer:2"
    )
    wait_until(
        lambda: "[fault] consumer hangs at 2" in (tmp_path / "c1.log").read_text(),
        what="the consumer to hang",
        proc=cons,
        log=tmp_path / "c1.log",
    )
    assert {st for _, st, _ in Controller(ctl_dir).ledger()} == {0, 1, 2}
    cons.kill()
    cons.wait()
    cons = start(train_cmd(out, *tiny_run_inputs, ["--role", "consumer", *roles]), tmp_path / "c2.log")
    text = finish(cons, tmp_path / "c2.log")
    assert "[resume]" in text and "4 samples trained after the checkpoint at step 2" in text
    finish(prod, tmp_path / "p.log", timeout=60)
    assert_exactly_once(ctl_dir)
    assert_same_curve(curve(colocated), curve(out), rel=1e-5)
    for k, v in final_params(colocated).items():
        torch.testing.assert_close(final_params(out)[k], v, rtol=1e-4, atol=1e-6, msg=k)


def test_all_producers_dead_fails_in_bounded_time(tmp_path, tiny_run_inputs):
    """Pools started separately: the only producer dies; the consumer notices on its own."""
    out, ctl_dir = tmp_path / "run", tmp_path / "ctl"
    roles = ["--control", ctl_dir, "--store", tmp_path / "store", "--producer-timeout", 15, *FAST]
    prod = start(
        train_cmd(out, *tiny_run_inputs, ["--role", "producer", *roles]), tmp_path / "p.log", fault="hang:w1:3"
    )
    cons = start(train_cmd(out, *tiny_run_inputs, ["--role", "consumer", *roles]), tmp_path / "c.log")
    wait_until(
        lambda: "[fault] w1 hangs at 3" in (tmp_path / "p.log").read_text(),
        what="the producer to hang",
        proc=prod,
        log=tmp_path / "p.log",
    )
    prod.kill()
    t0 = time.time()
    rc = cons.wait(timeout=120)
    took, text = time.time() - t0, (tmp_path / "c.log").read_text()
    assert rc != 0 and took < 15 + 2 + 20, (took, text[-3000:])  # producer timeout + lease timeout + slack
    assert "error: all producers are gone: none has sent a heartbeat for" in text and "Traceback" not in text
    assert Controller(ctl_dir).state()[0] == "failed"  # for every member: a producer started now exits


def test_two_consumer_ranks_match_one(tmp_path, colocated, tiny_run_inputs):
    out, log = tmp_path / "two", tmp_path / "two.log"
    finish(start(train_cmd(out, *tiny_run_inputs, ["--producers", 1, "--consumer-ranks", 2, *FAST]), log), log)
    assert_exactly_once(out / "pipeline")
    assert_same_curve(curve(colocated), curve(out), rel=1e-4)  # two-rank FSDP2 sums in another order
    for k, v in final_params(colocated).items():
        torch.testing.assert_close(final_params(out)[k], v, rtol=1e-4, atol=1e-5, msg=k)


def _mooncake_missing() -> str:
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401  # optional: probes whether mooncake is installed
    except ImportError as e:  # not installed, or its libibverbs.so.1 is missing
        return f"mooncake store unavailable: {e}"
    return ""


@pytest.mark.skipif(bool(_mooncake_missing()), reason=_mooncake_missing() or "x")
def test_mooncake_transport_same_curve(tmp_path, colocated, tiny_run_inputs):
    """Features through Mooncake's distributed store (master started by the launcher on loopback)."""
    out, log = tmp_path / "mc", tmp_path / "mc.log"
    finish(start(train_cmd(out, *tiny_run_inputs, ["--producers", 1, "--store", "mooncake://local", *FAST]), log), log)
    assert_exactly_once(out / "pipeline")
    assert_same_curve(curve(colocated), curve(out), rel=1e-5)


def test_no_holdout_runs_to_the_end(tmp_path, tiny_run_inputs):
    """--holdout 0 (the throughput runs of experiments/multi_gpu.py): the plan has no eval refs, and the
    consumer must not wait for them (it did, forever) but train every step."""
    out, log = tmp_path / "dis", tmp_path / "dis.log"
    cmd = train_cmd(out, *tiny_run_inputs, ["--producers", 1, *FAST])
    cmd[cmd.index("--holdout") + 1] = "0"
    finish(start(cmd, log), log, timeout=300)
    assert [r["step"] for r in curve(out)] == list(range(1, STEPS + 1))
    assert [p for p, _, _ in Controller(out / "pipeline").ledger()] == list(range(STEPS * 4))  # no eval positions first


def test_token_batches_two_consumer_ranks_match_colocated(tmp_path, tiny_run_inputs):
    """--batch-tokens through the pipeline: producers lay out the TokenBatches plan (steps of varying
    sample counts), two consumer ranks take their rows' samples, and the run follows the colocated one."""
    tokens = ["--pack", "on", "--max-len", "256", "--batch-tokens", "1024"]  # 4 packed rows of 256 a step
    run_train(tmp_path / "colo", *tiny_run_inputs, 0, [*ARGS, *tokens])
    out, log = tmp_path / "two", tmp_path / "two.log"
    fast = ["--heartbeat", "0.2", "--lease-timeout", "2", "--lease-size", "2"]  # watermarks: from the largest step
    cmd = train_cmd(out, *tiny_run_inputs, [*tokens, "--producers", 1, "--consumer-ranks", 2, *fast])
    finish(start(cmd, log), log)
    ctl = Controller(out / "pipeline")
    ledger = ctl.ledger()
    n_train = ctl.db.execute("SELECT COUNT(*) FROM items WHERE step>=0").fetchone()[0]
    assert [p for p, _, _ in ledger] == list(range(4, 4 + n_train))  # every position once, after 4 eval samples
    steps = [st for _, st, _ in ledger]
    assert sorted(set(steps)) == list(range(STEPS)) and len({steps.count(st) for st in set(steps)}) > 1  # sizes vary
    assert_same_curve(curve(tmp_path / "colo"), curve(out), rel=1e-4)
    for k, v in final_params(tmp_path / "colo").items():
        torch.testing.assert_close(final_params(out)[k], v, rtol=1e-4, atol=1e-5, msg=k)
