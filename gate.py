"""Train-serve consistency gate (after SpecForge's): a draft that has memorised one sample must be
served by a real engine with near-perfect acceptance and the target's own greedy text.

    python gate.py [--out runs/gate] [--k 3] [--ckpt DIR --sample runs/gate/sample.json]
    python gate.py --strategy dflash|peagle                # other families
    python gate.py --train-args --fc-norm --norm-output    # EAGLE-3.1 (eagle3 / peagle options)

  1 sample  pick the first prompt of --data that renders with the target's chat template, fits
            --max-prompt-tokens and round-trips through the tokenizer; its assistant turn is the
            target's own greedy continuation (PyTorch), so training and serving see the same
            tokens. Written to <out>/sample.json (+ train.jsonl, the one-record training set).
  2 overfit train.py (the public path, as a subprocess) on that record in chunks of --chunk
            steps (--resume in between) until the last step's loss_k <= --max-loss and
            acc_k >= --min-acc for every k < K; the exact final checkpoint is kept.
  3 serve   export it (export.py), load the export back, decode the prompt in PyTorch (greedy
            reference + our acceptance), then vLLM (own virtualenv, created if missing) with
            the family's speculative method and num_speculative_tokens K, greedy; read vllm:spec_decode_* counters and
            require τ_vllm - 1 >= --min-accept * K and served tokens == the greedy reference.
Exit 0 with a report (<out>/gate.json), or 1 with `GATE FAILED at <stage>: <why>` (a bad option or input
file, e.g. --data, --sample, --target, --ckpt, -k 0: `error: <why>`, failed_stage "input" in gate.json; an
--out it cannot or must not write, e.g. a file, a read-only place, another command's output or a folder of other
files: `error: <why>` alone, nothing written).
With --ckpt (and --sample) stages 1-2 are skipped: the gate checks that checkpoint. --ckpt may also be
a serving dir (e.g. the shipped drafts/smollm2-135m-eagle3): it is served as it is, after a check that
it fits the target (hidden size, vocabulary, aux layers, tokenizer); without --sample, stage 1 picks
the prompt. A draft not overfit on that prompt needs a --min-accept of its own (e.g. 0.3).
"""

import contextlib
import io
import json
import math
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import tyro

from core import vllm_spec
from core.cli_options import DataOption, MaxLenOption, StrategyOption, TargetOption
from data.chat import DataError, check_template, render, to_messages, tokenize_chat

ROOT = Path(__file__).resolve().parent


class InputError(Exception):
    """A bad option or input file (--data, --sample, --ckpt): `error: ...`, not a gate verdict."""


SAMPLE_KEYS = ("target", "prompt_ids", "served_tokens", "eos_ids")  # what stages 2-3 read of a sample.json


def load_sample(path: Path) -> dict:
    """A sample.json of an earlier gate run, checked for what the later stages read (a wrong file was a
    JSONDecodeError or KeyError traceback)."""
    try:
        sample = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"--sample {path}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"--sample {path}: not a sample.json of a gate run ({type(e).__name__}: {e})") from None
    missing = [k for k in SAMPLE_KEYS if not isinstance(sample, dict) or k not in sample]
    if missing:
        raise InputError(f"--sample {path}: not a sample.json of a gate run (no {', '.join(missing)})")
    return sample


class GateFailure(Exception):
    def __init__(self, stage: str, why: str):
        super().__init__(f"{stage}: {why}")
        self.stage, self.why = stage, why


@dataclass
class GateConfig(MaxLenOption, DataOption, TargetOption, StrategyOption):
    """Train-serve consistency gate: overfit a draft on one sample, serve it in vLLM, require near-perfect
    acceptance and the target's greedy text (stages: gate.py's docstring). vLLM serves --strategy eagle3 (and
    EAGLE-3.1), peagle and dflash (README, 'Draft families')."""

    out: str = "runs/gate"
    train_args: tuple[str, ...] = ()
    """more train.py flags for the overfit run, e.g. --fc-norm --norm-output (EAGLE-3.1)"""
    data: str = "sharegpt"  # the original answers: a prompt the packaged drafts' training data did not answer
    """where the prompt comes from ('sharegpt' or a ShareGPT/messages JSON/JSONL)"""
    scan_records: int = 64
    """records scanned for a valid prompt"""
    max_prompt_tokens: int = 64
    response_tokens: int = 48
    """greedy tokens served (the sample's assistant turn holds a few more, see stage 1)"""
    min_trainable: int = 24
    """fewest trained tokens (loss mask, past the first two) a sample must have"""
    max_len: int = 256  # one short sample
    k: int = 3
    """num_speculative_tokens served"""
    # stage 2
    max_steps: int = 40
    """the training schedule (cosine) spans this many steps; the gate fails if they do not reach the thresholds"""
    chunk: int = 20
    lr: float = 3e-3
    draft_vocab_size: int = 256
    max_loss: float = 0.8
    """loss_k threshold (soft CE against the target's distribution, k < K) on the final training
    step; its floor is the target's own entropy on the sample (about 0.7 for the default one)"""
    min_acc: float = 0.9
    """acc_k threshold (k < K) on the final training step. On a ~50-token sample acc_k moves by
    1-3 tokens from step to step even at the loss floor (near-ties in the target's distribution):
    0.91-1.0 over steps 29-40 on one CPU (served τ 4.0 = K+1 after step 40), 0.943 at step 40 on
    another; a broken draft scores far below, and stage 3 checks what is served"""
    # stage 3
    min_accept: float = 0.8
    """served mean accepted drafts per step, as a fraction of K (a draft at the training
    thresholds gets about 0.9 K on its sample; a draft with a scrambled input path gets < 0.3 K)"""
    max_tau_gap: float = 0.05
    """largest relative gap between vLLM's τ and ours on the sample (same draft, same prompt)"""
    export_dtype: str = "bf16"
    vllm_venv: str = ""
    """vLLM virtualenv (default: $NANOSPEC_VLLM_VENV or .venv-vllm); created if missing"""
    vllm_timeout: int = 900
    # skip stages 1-2
    ckpt: str = ""
    """check this training checkpoint (needs --sample) or serving dir instead of training one"""
    sample: str = ""
    """a sample.json written by an earlier gate run"""


def log(msg: str):
    print(f"[gate] {msg}", flush=True)


GATE_FILES = "sample.json, train.jsonl, train/ (replaced by each run), train.log, export-vllm/, vllm.log and gate.json"


def out_problem(out: Path) -> str | None:
    """Why --out cannot take a gate run (None: it can), before anything is written or loaded: a file or an
    unwritable place was a traceback, and another command's output or a folder of other files would have had
    its train/ replaced and its train.jsonl or sample.json overwritten (`--out runs` took runs/train)."""
    from core.runlog import output_kind, probe_write  # lazy: imports torch (seconds); gate.py --help runs without it

    if out.exists() and not out.is_dir():
        return f"--out {out} is a file, not a directory"
    kind = output_kind(out)
    if kind and not kind.startswith("a gate.py"):
        return f"--out {out} is {kind}: gate.py writes {GATE_FILES} there; give another --out"
    if out.is_dir() and not kind and (found := sorted(p.name for p in out.iterdir() if not p.name.startswith("."))):
        shown = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
        return (
            f"--out {out} holds files an earlier gate run did not write ({shown}): gate.py writes {GATE_FILES} "
            "there; give a new or empty directory"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe_write(out)
    except OSError as e:
        return f"--out {out}: cannot write there ({e.strerror or e})"
    return None


def check_options(cfg: GateConfig):
    """Option values that cannot work, as InputError before anything loads (-k 0, --max-steps 0 and an unknown
    --strategy were tracebacks after minutes; --export-dtype fp8 or --min-acc 2 trained a draft that could never
    be served or pass)."""
    from models.families import FAMILIES  # lazy: imports torch (seconds); gate.py --help runs without it

    at_least = {"k": 1, "max_steps": 1, "chunk": 1, "scan_records": 1, "max_prompt_tokens": 1}
    at_least |= {"response_tokens": 1, "min_trainable": 0, "max_len": 2, "draft_vocab_size": 1, "vllm_timeout": 1}
    for name, low in at_least.items():
        if (v := getattr(cfg, name)) < low:
            raise InputError(f"--{name.replace('_', '-')} must be at least {low}, got {v}")
    if cfg.max_prompt_tokens + cfg.response_tokens > cfg.max_len:  # --response-tokens 10**12 decoded until killed
        raise InputError(
            f"--max-prompt-tokens {cfg.max_prompt_tokens} + --response-tokens {cfg.response_tokens} must fit --max-len "
            f"{cfg.max_len} (the sample is one training row)"
        )
    if cfg.vllm_timeout > 30 * 86400:  # 10**12 was an OverflowError traceback from subprocess, after stage 2
        raise InputError(f"--vllm-timeout must be at most {30 * 86400} seconds (30 days), got {cfg.vllm_timeout}")
    if cfg.min_trainable > cfg.max_len - 2:  # 10**12 scanned every record, then 'no valid sample'
        raise InputError(
            f"--min-trainable {cfg.min_trainable} can never be met: the sample is one row of --max-len {cfg.max_len} "
            f"tokens, of which at most {cfg.max_len - 2} are trained"
        )
    if cfg.k > cfg.response_tokens:  # -k 10**12 drafted until killed
        raise InputError(f"--k {cfg.k} drafts more tokens a step than the {cfg.response_tokens} --response-tokens")
    for name, ok, rng in (
        ("lr", lambda v: v > 0, "in (0, inf)"),
        ("max_loss", lambda v: v > 0, "in (0, inf)"),
        ("min_acc", lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("min_accept", lambda v: 0 <= v <= 1, "in [0, 1] (a fraction of K)"),
        ("max_tau_gap", lambda v: v >= 0, "in [0, inf)"),
    ):
        if not (math.isfinite(v := getattr(cfg, name)) and ok(v)):
            raise InputError(f"--{name.replace('_', '-')} must be a finite number {rng}, got {v}")
    if cfg.export_dtype not in ("bf16", "fp16", "fp32"):
        raise InputError(f"--export-dtype must be bf16, fp16 or fp32, got {cfg.export_dtype!r}")
    if cfg.train_args:  # a flag train.py does not take failed stage 2 with tyro's box, after the sample stage
        from core.train_config import TrainConfig  # lazy: imports torch (seconds); gate.py --help runs without it

        box = io.StringIO()
        try:
            with contextlib.redirect_stderr(box), contextlib.redirect_stdout(box):
                tyro.cli(TrainConfig, args=list(cfg.train_args))
        except SystemExit:
            # (the closing "For full helptext, run PROG --help" wraps onto a second line when PROG's path is long)
            said = re.sub(r"[│╭╰─╮╯]|-{3,}|For full helptext.*", " ", box.getvalue(), flags=re.S)
            said = "; ".join(dict.fromkeys(x.strip() for x in said.splitlines() if x.strip()))
            raise InputError(f"--train-args {' '.join(cfg.train_args)!r}: not train.py flags ({said[:300]})") from None
    if cfg.vllm_venv and (why := vllm_spec.venv_problem(vllm_venv(cfg))):  # it was deleted whole before the build
        raise InputError(f"--vllm-venv: {why}")
    served = [n for n, f in FAMILIES.items() if f.serving and "vllm" in f.serving.engines]
    if cfg.strategy not in served:
        raise InputError(
            f"--strategy {cfg.strategy!r}: the gate serves a draft on vLLM, which loads {', '.join(served)}"
        )


def check_draft_vocab(cfg: GateConfig):
    """--draft-vocab-size past the target's vocabulary, before stage 1: it failed stage 2 with train.py's error line
    after the sample was chosen. A .gguf target (the packaged one too) is converted at stage 1, and train.py checks
    it there."""
    from models.target import config_int  # lazy: imports torch (seconds); gate.py --help runs without it

    target = Path(cfg.target)
    if cfg.ckpt or not (target / "config.json").is_file():
        return
    if (v := config_int(target, "vocab_size")) and cfg.draft_vocab_size > v:
        raise InputError(
            f"--draft-vocab-size {cfg.draft_vocab_size} is larger than the target's vocabulary ({v} tokens in "
            f"{target / 'config.json'}): the draft vocabulary is a subset of the target's"
        )


def check_ckpt(ckpt: Path):
    """--ckpt: a training run or checkpoint, or a serving dir (a file or another command's output was an unclear
    'needs --sample' or export failure after the target loaded)."""
    from core.runlog import output_kind  # lazy: imports torch (seconds); gate.py --help runs without it

    what = "give a training run or checkpoint (train.py --out, or its ckpt/step_N) or a serving dir (export.py --out)"
    if not ckpt.exists():
        raise InputError(f"--ckpt {ckpt}: no such directory")
    if not ckpt.is_dir():
        raise InputError(f"--ckpt {ckpt} is a file: {what}")
    kind = output_kind(ckpt)
    if kind and not kind.startswith(("a training", "a draft")):
        raise InputError(f"--ckpt {ckpt} is {kind}: {what}")
    if not kind and not (ckpt / "latest").is_file():  # (a run's ckpt/ folder names its latest)
        raise InputError(
            f"--ckpt {ckpt}: not a training run, checkpoint or serving dir (no run.json, draft.safetensors or draft "
            f"config.json in it): {what}"
        )


# ---------------------------------------------------------------- stage 1
def select_sample(cfg: GateConfig, out: Path) -> dict:
    import torch  # lazy: torch, transformers and what imports them stay out of gate.py --help (seconds)
    from transformers import AutoModelForCausalLM  # lazy: as torch

    from core.speculative import TargetRunner, speculative_generate  # lazy: imports torch
    from data.datasets import load_records  # lazy: imports torch
    from models.proposer import Proposer  # lazy: imports torch
    from models.target import eos_ids, load_tokenizer, resolve_target  # lazy: imports torch

    target_dir = resolve_target(cfg.target)
    tok = load_tokenizer(target_dir)
    try:
        check_template(tok)
    except DataError as e:
        raise GateFailure("sample", str(e)) from None
    records = load_records(cfg.data, cfg.scan_records)  # before the model: a bad file fails at once
    if not records:
        raise InputError(f"--data {cfg.data}: no records in it (empty)")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    eos = eos_ids(model, tok)
    runner = TargetRunner(model)
    reasons = {}
    # a few tokens more than served, so the draft is also trained where the engine's last
    # verification step drafts past the served length
    gen_len = cfg.response_tokens + cfg.k + 1
    for idx, rec in enumerate(records):
        try:
            user = next((m["content"] for m in to_messages(rec) if m["role"] == "user" and m["content"].strip()), None)
        except DataError:
            reasons["bad record"] = reasons.get("bad record", 0) + 1
            continue
        if user is None:
            continue
        prompt_msgs = [{"role": "user", "content": user}]
        prompt = render(tok, prompt_msgs)
        if len(prompt) > cfg.max_prompt_tokens:
            reasons["prompt too long"] = reasons.get("prompt too long", 0) + 1
            continue
        response, _ = speculative_generate(runner, Proposer(), prompt, gen_len, eos)
        ended = response[-1] in eos
        if len(response) < cfg.response_tokens:
            reasons["response ends early"] = reasons.get("response ends early", 0) + 1
            continue
        text = tok.decode(response[:-1] if ended else response, skip_special_tokens=False)
        messages = prompt_msgs + [{"role": "assistant", "content": text}]
        ex = tokenize_chat(tok, messages, cfg.max_len)
        body = response[:-1] if ended else response
        # round trip: the rendered conversation must hold exactly the prompt and the greedy tokens
        if ex is None or ex.input_ids[: len(prompt) + len(body)] != prompt + body:
            reasons["tokenizer round trip"] = reasons.get("tokenizer round trip", 0) + 1
            continue
        if len(ex.input_ids) > cfg.max_len:
            reasons["too long"] = reasons.get("too long", 0) + 1
            continue
        trainable = sum(ex.loss_mask[2:])
        if trainable < cfg.min_trainable:
            reasons["too few trainable tokens"] = reasons.get("too few trainable tokens", 0) + 1
            continue
        sample = {
            "source": {"data": cfg.data, "record_index": idx, "id": rec.get("id")},
            "target": str(target_dir),
            "messages": messages,
            "prompt_ids": prompt,
            "prompt_text": tok.decode(prompt),
            "greedy_ids": response,
            "served_tokens": cfg.response_tokens,
            "train_ids": ex.input_ids,
            "trainable_tokens": trainable,
            "eos_ids": eos,
        }
        (out / "sample.json").write_text(json.dumps(sample, indent=1))
        with open(out / "train.jsonl", "w") as f:
            f.write(json.dumps({"messages": messages}) + "\n")
        log(
            f"stage 1 sample: record {idx}, prompt {len(prompt)} tokens, {len(ex.input_ids)} in all, "
            f"{trainable} trainable -> {out / 'sample.json'}"
        )
        return sample
    raise GateFailure("sample", f"no valid sample in the first {cfg.scan_records} records of {cfg.data}: {reasons}")


# ---------------------------------------------------------------- stage 2
def overfit(cfg: GateConfig, out: Path, sample: dict) -> tuple[Path, dict]:
    from models.families import FAMILIES  # lazy: imports torch (seconds); gate.py --help runs without it

    run = out / "train"
    ttt = max(cfg.k, 1)
    base = [
        sys.executable,
        str(ROOT / "train.py"),
        "--target",
        sample["target"],
        "--data",
        str(out / "train.jsonl"),
        "--num-records",
        "1",
        "--holdout",
        "0",
        "--max-len",
        str(cfg.max_len),
        "--batch-size",
        "1",
        "--ttt-length",
        str(ttt),
        "--steps",
        str(cfg.max_steps),
        "--stop-after",
        str(cfg.chunk),
        "--lr",
        str(cfg.lr),
        "--warmup",
        "5",
        "--out",
        str(run),
        "--no-progress",
        "--device",
        "cpu",
        "--strategy",
        cfg.strategy,
        *cfg.train_args,
    ]
    reads = FAMILIES[cfg.strategy].options  # pass only the options this family reads (train.py refuses the others)
    base += ["--draft-vocab-size", str(cfg.draft_vocab_size)] if "draft_vocab_size" in reads else []
    base += ["--num-anchors", "1024"] if "num_anchors" in reads else []  # block drafters: a block at every anchor
    if run.exists():
        shutil.rmtree(run)
    step, last = 0, None
    t0 = time.time()
    while step < cfg.max_steps:
        cmd = base + (["--resume"] if step else [])
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        with open(out / "train.log", "a") as f:
            f.write(p.stdout + p.stderr)
        if p.returncode != 0:
            tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
            raise GateFailure("overfit", f"train.py exited {p.returncode}: " + " | ".join(tail))
        rows = [json.loads(x) for x in open(run / "metrics.jsonl")]
        train_rows = [r for r in rows if r.get("split") == "train"]
        last = train_rows[-1]
        step = last["step"]
        losses = [last[f"loss_{k}"] for k in range(cfg.k)]
        accs = [last[f"acc_{k}"] for k in range(cfg.k)]
        log(
            f"stage 2 step {step}: loss_k {[round(x, 3) for x in losses]} acc_k {[round(x, 3) for x in accs]} "
            f"({time.time() - t0:.0f}s)"
        )
        if max(losses) <= cfg.max_loss and min(accs) >= cfg.min_acc:
            break
    else:
        raise GateFailure(
            "overfit",
            f"thresholds not met after {cfg.max_steps} steps (loss_k <= {cfg.max_loss}, acc_k >= {cfg.min_acc} "
            f"for k < {cfg.k}); "
            f"last: {json.dumps({k: round(v, 4) for k, v in last.items() if k[:4] in ('loss', 'acc_')})}",
        )
    from export import find_checkpoint  # lazy: an entry script importing torch (seconds), not for --help

    ckpt = find_checkpoint(run)
    return ckpt, {
        "steps": step,
        "seconds": round(time.time() - t0, 1),
        "final": {k: v for k, v in last.items() if k[:4] in ("loss", "acc_")},
    }


# ---------------------------------------------------------------- stage 3
def vllm_venv(cfg: GateConfig) -> Path:
    return vllm_spec.DEFAULT_VENV if not cfg.vllm_venv else ROOT / cfg.vllm_venv  # ROOT / an absolute path: that path


def run_vllm(cfg: GateConfig, target: str, draft: Path, prompt: list[int], max_tokens: int, out: Path) -> dict:
    from export import ExportError, vllm_method  # lazy: an entry script importing torch (seconds)
    from models.target import target_context  # lazy: imports torch (seconds); gate.py --help runs without it

    venv = vllm_venv(cfg)

    try:
        method, extra = vllm_method(cfg.strategy)
    except ExportError as e:
        raise GateFailure("serve", str(e)) from None
    job = {
        "target": target,
        "draft": str(draft),
        "k": cfg.k,
        "prompts": [prompt],
        "max_tokens": max_tokens,
        "dtype": "float32",
        "max_model_len": min(1024, target_context(Path(target)) or 1024),  # vLLM refuses more than the target's context
        "method": method,
        "speculative_extra": extra,
    }
    try:
        vllm_spec.ensure_venv(venv, log)
        log(
            f"stage 3 vLLM: serving the draft (K={cfg.k}; the engine's start takes minutes on a CPU), "
            f"log {out / 'vllm.log'}"
        )
        return vllm_spec.run_job(job, venv, cfg.vllm_timeout, out / "vllm.log")
    except vllm_spec.VllmError as e:
        raise GateFailure("serve", str(e)) from None


def serve_check(cfg: GateConfig, out: Path, sample: dict, ckpt: Path) -> dict:
    import torch  # lazy: torch, transformers and what imports them stay out of gate.py --help (seconds)
    from transformers import AutoModelForCausalLM  # lazy: as torch

    from core.speculative import TargetRunner, proposer_for, speculative_generate  # lazy: imports torch
    from export import ExportError, export, load_exported, target_mismatch  # lazy: an entry script importing torch
    from models.proposer import Proposer  # lazy: imports torch
    from models.target import load_tokenizer  # lazy: imports torch

    shipped = (ckpt / "model.safetensors").exists()  # a serving dir: served as it is
    serving = ckpt if shipped else out / "export-vllm"
    try:
        if not shipped:
            export(ckpt, serving, engine="vllm", dtype=cfg.export_dtype, target=sample["target"])
        draft, served_cfg = load_exported(serving)
    except (ExportError, FileNotFoundError) as e:
        raise GateFailure("export", str(e)) from None
    target_cfg = json.loads((Path(sample["target"]) / "config.json").read_text())
    if why := target_mismatch(
        draft.config, target_cfg, load_tokenizer(Path(sample["target"])), served_cfg.get("nanospec_export")
    ):
        raise GateFailure("export", f"{serving} does not fit target {sample['target']}: {'; '.join(why)}")
    log(f"stage 3 {'serving' if shipped else 'exported'} {ckpt}" + ("" if shipped else f" -> {serving}"))
    model = AutoModelForCausalLM.from_pretrained(sample["target"], dtype=torch.float32).eval()
    prompt, n = sample["prompt_ids"], sample["served_tokens"]
    runner = TargetRunner(model, draft.config.aux_layers)
    ref, _ = speculative_generate(runner, Proposer(), prompt, n, sample["eos_ids"])
    ours, st = speculative_generate(runner, proposer_for(draft, model, depth=cfg.k), prompt, n, sample["eos_ids"])
    ours_tau = st.summary()["tau"]
    log(
        f"stage 3 PyTorch: tau {ours_tau:.3f} (K={cfg.k}), "
        f"per position {[round(x, 2) for x in st.summary()['acceptance_per_pos']]}"
    )
    if ours != ref:
        raise GateFailure("serve", "PyTorch speculative decoding does not reproduce greedy decoding")
    t0 = time.time()
    res = run_vllm(cfg, sample["target"], serving, prompt, n, out)
    m = res["metrics"]
    drafts = max(m["num_drafts"], 1)
    tau = 1 + m["num_accepted_tokens"] / drafts
    per_pos = [a / drafts for a in m["accepted_per_pos"]]
    served = res["outputs"][0]
    log(
        f"stage 3 vLLM {res['vllm_version']}: tau {tau:.3f}, per position {[round(x, 2) for x in per_pos]}, "
        f"{m['num_drafts']} drafts ({time.time() - t0:.0f}s)"
    )
    report = {
        "vllm_tau": tau,
        "vllm_acceptance_per_pos": per_pos,
        "vllm_metrics": m,
        "pytorch_tau": ours_tau,
        "pytorch_acceptance_per_pos": st.summary()["acceptance_per_pos"],
        "served_equals_greedy": served == ref[: len(served)] and len(served) == len(ref),
    }
    if m["num_drafts"] == 0:
        raise GateFailure("serve", "vLLM proposed no drafts: speculative decoding is not active")
    if tau - 1 < cfg.min_accept * cfg.k:
        raise GateFailure(
            "serve",
            f"vLLM accepted {tau - 1:.2f} drafts per step < {cfg.min_accept} x K={cfg.k} "
            f"(tau {tau:.3f}; PyTorch tau {ours_tau:.3f}): the draft does not reproduce the sample it was overfit on",
        )
    if abs(tau - ours_tau) > cfg.max_tau_gap * ours_tau:
        raise GateFailure(
            "serve",
            f"vLLM tau {tau:.3f} disagrees with PyTorch tau {ours_tau:.3f} on the same draft and prompt: "
            "a train/serve convention differs",
        )
    if not report["served_equals_greedy"]:
        i = next((j for j, (a, b) in enumerate(zip(served, ref)) if a != b), min(len(served), len(ref)))
        raise GateFailure(
            "serve",
            f"vLLM output differs from the target's greedy output at token {i} ({len(served)} vs {len(ref)} tokens)",
        )
    return report


def main(cfg: GateConfig) -> int:
    from core.runlog import output_kind  # lazy: imports torch (seconds); gate.py --help runs without it

    out = Path(cfg.out)
    if why := out_problem(out):  # nowhere to write gate.json either: the line alone
        print(f"error: {why}", file=sys.stderr, flush=True)
        return 1
    t0 = time.time()
    report = {"config": asdict(cfg), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        check_options(cfg)
        if kind := output_kind(cfg.target):
            raise InputError(f"--target {cfg.target} is {kind}, not a target model (a Hugging Face model dir, a .gguf)")
        if kind := output_kind(cfg.data):  # a checkpoint or an export was read as records: 'no valid sample'
            raise InputError(f"--data {cfg.data} is {kind}, not chats (a ShareGPT/messages JSON or JSONL)")
        check_draft_vocab(cfg)
        if cfg.ckpt:
            ckpt = Path(cfg.ckpt)
            sample = load_sample(Path(cfg.sample)) if cfg.sample else None
            check_ckpt(ckpt)
            if sample is None and (ckpt / "model.safetensors").exists():
                sample = select_sample(cfg, out)
            elif sample is None:
                raise InputError(
                    f"--ckpt {ckpt}: a training run or checkpoint needs --sample (the gate run's sample.json)"
                )
        else:
            sample = select_sample(cfg, out)
            ckpt, report["overfit"] = overfit(cfg, out, sample)
            log(f"stage 2 reached the thresholds at step {report['overfit']['steps']}: checkpoint {ckpt}")
        report["checkpoint"] = str(ckpt)
        report["serve"] = serve_check(cfg, out, sample, ckpt)
    except GateFailure as e:
        report.update(passed=False, failed_stage=e.stage, reason=e.why, seconds=round(time.time() - t0, 1))
        (out / "gate.json").write_text(json.dumps(report, indent=1))
        print(f"GATE FAILED at {e.stage}: {e.why}", file=sys.stderr, flush=True)
        return 1
    except (InputError, DataError, FileNotFoundError) as e:  # the gate never judged a draft: no verdict
        # (DataError: TargetError too, a broken target dir or file)
        report.update(passed=False, failed_stage="input", reason=str(e), seconds=round(time.time() - t0, 1))
        (out / "gate.json").write_text(json.dumps(report, indent=1))
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    report.update(passed=True, seconds=round(time.time() - t0, 1))
    (out / "gate.json").write_text(json.dumps(report, indent=1))
    s = report["serve"]
    print(
        f"GATE PASSED in {report['seconds']:.0f}s: vLLM tau {s['vllm_tau']:.3f} "
        f"(PyTorch {s['pytorch_tau']:.3f}, K={cfg.k}), served text == target greedy; report {out / 'gate.json'}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(GateConfig)))
