"""speculators' own offline EAGLE-3 trainer (vLLM's, the `speculators` package) against train.py --features,
back to back on one machine, on the same examples and the same target hidden states.

Steps (each skipped when its output is already in --work, so a rerun after a timeout continues):
1. the verifier: a random-weight preset directory (tools/random_target.py; --smoke: the preset 64 wide);
2. our FeatureStore: `capture.py features` on --data / --num-records / --max-len (aux layers + final hidden);
3. their offline data dir, converted from that store (nothing recomputed): a `datasets` dir saved with
   save_to_disk (columns input_ids, loss_mask, seq_len; torch format), hidden_states/hs_{i}.safetensors
   (token_ids [T] int64, hidden_states [T, n_aux + 1, H]: the aux layers, then the final hidden state) and
   token_freq.pt (counts of the loss-masked ids; their trainer derives d2t/t2d-<V>.npy from it);
4. their trainer (`speculators.train.cli.main`, in a subprocess through the small wrapper SPEC_WRAPPER
   below, which records their per-step metric dicts as JSON lines and the peak GPU memory), AdamW, full
   attention in the draft layer, TTT --ttt-length, one packed row of --max-len tokens per step;
5. train.py --features, once per --ours: `defaults` (no batching option: on a GPU packed rows of --max-len, as
   many as train.py sizes from the GPU's memory, what a user gets) and `matched` (--batch-tokens --max-len: one
   packed row a step, their tokens per step; the stricter comparison).
One JSON line per run is appended to --out: trainer, model, seq, tokens_per_step, real_tokens_per_s,
peak_gib, steps, command, versions, date.

Throughput is the median over windows of --log-every steps after --skip-windows (train.py: its own
metrics.jsonl windows; theirs: their per-step `profile` (step_ms from the end of the previous step, GPU
synchronized, data fetch included; tokens = positions with a document id, i.e. T - 1 per conversation
after their shift) summed over the same windows). Peak memory: torch.cuda.max_memory_allocated over the
whole run for both (ours from run.json, theirs printed by the wrapper).

Differences that stay: their final hidden state is read before the final norm (vLLM's) and normed again
by their trainer; ours stores it normed, so their norm runs twice (RMSNorm with the random target's unit
weight is idempotent up to eps: the timing does not depend on the values). Their forward is
torch.compile'd on a GPU (their default); train.py's packed step is eager (packed + --compile is refused
on a GPU today). They validate and save a checkpoint (model + optimizer) after the steps; train.py
evaluates 8 held-out conversations at start and end: all outside the timed windows.

    bash tools/speculators_wheels.sh          # CPU machine: speculators + deps as py3.12 wheels in .whl-spec/
    bash experiments/h200_anchor.sh          # GPU: this script on the tokenizer of .whl-spec, rows to $OUT
    python experiments/speculators_anchor.py --smoke   # CPU, the preset 64 wide: both trainers run 6 steps

--smoke runs their trainer on the CPU with one substitution: their Trainer moves the model and batches to
the accelerator index 0 and synchronizes the accelerator for its step timer, neither of which exists on a
CPU, so the wrapper makes that index "cpu" and the synchronize a no-op (and the hidden states fp32, eager
loss, sdpa attention: their fused loss is Triton, their bf16 needs autocast). Nothing is patched on a GPU.
"""

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import tyro
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import DataOption, MaxLenOption, NumRecordsOption  # noqa: E402
from core.config import to_flags  # noqa: E402
from core.train_config import TrainConfig  # noqa: E402
from data.feature_store import StoreError, open_feature_store  # noqa: E402
from experiments.train_throughput import environment, run, train_py_figures  # noqa: E402
from models.engines import engine_aux_ids  # noqa: E402
from models.fast_target import PRESETS  # noqa: E402
from models.target import fingerprint  # noqa: E402


@dataclasses.dataclass
class Args(MaxLenOption, NumRecordsOption, DataOption):
    preset: str = "llama-3.1-8b"
    """the verifier: a models/fast_target.py preset, written with random weights to --work (or a target dir)"""
    heads_only: bool = False
    """the random verifier without its decoder layers on disk (tools/random_target.py --no-weights --heads: the
    embeddings, final norm and lm_head, which both trainers read; capture.py draws the rest on the GPU): a shape whose
    weights fill the GPU machine's disk (Qwen3-30B-A3B: 61 GB; with it 1.2 GB)"""
    tokenizer: str = "smollm2"
    """the tokenizer copied into the random verifier (tools/random_target.py --tokenizer: dir, .gguf, smollm2)"""
    num_records: int = 500  # covers --steps (30) of their packed rows with a margin
    """conversations tokenized (mean ~390 tokens at --max-len 4096: 500 give ~46 of their steps)"""
    max_len: int = 4096  # the 8B recipe's rows (their --total-seq-len)
    ttt_length: int = 7
    draft_vocab_size: int = 32000
    steps: int = 30
    log_every: int = 5
    skip_windows: int = 2
    """windows left out of the median (compile, autotune, first shapes)"""
    ours: tuple[str, ...] = ("defaults", "matched")
    """train.py runs: defaults (its batching from the GPU's memory) and/or matched (one packed row a step)"""
    lr: float = 3e-4
    num_workers: int = 4
    """their DataLoader workers"""
    trainers: tuple[str, ...] = ("speculators", "nanospec")
    their_extra: tuple[str, ...] = ()
    """more flags for their trainer, split at spaces (e.g. --their-extra="--loss-implementation eager")"""
    our_extra: tuple[str, ...] = ()
    """more train.py flags, split at spaces (--our-extra="--attention flex_buf")"""
    spec_wheels: Path = ROOT / ".whl-spec"
    """wheels installed (--no-deps) into --work/site-spec when `speculators` is not importable"""
    work: Path = Path("/tmp/speculators_anchor")
    out: Path = ROOT / "experiments/results/speculators_anchor_h200.jsonl"
    smoke: bool = False
    """CPU: the preset's shape 64 wide (8 layers), 6 steps of each trainer, rows to /tmp"""


# Runs their trainer: argv = [rows.jsonl, their flags...]. Their metric records are dicts logged to
# "speculators.metrics" (propagating to root); a root handler installed first keeps them (their setup's
# logging.basicConfig then adds no console handler of its own; dictConfig leaves root alone).
SPEC_WRAPPER = r"""
import json, logging, sys, time
import torch
rows = open(sys.argv[1], "a")
class Rows(logging.Handler):
    def emit(self, r):
        if isinstance(r.msg, dict) and r.msg.get("profile"):
            rows.write(json.dumps({"time": time.time(), **r.msg}, default=str) + "\n")
            rows.flush()
text = logging.StreamHandler(sys.stdout)
text.setFormatter(logging.Formatter("[speculators] %(message)s"))
logging.basicConfig(level=logging.INFO, handlers=[Rows(), text])
if not torch.cuda.is_available():  # --smoke: their Trainer uses accelerator index 0 and synchronizes it
    import speculators.train.trainer as trainer
    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kw: None
from speculators.train.cli import main
from speculators.train.config import TrainConfig
main(TrainConfig.resolve(sys.argv[2:]))
peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
print("SPECULATORS_PEAK " + json.dumps({"max_allocated_bytes": peak}), flush=True)
"""


def spec_env(a: Args) -> dict:
    """The environment their trainer runs in: --work/site-spec first on the path (installed from
    --spec-wheels when speculators is not importable as it is)."""
    env = dict(os.environ)
    site = a.work / "site-spec"
    probe = [
        sys.executable,
        "-c",
        "import importlib.metadata as m, speculators.train.cli; print(m.version('speculators'))",
    ]

    def importable(e):
        return subprocess.run(probe, env=e, capture_output=True, text=True)

    p = importable(env)
    if p.returncode:
        wheels = sorted(a.spec_wheels.glob("*.whl"))
        if not wheels:
            raise SystemExit(f"speculators is not importable and {a.spec_wheels} has no wheels:\n{p.stderr[-2000:]}")
        if not site.exists():
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            subprocess.run([*cmd, "--target", str(site), *map(str, wheels)], check=True)
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
        p = importable(env)
        if p.returncode:
            raise SystemExit(f"speculators is not importable even with {site}:\n{p.stderr[-3000:]}")
    env["SPECULATORS_VERSION"] = p.stdout.strip().splitlines()[-1]
    return env


def make_verifier(a: Args) -> Path:
    """The random-weight verifier dir (tools/random_target.py); --smoke: the preset's shape shrunk to 64 wide."""
    if a.preset not in PRESETS:
        return Path(a.preset)
    cmd = [sys.executable, "tools/random_target.py", a.preset]
    out = a.work / (a.preset + ("-heads" if a.heads_only else ""))
    if a.smoke:
        small = dict(PRESETS[a.preset], hidden_size=64, intermediate_size=128, num_hidden_layers=8)
        small |= dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        # one directory per shape: a smoke of another preset in the same --work must not find this one's
        cmd[-1], out = str(a.work / "tiny.json"), a.work / ("tiny-" + out.name)
        (a.work / "tiny.json").write_text(json.dumps(small))
    if not (out / "config.json").exists():  # ~1 min for 16 GB on a GPU
        heads = ["--no-weights", "--heads"] if a.heads_only else []
        run([*cmd, str(out), "--tokenizer", a.tokenizer, *heads], a.work / "random_target.log")
    return out


def capture(a: Args, verifier: Path) -> Path:
    """Our FeatureStore (capture.py features), reused when it holds these settings complete."""
    store = a.work / "store"
    try:
        s, _ = open_feature_store(store)
        d, fp = s.schema["data"], s.schema["target"]["fingerprint"]
        if (d["data"], d["num_records"], d["max_len"], fp) == (a.data, a.num_records, a.max_len, fingerprint(verifier)):
            return store
        raise StoreError(f"{store} holds other settings ({d['data']}, {d['num_records']}, {d['max_len']}, target {fp})")
    except StoreError as e:
        if (store / "store.json").exists():
            raise SystemExit(f"{e}: delete {store} (and {a.work / 'spec_data'}) first") from None
    cmd = [sys.executable, "capture.py", "features", "--target", str(verifier), "--data", a.data]
    cmd += ["--num-records", str(a.num_records), "--max-len", str(a.max_len), "--out", str(store)]
    cmd += ["--backend", "compiled"]  # models/fast_target.py (layers compiled on a GPU), reads the safetensors
    run(cmd, a.work / "capture.log")
    return store


def convert(store_dir: Path, out: Path) -> dict:
    """Their offline data dir from our store: the same samples in id order, the same hidden states."""
    import datasets  # lazy: Hugging Face datasets (~2 s to import), only to write speculators' data dir

    store, examples = open_feature_store(store_dir)
    sha = store.schema["data"]["tokens_sha"]
    done = out / "nanospec_source.json"
    info = {"store": str(store_dir), "tokens_sha": sha, "samples": len(examples)}
    if done.exists() and json.loads(done.read_text()) == info:
        return info
    H = store.schema["fields"]["final_hidden"]["shape"][0]
    n_aux = len(store.schema["aux_layers"])
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": [e.input_ids for e in examples],
            "loss_mask": [e.loss_mask for e in examples],
            "seq_len": [len(e.input_ids) for e in examples],
        },
        features=datasets.Features(
            {
                "input_ids": datasets.List(datasets.Value("int64")),
                "loss_mask": datasets.List(datasets.Value("int64")),
                "seq_len": datasets.Value("int64"),
            }
        ),
    )
    ds.set_format(type="torch")  # as their preprocessing leaves it
    ds.save_to_disk(str(out))
    hs = out / "hidden_states"
    hs.mkdir(exist_ok=True)
    freq = Counter()
    for i, e in enumerate(examples):
        t = store.read(e.ref, ["aux_hidden", "final_hidden"])
        T = len(e.input_ids)
        h = torch.cat([t["aux_hidden"].view(T, n_aux, H), t["final_hidden"].view(T, 1, H)], dim=1)
        ids = torch.tensor(e.input_ids, dtype=torch.long)
        save_file({"token_ids": ids, "hidden_states": h.contiguous()}, hs / f"hs_{i}.safetensors")
        freq.update(tok for tok, m in zip(e.input_ids, e.loss_mask) if m)
    torch.save(dict(freq), out / "token_freq.pt")
    done.write_text(json.dumps(info))
    return info


def windows(steps: list[tuple[float, float]], size: int, skip: int) -> list[float]:
    """(tokens, seconds) per step -> tokens/s of consecutive windows of `size` steps, the first `skip` left out."""
    out = []
    for w in range(skip, len(steps) // size):
        part = steps[w * size : (w + 1) * size]
        out.append(sum(t for t, _ in part) / sum(s for _, s in part))
    return out


# what torch 2.11's dynamo says when their fused loss kernel runs inside their compiled forward
FUSED_LOSS_FAILURE = "is already tracked for mutation"


def their_row(a: Args, verifier: Path, data: Path, env: dict, aux_ids: list[int]) -> dict:
    out = a.work / "spec_run"
    rows = out / "steps.jsonl"
    rows.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    flags = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(verifier), "--data-path", str(data)]
    flags += ["--total-seq-len", str(a.max_len), "--ttt-steps", str(a.ttt_length)]
    flags += ["--draft-vocab-size", str(a.draft_vocab_size), "--num-layers", "1", "--full-attention-indices", "0"]
    flags += ["--target-layer-ids", *map(str, aux_ids), "--mask-token-id", "0", "--optimizer", "adamw"]
    flags += ["--lr", str(a.lr), "--epochs", "1", "--max-steps", str(a.steps), "--log-freq", "1", "--seed", "0"]
    flags += ["--train-data-ratio", "0.95", "--on-missing", "raise", "--no-resume-from-checkpoint"]
    flags += ["--num-workers", str(a.num_workers), "--save-path", str(out / "ckpt"), "--log-dir", str(out / "logs")]
    if a.smoke:  # fp32 (no autocast on a CPU), eager loss (theirs is Triton), sdpa
        flags += ["--hidden-states-dtype", "float32", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa"]
    flags += [w for x in a.their_extra for w in x.split()]
    t = time.time()
    log = a.work / "speculators.log"
    loss = "as given" if "--loss-implementation" in flags else "fused (their default)"
    try:
        run([sys.executable, "-c", SPEC_WRAPPER, str(rows), *flags], log, env)
    except SystemExit:
        # their default loss, a Triton kernel, failed under their torch.compile'd forward on torch 2.11 with a
        # dynamo assertion (2026-12-02; 2026-12-05: results/speculators_anchor_h100/anchor_fused_loss_failed.log):
        # once more with their eager loss, which the row says, instead of a call lost
        if "--loss-implementation" in flags or FUSED_LOSS_FAILURE not in log.read_text(errors="replace"):
            raise
        log.replace(log.with_name("speculators_fused_failed.log"))
        rows.unlink(missing_ok=True)
        flags += ["--loss-implementation", "eager"]
        loss = "eager (their fused loss failed under torch.compile: speculators_fused_failed.log)"
        run([sys.executable, "-c", SPEC_WRAPPER, str(rows), *flags], log, env)
    steps = [json.loads(line) for line in rows.read_text().splitlines()]
    per = [(p["tokens_per_s"] * p["step_ms"] / 1000, p["step_ms"] / 1000) for p in (s["profile"] for s in steps)]
    rates = windows(per, a.log_every, a.skip_windows)
    peak = next(
        json.loads(line.split(" ", 1)[1])["max_allocated_bytes"]
        for line in log.read_text().splitlines()
        if line.startswith("SPECULATORS_PEAK ")
    )
    timed = per[a.skip_windows * a.log_every :]
    return {
        "trainer": "speculators",
        "speculators": env["SPECULATORS_VERSION"],
        "batch": 1,
        "batch_unit": f"one packed row of {a.max_len} tokens (their multipack sampler)",
        "tokens_per_step": statistics.mean(t for t, _ in per),
        "real_tokens_per_s": statistics.median(rates),
        "windows": len(rates),
        "step_s": statistics.median(s for _, s in timed),
        "peak_gib": peak / 2**30 if peak else None,
        "steps": len(steps),
        "wall_s": time.time() - t,
        "loss_implementation": loss,
        "command": " ".join(["python -m speculators.train", *flags]).replace(str(a.work), "WORK"),
    }


def our_row(a: Args, verifier: Path, store: Path, variant: str) -> dict:
    """train.py --features as `variant` (Args.ours) batches it: defaults leave --batch-tokens at auto."""
    out = a.work / f"nanospec_{variant}"
    batching = {"batch_tokens": a.max_len} if variant == "matched" else {}
    cfg = TrainConfig(
        target=str(verifier),
        features=str(store),
        max_len=a.max_len,
        pack="on",
        ttt_length=a.ttt_length,
        draft_vocab_size=a.draft_vocab_size,
        **batching,
        steps=a.steps,
        log_every=a.log_every,
        lr=a.lr,
        holdout=8,
        out=str(out),
        overwrite=True,
        progress=False,
    )
    cmd = [sys.executable, "train.py", *to_flags(cfg)]
    cmd += [w for x in a.our_extra for w in x.split()]
    t = time.time()
    run(cmd, a.work / f"nanospec_{variant}.log")
    return {
        "trainer": "nanospec",
        "variant": variant,
        **train_py_figures(out, a.skip_windows),
        "wall_s": time.time() - t,
        "command": " ".join(["python", *cmd[1:]]).replace(str(a.work), "WORK"),
    }


def main(a: Args):
    if a.smoke:
        a.max_len, a.num_records, a.steps, a.log_every, a.skip_windows = 256, 60, 6, 2, 1
        a.ttt_length, a.draft_vocab_size, a.num_workers = 2, 64, 2
        a.work, a.out = Path("/tmp/speculators_anchor_smoke"), Path("/tmp/speculators_anchor_smoke.jsonl")
        a.out.unlink(missing_ok=True)
    a.work.mkdir(parents=True, exist_ok=True)
    env = spec_env(a) if "speculators" in a.trainers else None  # fail here, before minutes of setup
    verifier = make_verifier(a)
    store = capture(a, verifier)

    s, examples = open_feature_store(store)
    lengths = [len(e.input_ids) for e in examples]
    train_tokens = sum(n - 1 for n in lengths[: int(len(lengths) * 0.95)])
    if train_tokens < 1.15 * a.steps * a.max_len:  # their packed rows fill to ~97%: one epoch must cover --steps
        raise SystemExit(
            f"{train_tokens} training tokens give fewer than {a.steps} rows of {a.max_len}: raise --num-records"
        )
    common = {
        "model": a.preset + (" (64 wide)" if a.smoke else ""),
        "seq": a.max_len,
        "ttt": a.ttt_length,
        **environment(),
    }
    common |= {"draft_vocab_size": a.draft_vocab_size, "data": a.data, "samples": len(lengths), "optimizer": "adamw"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    theirs = None  # their row, which ours are compared with

    def write(r):  # each row as it comes: a call cut short keeps the runs that finished
        r = {**common, **r}
        if theirs is not None and r["trainer"] == "nanospec":
            r["vs_speculators"] = r["real_tokens_per_s"] / theirs["real_tokens_per_s"]
        print(json.dumps(r), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(r) + "\n")
        os.sync()

    if "speculators" in a.trainers:
        data = a.work / "spec_data"
        t = time.time()
        convert(store, data)
        print(f"[anchor] their data dir {data} ({time.time() - t:.0f} s)", flush=True)
        theirs = their_row(a, verifier, data, env, engine_aux_ids(s.schema["aux_layers"], "vllm"))
        write(theirs)
    if "nanospec" in a.trainers:
        for variant in a.ours:
            write(our_row(a, verifier, store, variant))


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
