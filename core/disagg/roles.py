"""Disaggregated online training: producers run the target, consumers train the draft.

    train.py --producers 2 [--consumer-ranks 2] ...       # one node: the launcher supervises both pools
    train.py --role producer --control DIR --store DIR    # one pool member each, e.g. under a scheduler
    torchrun --nproc_per_node=N train.py --role consumer --control DIR --store DIR

Every member derives the same data order (GlobalBatches over the tokenized data) and meets the
others only in the control database (control.py) and the feature store:
- a producer leases prompts in that order, runs the target over them, puts the features into
  the store as one shard and publishes one SampleRef per prompt;
- a consumer waits until every ref of its next optimizer step is there (all ranks wait for the
  same step), reads its rows, trains, and after the optimizer step rank 0 records the step's
  samples in the ledger and acks them, which deletes their features;
- a restarted consumer resumes from its checkpoint; ledger rows past it go back to the producers.
The consumer is core/trainer.py's Trainer with three hooks (heads-only target, step_examples, after_step):
the loss, FSDP, checkpoints and logs are the colocated ones, so a disaggregated run follows
the colocated loss curve.
"""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from core.config import dump_yaml
from core.disagg.control import Controller, PipelineError, plan_items
from core.disagg.mooncake_store import MooncakeFeatureStore, start_master
from core.distributed import destroy, pick_device
from core.features import capture_examples, load_target, target_identity
from core.feeding import gpu_memory
from data.chat import DataError
from data.datasets import build_examples, load_records, split_holdout
from data.feature_store import FeatureStore, SampleRef, StoredExample, feature_schema, tokens_digest
from data.packing import plan_batches
from models.target import default_aux_layers, fingerprint, load_heads, load_tokenizer, resolve_target

ROOT = Path(__file__).resolve().parents[2]  # the checkout: train.py's folder


def control_dir(cfg) -> Path:
    return Path(cfg.deploy.control or Path(cfg.out) / "pipeline")


def store_spec(cfg) -> str:
    return cfg.deploy.store or str(control_dir(cfg) / "features")


def watermarks(cfg, B: int) -> tuple[int, int, int]:
    """(lease size, high, low) in samples, checked so the pipeline cannot deadlock. B: the most
    samples one step has (--batch-size; with --batch-tokens the fullest step of the plan)."""
    d = cfg.deploy
    n, high, low = d.lease_size or B, d.high_watermark or 4 * B, d.low_watermark or 2 * B
    if high < B or not 0 <= low < high:
        raise SystemExit(
            f"watermarks: need --high-watermark >= the largest step ({B} samples) and 0 <= --low-watermark < "
            f"--high-watermark; got high {high}, low {low}"
        )
    return min(n, high), high, low


def largest_step(items) -> int:
    """The most train samples one step of the plan [(pos, step, sample)] has."""
    return max(Counter(s for _, s, _ in items if s >= 0).values(), default=0)


def plan_fingerprint(cfg, train, evals, total: int) -> dict:
    """What the producers and consumers must agree on: the samples and their order."""
    return {
        "tokens_sha": tokens_digest(list(train) + list(evals)),
        "train": len(train),
        "eval": len(evals),
        "batch_size": cfg.batch_size,
        "batch_tokens": cfg.batch_tokens,
        "seed": cfg.seed,
        "steps": total,
    }


def open_store(spec: str, schema: dict | None = None):
    if spec.startswith("mooncake://"):
        return MooncakeFeatureStore(spec, schema)
    return FeatureStore(spec, schema)


def fault_point(who: str, n: int, claim: Path | None = None):
    """Fault injection for the tests: NANOSPEC_FAULT=hang:WHO:N stops WHO here at its N-th pass
    (a producer holding its N-th lease, the consumer after acking step N) until it is killed.
    hang:first-producer:N stops whichever producer reaches its N-th lease first (one of them
    always does; a named one may not, when another starts sooner and takes the leases); `claim`
    is the file that decides who was first."""
    spec = os.environ.get("NANOSPEC_FAULT", "")
    if spec == f"hang:first-producer:{n}" and claim is not None:
        try:
            os.close(os.open(claim, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    elif spec != f"hang:{who}:{n}":
        return
    print(f"[fault] {who} hangs at {n}", flush=True)
    time.sleep(1e9)


# ====================================================================== producer
class Heartbeat(threading.Thread):
    """Beats from its own connection, so a long target forward does not look like a death."""

    def __init__(self, root, wid: int, every: float):
        super().__init__(daemon=True, name="heartbeat")
        self.ctl, self.wid, self.every, self.stop = Controller(root), wid, every, threading.Event()

    def run(self):
        while not self.stop.wait(self.every):
            self.ctl.beat(self.wid)


def produce(cfg, vllm_target=None):
    d = cfg.deploy
    kind, dtype = pick_device(cfg.device, "auto")
    device = torch.device(kind, int(os.environ.get("LOCAL_RANK", 0))) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        gpu_memory(cfg, device)  # --gpu-memory caps the producer's target as it does the consumer's
    target_dir = resolve_target(cfg.target)
    examples = build_examples(load_records(cfg.data, cfg.num_records or None), load_tokenizer(target_dir), cfg.max_len)
    train, evals = split_holdout(examples, cfg.holdout)
    samples = train + evals  # sample id = index here (the plan's ids)
    batches = plan_batches(cfg, train, cfg.max_len)  # tokenized within --max-len: the Trainer's rows are too
    total = cfg.steps or batches.per_epoch
    fp = plan_fingerprint(cfg, train, evals, total)
    ctl = Controller(control_dir(cfg), d.lease_timeout, d.max_attempts)
    items = plan_items(batches, total, len(evals))
    ctl.init_plan(items, fp, cfg.batch_size)
    n, high, low = watermarks(cfg, largest_step(items))
    target = load_target(cfg.backend, target_dir, list(cfg.aux_layers) or None, dtype, device, cfg.max_len, vllm_target)
    H = target.config.hidden_size
    store = open_store(
        store_spec(cfg), feature_schema(target_identity(target), target.aux_layers, H, dtype, {"plan": fp})
    )
    wid = ctl.register("producer", d.worker_name)
    name = d.worker_name or f"w{wid}"
    beat = Heartbeat(control_dir(cfg), wid, d.heartbeat)
    beat.start()
    print(
        f"[producer {name}] target {target_dir} ({dtype}, --backend {cfg.backend}), lease {n}, "
        f"watermarks {low}/{high}, store {store_spec(cfg)}",
        flush=True,
    )
    leases, produced, t0, idle = 0, 0, time.time(), 0.01
    try:
        while True:
            items = ctl.lease(wid, n, high, low)
            if not items:
                state, error = ctl.state()
                if state == "done":
                    break
                if state == "failed":
                    raise PipelineError(error)
                time.sleep(idle)  # a lease is a write transaction: back off while paused
                idle = min(2 * idle, 0.2)
                continue
            idle = 0.01
            leases += 1
            fault_point(name, leases, Path(control_dir(cfg)) / "fault.claim")  # tests: hang here holding a lease
            part = [samples[s] for _, s, _ in items]
            key = f"{items[0][0]:09d}-w{wid}-a{items[0][2]}"
            try:
                tensors = capture_examples(target, part, n * cfg.max_len, device)
                store.put(key, tensors, samples=[(s, len(e.input_ids)) for (_, s, _), e in zip(items, part)])
            except Exception as e:  # counted against the prompts' retry budget
                ctl.give_back(wid, [p for p, _, _ in items], f"producer {name}: {type(e).__name__}: {e}")
                print(f"[producer {name}] failed on positions {items[0][0]}..: {e}", flush=True)
                continue
            refs, off = [], 0
            for (pos, s, _), e in zip(items, part):
                refs.append((pos, SampleRef(s, key, off, len(e.input_ids))))
                off += len(e.input_ids)
            if ctl.publish(wid, refs):
                produced += len(refs)
            else:  # our leases went to another producer meanwhile: its copy counts
                store.delete(key)
    finally:
        beat.stop.set()
        ctl.leave(wid)
        if hasattr(target, "close"):  # --backend vllm: the engine process
            target.close()
    print(f"[producer {name}] done: {produced} samples in {leases} leases, {time.time() - t0:.1f} s", flush=True)


# ====================================================================== consumer
def consumer_target(target_dir, aux_layers, dtype, device):
    """The consumer needs only the target's embeddings and lm_head (producers run the rest)."""
    from transformers import AutoConfig  # heavy, and only a consumer needs it here

    layers = list(aux_layers) or default_aux_layers(AutoConfig.from_pretrained(target_dir).num_hidden_layers)
    return load_heads(target_dir, layers, dtype, device)


def consumer_class(Trainer):
    """core.trainer.Trainer (passed in: core/trainer.py imports this module, so importing it here would close a
    cycle) with the consumer's hooks."""

    class Consumer(Trainer):
        """Trainer whose features come from the producers, one optimizer step at a time."""

        def __init__(self, cfg):
            super().__init__(cfg)
            d = cfg.deploy
            self.ctl = Controller(control_dir(cfg), d.lease_timeout, d.max_attempts)
            fp = plan_fingerprint(cfg, self.train_set, self.eval_set, self.total_steps)
            self.ctl.init_plan(plan_items(self.batches, self.total_steps, len(self.eval_set)), fp, cfg.batch_size)
            self._lock = threading.Lock()

        def _open_store(self):
            with self._lock:  # the prefetch thread and the main thread may both get here first
                if self.store is None:
                    store = open_store(store_spec(self.cfg))
                    want = store.schema["target"]["fingerprint"]
                    if want != fingerprint(self.target.path) or store.schema["aux_layers"] != self.target.aux_layers:
                        raise PipelineError(
                            f"the producers' features in {store_spec(self.cfg)} come from another target or "
                            f"aux layers ({want}, {store.schema['aux_layers']}) than {self.target.path}"
                        )
                    self.store = store

        def _attach(self, examples, refs):
            out = []
            for e, r in zip(examples, refs):
                if r.length != len(e.input_ids):
                    raise PipelineError(
                        f"ref {r} does not match sample {r.id} ({len(e.input_ids)} tokens): "
                        "producers and consumer tokenized different data"
                    )
                out.append(StoredExample(e.input_ids, e.loss_mask, r))
            return out

        def step_examples(self, step):
            refs = self.ctl.wait_step(step, self.cfg.deploy.producer_timeout)
            self._open_store()
            idx = self.batches.indices(step, self.rank, self.world)
            first = self.batches.first(step, self.rank, self.world)  # this rank's slice of the step's refs
            local = refs[first : first + len(idx)]
            assert [r.id for r in local] == idx, (step, [r.id for r in local], idx)
            return self._attach([self.train_set[i] for i in idx], local)

        def after_step(self, step):
            if self.rank == 0:  # the ledger row and the ack commit together; then the features go
                for key in self.ctl.ack(step):
                    self.store.delete(key)
            fault_point("consumer", step)  # tests: hang here (after the ack), to be killed

        def evaluate(self):
            if not self.eval_set:  # --holdout 0: the plan has no eval refs to wait for
                return super().evaluate()
            refs = self.ctl.wait_step(-1, self.cfg.deploy.producer_timeout)
            self._open_store()
            self.eval_set = self._attach(self.eval_set, refs)
            return super().evaluate()

        def train(self):
            latest = Path(self.cfg.out) / "ckpt" / "latest"
            start = int(latest.read_text().strip().removeprefix("step_")) if latest.exists() else 0
            trained = {s for _, s, _ in self.ctl.ledger()}
            if start and start - 1 in trained and not self.cfg.resume:  # a restart of this run
                self.cfg = dataclasses.replace(self.cfg, resume=True)
            if not self.cfg.resume:
                start = 0
            if self.rank == 0:
                n = self.ctl.rollback(start)
                if n:
                    print(
                        f"[ledger] {n} samples trained after the checkpoint at step {start} are not in the weights: "
                        "their prompts go back to the producers",
                        flush=True,
                    )
            self.barrier()
            res = super().train()
            if self.rank == 0 and "stopped_at" not in res:
                self.ctl.finish()
                left = self.ctl.unused_keys() | set(self.store.keys())
                for key in left:  # eval features, and shards of producers that died mid-publish
                    self.store.delete(key)
                s = self.ctl.stats()
                print(
                    f"[pipeline] done: {len(self.ctl.ledger())} samples in the ledger, "
                    f"max in flight {s['max_inflight']}, "
                    f"producers paused {s['pauses']} times",
                    flush=True,
                )
            return res

    return Consumer


def consume(cfg, Trainer):
    try:
        trainer = consumer_class(Trainer)(cfg)
        return trainer.train()
    finally:
        destroy()


# ====================================================================== launcher
def launch(cfg):
    """One node, both pools: start the producers and the consumer ranks, supervise them, and
    fail the run (stopping everyone) if the consumer fails."""
    d = cfg.deploy
    root = control_dir(cfg)
    if not cfg.resume:  # a fresh run: no leases, refs or ledger of an earlier one (a --store of yours is left alone)
        (root / "control.db").unlink(missing_ok=True)
        shutil.rmtree(root / "features", ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    master = None
    if d.store == "mooncake://local":
        master, store = start_master(root)
        cfg = dataclasses.replace(cfg, deploy=dataclasses.replace(d, store=store))
        d = cfg.deploy
    run_yaml = root / "run.yaml"
    dump_yaml(dataclasses.replace(cfg, deploy=dataclasses.replace(d, producers=0, control=str(root))), run_yaml)
    n_proc = d.producers + d.consumer_ranks
    env = {**os.environ}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n_proc)))
    base = ["train.py", "--config", str(run_yaml)]
    producers = [
        subprocess.Popen([sys.executable, *base, "--role", "producer", "--worker-name", f"p{i}"], cwd=ROOT, env=env)
        for i in range(d.producers)
    ]
    launcher = (
        [sys.executable]
        if d.consumer_ranks == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={d.consumer_ranks}"]
    )
    consumer = subprocess.Popen([*launcher, *base, "--role", "consumer"], cwd=ROOT, env=env)
    print(
        f"[launch] {d.producers} producer(s) (pids {[p.pid for p in producers]}), {d.consumer_ranks} consumer rank(s) "
        f"(pid {consumer.pid}); control {root}",
        flush=True,
    )
    reported = set()
    try:
        while (rc := consumer.poll()) is None:
            for i, p in enumerate(producers):
                if p.poll() is not None and i not in reported:
                    reported.add(i)
                    print(f"[launch] producer p{i} exited ({p.returncode}); its leases return to the pool", flush=True)
                    if all(q.poll() not in (None, 0) for q in producers):  # none left to wait for
                        Controller(root).fail(
                            f"every producer exited with an error ({[q.returncode for q in producers]}); "
                            "see their output above"
                        )
            time.sleep(0.2)
        if rc != 0:
            Controller(root).fail(f"the consumer exited with status {rc}")
        for p in producers:  # they leave once the run is done or failed
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.terminate()
        if rc != 0:
            raise SystemExit(rc)
    finally:
        for p in [*producers, consumer]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait()
        if master is not None:
            master.terminate()
            master.wait()


def main(cfg, Trainer, vllm_target=None):
    """train.py's entry for --role / --producers; Trainer: core.trainer's, which a consumer runs with its hooks;
    vllm_target: tools/vllm_features.vllm_target, for producers with --backend vllm."""
    role = cfg.deploy.role
    try:
        if role == "producer":
            return produce(cfg, vllm_target)
        if role == "consumer":
            return consume(cfg, Trainer)
        return launch(cfg)
    except (PipelineError, DataError, FileNotFoundError, FloatingPointError) as e:
        raise SystemExit(f"error: {e}") from None
