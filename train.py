"""Train a speculative-decoding draft for a frozen target.

    torchrun --nproc_per_node=N train.py --strategy eagle3 [--target DIR|FILE.gguf] [--data FILE] ...
    torchrun ... train.py --target DIR --features STORE ...   # offline: features from `capture.py features`

With no arguments it trains an EAGLE-3 draft for the packaged SmolLM2-135M-Instruct on the
packaged ShareGPT chats (CPU: fp32; GPU: bf16). Each run writes to --out: run.json (config,
versions, git commit, hardware, results), metrics.jsonl, tb/ (TensorBoard) and ckpt/step_N/.

Exit status: 0 finished (or stopped after --stop-after steps, as asked); 75 stopped early with a checkpoint by
--time-limit, a first SIGTERM or a first Ctrl-C (--resume continues it); 1 failed (one `error:` line); 130
interrupted without a checkpoint. run.json's "status" says the same: running | finished | stopped | failed |
interrupted ("running" after the process is gone: it was killed outright).
"""

import dataclasses
import errno
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import torch.distributed as dist
import tyro

from config import DeployConfig, cli
from data.chat import DataError
from data.datasets import (
    DEFAULT_DATA,
    build_examples,
    collate,
    load_records,
    split_holdout,
    tokenize_workers,
)
from data.packing import TokenBatches, bucket_rows, pack, pad_batch_rows, pad_rows, plan_batches
from data.prefetch import Prefetcher
from data.vocab import count_tokens
from disagg.roles import consumer_target
from disagg.roles import main as disagg_main
from distributed import all_sum, barrier, destroy, init_distributed
from features import BACKENDS, batch_features, load_target, open_for_training, pick_backend
from models.families import FAMILIES, FAMILY_OPTIONS
from models.layers import param_count
from models.moe import MoESizeError
from models.target import DEFAULT_TARGET, PACKABLE_ATTENTION, TargetHeads, load_tokenizer, past_context, resolve_target
from optim import MuonAdamW, muon_groups
from runlog import (
    RUN_FILES,
    Heartbeat,
    RunLog,
    Throughput,
    clear_previous_run,
    compiled_graphs,
    output_kind,
    peak_flops,
    previous_run,
    run_metadata,
    write_checkpoint,
)
from tools.vllm_features import vllm_target

STARTED = time.monotonic()  # --time-limit counts from here: start-up (data, target, compile) included
# The exit status of a run stopped early with a checkpoint (a first SIGTERM or Ctrl-C, --time-limit): not
# finished, `--resume` continues it. 75 is sysexits.h's EX_TEMPFAIL ("try again later"), apart from 0
# (finished, or stopped after --stop-after steps as asked) and 1 (failed: an `error:` line or a traceback).
EXIT_STOPPED = 75
EXIT_INTERRUPTED = 130  # Ctrl-C before training started, or a second one: no checkpoint of this invocation
MAX_MOE_EXPERTS = 256
MAX_PROCESSES = 1024  # --producers, --consumer-ranks: processes the disaggregated launcher starts on one host
QUIET_S = 60.0  # a run with no step or evaluation batch done for this long says so (runlog.Heartbeat)


@dataclass
class TrainConfig:
    strategy: str = "eagle3"
    """draft family to train: eagle3 | peagle | dflash | domino | dspark (models/families.py)"""
    target: str = DEFAULT_TARGET
    """HF causal-LM directory, a .gguf file, or 'smollm2' (the packaged SmolLM2-135M-Instruct)"""
    data: str = DEFAULT_DATA
    """'sharegpt-greedy' (default: packaged chats answered greedily by SmolLM2 itself, 16,808), 'sharegpt-regen'
    (3,390 answered by SmolLM2 at temperature 0.8), 'sharegpt' (the original answers), or a ShareGPT/messages-style
    .json/.jsonl(.gz)/.parquet file or directory"""
    features: str = ""
    """offline: train from a FeatureStore written by `capture.py features` (no target forward; only the
    target's embeddings and lm_head are loaded; the samples, hence --data/--num-records/--max-len, are the store's)"""
    num_records: int = 1200
    """records read from the data (0 = all)"""
    holdout: int = 32
    """examples held out for the final evaluation"""
    max_len: int = 384
    """tokens per conversation; longer ones are truncated"""
    draft_vocab_size: int = 8192
    ttt_length: int = 7
    """drafted tokens K trained per position: TTT steps (eagle3), parallel depths (peagle), block
    predictions (dflash/domino: blocks of K+1 after the clean anchor; dspark: blocks of K)"""
    objective: str = "auto"
    """eagle3: kl (default) | lk-alpha | lk-lambda (LK losses) | tv | rkl | jsd (per-row divergences, as in
    speculators; models/eagle3.py); peagle: kl; dflash: ce (default, per-slot hard CE) |
    dpace (slots reweighted by detached prefix-acceptance estimates); domino: ce; dspark: ce-l1-conf"""
    fc_norm: bool = False
    """EAGLE-3.1 (eagle3/peagle): one RMSNorm per aux source before fc"""
    norm_output: bool = False
    """EAGLE-3.1 (eagle3/peagle): carry the normed layer output to the next step"""
    moe_experts: int = 0
    """eagle3: the draft MLP as a mixture of this many experts, top-k routed (0 = dense; models/moe.py MoEMLP)"""
    moe_top_k: int = 1
    moe_shared: bool = False
    """add one always-on shared expert"""
    moe_mode: str = "flops"
    """flops: the experts a token runs add up to the dense intermediate size (same active FLOPs); params: all
    experts together do (same parameter count)"""
    moe_aux_coef: float = 0.01
    """weight of the Switch-Transformer load-balancing loss"""
    draft_layers: int = 1
    """decoder layers of the block drafters (dflash/domino/dspark)"""
    num_anchors: int = 32
    """blocks per sequence (dflash/domino/dspark): random anchors on assistant tokens"""
    loss_decay: float = 0.0
    """dflash/domino: weight exp(-(k-1)/gamma) on block slot k (0 = none); dspark always uses gamma 4"""
    aux_layers: tuple[int, ...] = ()
    """target layers whose outputs feed the draft (default [1, L//2-1, L-4])"""
    batch_size: int = 4
    """global batch in sequences (split over ranks)"""
    batch_tokens: int = -1
    """a token budget instead of --batch-size: every step is batch_tokens // max_len packed rows of --max-len,
    filled first-fit with whole conversations of the shuffled data (data/packing.TokenBatches): one row count
    (one compiled shape, no rows of padding) and rows nearly full; needs packing; 0 = --batch-size conversations;
    -1 (auto) = --batch-size x --max-len on a GPU where rows are packed (the same step shape every step: nothing
    recompiles after warm-up; packed conversations vary the row count), else --batch-size conversations"""
    steps: int = 80
    """optimizer steps (0 = one epoch)"""
    lr: float = 3e-3
    optimizer: str = "adamw"
    """adamw, or muon: Muon on the draft's hidden matrices and AdamW on its head and vectors (optim.py;
    the update is scaled to AdamW's RMS, so --lr and --weight-decay keep their meaning)"""
    warmup: int = 8
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    out: str = "runs/eagle3"
    """run directory: run.json, metrics.jsonl, tb/, ckpt/step_N/"""
    resume: bool = False
    """continue from the latest checkpoint in --out (an earlier intact one if the latest is damaged)"""
    init_draft: str = ""
    """start the draft from this checkpoint's weights (a run dir or ckpt/step_N, e.g. one that `export.py
    --import-from` wrote); optimizer and schedule start fresh; the draft these flags build must have its config"""
    overwrite: bool = False
    """replace the previous run in --out (its run.json, metrics.jsonl, tb/ and ckpt/ are deleted once the new run
    has loaded its model and data); without it (or --resume) train.py refuses an --out that holds a run"""
    stop_after: int = 0
    """stop (with a checkpoint) after this many steps of this invocation; the schedule still spans --steps.
    Exit status 0: it stopped where it was told to"""
    time_limit: float = 0.0
    """stop the same way once this invocation has run this many seconds (0 = no limit), for a job with a
    wall-clock limit; a first SIGTERM (a scheduler's, or `timeout`'s) or Ctrl-C stops it so too, after the
    current step (a second one stops it at once, without a checkpoint). A run stopped so exits 75 (0: finished,
    1: failed; 130: Ctrl-C before training) and its run.json says "status": "stopped" and the cause in
    results.stopped_by; --resume continues it"""
    ckpt_every: int = 0
    """save every N steps (0 = only at the end)"""
    log_every: int = 1
    eval_every: int = 0
    """evaluate the held-out split every N steps (0 = at start and end only)"""
    eval_at_start: bool = True
    """evaluate the untrained draft before the first step (its figures are the baseline of the run's curve)"""
    eval_batch_size: int = 8
    attention: str = "auto"
    """eagle3's TTT attention: eager (reference) | lse (fused causal + diagonal, CPU/GPU) | flex (GPU;
    FlexAttention, K/V concatenated each step) | flex_buf (GPU; K/V written once into buffers: more memory,
    BENCHMARKS.md); auto = flex on GPU, lse on CPU. peagle, dflash, domino, dspark: eager (dense masks) |
    flex (GPU); auto = flex on GPU, eager on CPU"""
    loss: str = "auto"
    """eagle3's head + loss: torch (reference) | triton (in-place CE) | fused (chunked linear+CE); auto = triton
    on GPU (fastest end-to-end step on the H200, see BENCHMARKS.md), torch on CPU; the other families compute
    their own (none reads --loss)"""
    device: str = "auto"
    """auto | cpu | cuda"""
    backend: str = "auto"
    """target forward: hf (transformers, any model; the reference) | compiled (models/fast_target.py: Llama,
    Qwen2/3, Qwen3-MoE; layers torch.compile'd on GPU) | vllm (a vLLM engine in its own venv, NANOSPEC_VLLM_VENV
    or .venv-vllm; tools/vllm_features.py; online training and the disaggregated producers) | auto = compiled on a
    GPU where it builds the target's architecture (else hf, saying why), hf on CPU (compiling pays only on a GPU;
    hf is the reference)"""
    pad_to_max_len: bool = False
    """pad every batch to --max-len (rounded up to 128): flex then compiles one shape per TTT step instead
    of one per (length bucket, step); worth it on a GPU where small steps are launch-bound (--compile implies it)"""
    pack: str = "auto"
    """several conversations per row of --max-len (data/packing.py; document boundaries kept everywhere, --batch-size
    still counts conversations): auto = on where the family and target backend keep documents apart (eagle3, incl.
    EAGLE-3.1 / LK / MoE, peagle, dflash, domino, dspark; with the hf (sdpa/eager) or compiled target, online or
    offline; --compile on CPU), off where they cannot (--compile or lse on GPU, other HF attention) | on = refuse
    to run there | off = one conversation per row"""
    pack_row_multiple: int = 0
    """packed batches get rows of padding up to a multiple of this many rows (1: none); 0 = on a GPU up to the
    next of four row counts per octave (8, 10, 12, 14, 16, 20, ...; data/packing.py bucket_rows), none on CPU:
    on a GPU each new row count compiles flex and the target anew"""
    compile: bool = False
    """compile the draft step (TTT forward + loss + backward) as a unit; batches are padded to --max-len so
    shapes repeat (with several ranks the FSDP2-wrapped draft is compiled: one graph, its hooks stay eager)"""
    tp: int = 1
    """tensor-parallel size of the compiled target: torchrun ranks [d*tp, (d+1)*tp) run it together on one batch
    (dp = world/tp data-parallel groups); the draft stays FSDP2 over all ranks"""
    progress: bool = True
    """progress bars (tokenizing, evaluation, training) on rank 0"""
    config: str = ""
    """YAML file with any of these options (underscored names; deployment ones under `deploy:` or at top level);
    flags given with it override it (config.py)"""
    deploy: Annotated[DeployConfig, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=DeployConfig)
    """disaggregated online training: producer and consumer pools (disagg/)"""


class ConfigError(ValueError):
    """A bad option value or --out; reported as one line, before the model and data are loaded."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read back."""


def validate(cfg: TrainConfig, world: int | None = None):
    """Option values that cannot work, as one message each, before anything is loaded or written.
    world: the ranks that split --batch-size (default: torchrun's WORLD_SIZE, or the launcher's consumer ranks)."""
    if world is None:
        world = (
            cfg.deploy.consumer_ranks
            if (cfg.deploy.producers and not cfg.deploy.role)
            else int(os.environ.get("WORLD_SIZE", 1))
        )
    at_least = {
        "batch_size": 1,
        "eval_batch_size": 1,
        "log_every": 1,
        "ttt_length": 1,
        "draft_vocab_size": 1,
        "draft_layers": 1,
        "num_anchors": 1,
        "moe_top_k": 1,
        "tp": 1,
        "max_len": 2,
        "steps": 0,
        "num_records": 0,
        "holdout": 0,
        "warmup": 0,
        "stop_after": 0,
        "ckpt_every": 0,
        "eval_every": 0,
        "moe_experts": 0,
        "pack_row_multiple": 0,
    }
    for name, low in at_least.items():
        v = getattr(cfg, name)
        if v < low:
            hint = {"steps": " (0 = one epoch)", "num_records": " (0 = all)"}.get(name, "")
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {low}{hint}, got {v}")
    floats = {  # name: (lowest, lowest allowed itself, highest)
        "lr": (0.0, False, math.inf),
        "min_lr_ratio": (0.0, True, 1.0),
        "weight_decay": (0.0, True, math.inf),
        "grad_clip": (0.0, False, math.inf),
        "moe_aux_coef": (0.0, True, math.inf),
        "loss_decay": (0.0, True, math.inf),
        "time_limit": (0.0, True, math.inf),
    }
    for name, (low, closed, high) in floats.items():
        v = getattr(cfg, name)
        if not math.isfinite(v) or v < low or (v == low and not closed) or v > high:
            rng = f"{'[' if closed else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number in {rng}, got {v}")
    if len(set(cfg.aux_layers)) != len(cfg.aux_layers) or any(i < 0 for i in cfg.aux_layers):
        raise ConfigError(f"--aux-layers {' '.join(map(str, cfg.aux_layers))}: distinct layer indices, 0 or more")
    if cfg.ttt_length >= cfg.max_len:  # step k predicts k + 1 tokens ahead: beyond the row, no target at all
        raise ConfigError(
            f"--ttt-length {cfg.ttt_length} needs rows longer than it: at --max-len {cfg.max_len} TTT steps "
            f"{cfg.max_len - 1} and later have no target token (use --ttt-length {cfg.max_len - 1} or less)"
        )
    if cfg.moe_experts and cfg.moe_top_k > cfg.moe_experts:
        raise ConfigError(f"--moe-top-k {cfg.moe_top_k} is more than --moe-experts {cfg.moe_experts}")
    if cfg.tp > 1 and (world % cfg.tp or cfg.backend not in ("auto", "compiled") or cfg.features or cfg.deploy.role):
        raise ConfigError(  # (was a SystemExit without 'error: ' once the target had loaded; Trainer checks it too)
            f"--tp {cfg.tp} must divide the number of ranks ({world}) and needs --backend compiled "
            "with an online target (no --features, no disaggregated roles)"
        )
    check_deploy(cfg.deploy)
    if cfg.moe_experts > MAX_MOE_EXPERTS:  # 10**12 was a traceback from the allocator once the target had loaded
        raise ConfigError(
            f"--moe-experts {cfg.moe_experts}: at most {MAX_MOE_EXPERTS} (every expert runs on every token in training,"
            " models/moe.py: E experts cost E MLPs)"
        )
    if not cfg.moe_experts and "moe_experts" in getattr(FAMILIES.get(cfg.strategy), "options", ()):
        for name, dense in (("moe_top_k", 1), ("moe_shared", False), ("moe_mode", "flops"), ("moe_aux_coef", 0.01)):
            if getattr(cfg, name) != dense:  # the dense MLP reads none of them: they were ignored
                raise ConfigError(
                    f"--{name.replace('_', '-')} applies to a mixture-of-experts draft: pass --moe-experts N too "
                    "(0, the default, is the dense MLP, which reads no --moe-* option)"
                )
    if cfg.optimizer not in ("adamw", "muon"):
        raise ConfigError(f"--optimizer must be adamw or muon, got {cfg.optimizer!r}")
    if cfg.moe_mode not in ("flops", "params"):
        raise ConfigError(f"--moe-mode must be flops or params, got {cfg.moe_mode!r}")
    if world % cfg.tp == 0 and cfg.batch_size % (world // cfg.tp):
        raise ConfigError(
            f"--batch-size {cfg.batch_size} is the global batch: it must split evenly over the {world // cfg.tp} "
            "data-parallel ranks"
        )
    rows = cfg.batch_tokens // cfg.max_len if cfg.batch_tokens > 0 else cfg.batch_size
    if cfg.pack_row_multiple > max(rows, 1):  # 10**12 was an allocator traceback: a batch padded to that many rows
        raise ConfigError(
            f"--pack-row-multiple {cfg.pack_row_multiple} is more rows than a batch holds ({rows}): every batch would "
            f"be padded to {cfg.pack_row_multiple} rows, nearly all of them padding"
        )
    if cfg.batch_tokens < -1 or 0 < cfg.batch_tokens < cfg.max_len:
        raise ConfigError(
            f"--batch-tokens {cfg.batch_tokens}: -1 (auto), 0 (--batch-size conversations), or at least one row of "
            f"--max-len {cfg.max_len}"
        )
    if cfg.batch_tokens > 0 and world % cfg.tp == 0 and (cfg.batch_tokens // cfg.max_len) % (world // cfg.tp):
        raise ConfigError(
            f"--batch-tokens {cfg.batch_tokens} gives {cfg.batch_tokens // cfg.max_len} rows of --max-len {cfg.max_len}"
            f" a step: they must split evenly over the {world // cfg.tp} data-parallel ranks"
        )
    if cfg.resume and cfg.init_draft:
        raise ConfigError("--resume continues the run in --out with its own weights; --init-draft starts a new one")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    if cfg.pack not in ("auto", "on", "off"):
        raise ConfigError(f"--pack must be auto, on or off, got {cfg.pack!r}")
    if cfg.strategy not in FAMILIES:
        raise ConfigError(f"unknown strategy {cfg.strategy!r}: choose one of {', '.join(FAMILIES)}")
    default = TrainConfig()
    for name in sorted(
        FAMILY_OPTIONS - FAMILIES[cfg.strategy].options
    ):  # an option another family reads: refused, never ignored
        if getattr(cfg, name) != getattr(default, name):
            users = ", ".join(n for n, f in FAMILIES.items() if name in f.options)
            raise ConfigError(f"--{name.replace('_', '-')} applies to --strategy {users}, not {cfg.strategy}")
    family = FAMILIES[cfg.strategy]
    for name, field in (("attention", "attentions"), ("loss", "losses")):  # read by some families only
        given, values = getattr(cfg, name), getattr(family, field)
        if given == "auto" or given in values:
            continue
        users = ", ".join(n for n, f in FAMILIES.items() if given in getattr(f, field))
        takes = f"it takes auto, {', '.join(values)}" if values else "it reads no --" + name
        if users:  # e.g. --loss triton or --attention lse for dflash: refused, never ignored
            raise ConfigError(f"--{name} {given} applies to --strategy {users}, not {cfg.strategy} ({takes})")
        raise ConfigError(f"--{name} {given!r} is no {name} of any family; for --strategy {cfg.strategy} {takes}")


def check_deploy(d: DeployConfig):
    """The disaggregated options (disagg/): values that cannot work (--producers -1 was a ZeroDivisionError, 10**12
    started processes until killed), and any of them given without --producers or --role, where the target runs in
    this process and none of them is read (they were ignored without a word)."""
    for name, low, high in (
        ("producers", 0, MAX_PROCESSES),  # the launcher starts every producer and consumer rank on this host
        ("consumer_ranks", 1, MAX_PROCESSES),
        ("lease_size", 0, None),
        ("high_watermark", 0, None),
        ("low_watermark", 0, None),
        ("max_attempts", 1, None),
    ):
        v = getattr(d, name)
        if v < low or (high is not None and v > high):
            most = f" and at most {high} (the launcher starts them all on this host)" if high else ""
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {low}{most}, got {v}")
    for name in ("heartbeat", "lease_timeout", "producer_timeout"):
        if not (math.isfinite(v := getattr(d, name)) and v > 0):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number of seconds above 0, got {v}")
    if not d.producers and not d.role:
        default = DeployConfig()
        for f in dataclasses.fields(d):
            if getattr(d, f.name) != getattr(default, f.name):
                raise ConfigError(
                    f"--{f.name.replace('_', '-')} applies to disaggregated training (--producers N, or --role for one "
                    "pool member): without them the target runs in this process and reads no deployment option"
                )


def auto_batch_tokens(cfg: TrainConfig, kind: str, pack: bool) -> int:
    """--batch-tokens as the run uses it: -1 (auto) is --batch-size rows of --max-len on a GPU with packed rows
    (one step shape: the compiled target and flex compile once; packed conversations vary the row count and
    recompile), else 0 (--batch-size conversations). Disaggregated runs keep -1, which means conversations
    there: the producers lay out the plan before any packing is decided, and their fingerprint carries it."""
    if cfg.batch_tokens != -1 or cfg.deploy.role or cfg.deploy.producers:
        return cfg.batch_tokens
    return cfg.batch_size * cfg.max_len if kind == "cuda" and pack else 0


def packing_blocker(cfg: TrainConfig, family, kind: str, attn_impl: str | None) -> str | None:
    """Why this run cannot pack rows without mixing documents (None: it can). attn_impl: the HF
    target's attention implementation (None for the compiled target or stored features)."""
    if not family.packs:
        packing = ", ".join(n for n, s in FAMILIES.items() if s.packs)
        return (
            f"--strategy {cfg.strategy} does not keep packed documents apart in its masks yet "
            f"(families that pack: {packing})"
        )
    # correct on CPU inductor (tests/test_packing.py). On the H200 (2026-12-01) its first step never finished:
    # each new row count recompiled flex, each compile slowed by the document mask's key-index gather (both
    # fixed since: kernels/masks.ttt_document_mask, data/packing.pad_batch_rows; experiments/results/
    # pack_probe_h200/). Refused there until it is measured at speed;
    # NANOSPEC_TRY_PACK_COMPILE=1 lets experiments/pack_probe.sh run it
    if cfg.compile and kind == "cuda" and not os.environ.get("NANOSPEC_TRY_PACK_COMPILE"):
        return (
            "--compile with packed rows on a GPU is not yet measured at speed (on the H200 its first step did "
            "not finish; experiments/results/pack_probe_h200/README.md); --compile runs one conversation per row "
            "there"
        )
    if kind == "cuda" and cfg.attention == "lse":
        return "--attention lse has no document mask on the GPU (its fused CUDA kernel takes none): use flex"
    if attn_impl is not None and attn_impl not in PACKABLE_ATTENTION:
        return f"the hf target runs {attn_impl!r} attention; packed rows need one of {PACKABLE_ATTENTION} (a 4D mask)"
    return None


def _first_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoint dirs of `out`, the one ckpt/latest names first, then the others newest first."""
    ck = out / "ckpt"
    if not ck.is_dir():
        return []
    steps = sorted(
        (d for d in ck.glob("step_*") if d.is_dir() and d.name[5:].isdigit()), key=lambda d: -int(d.name[5:])
    )
    latest = ck / "latest"
    try:
        named = ck / latest.read_text().strip() if latest.exists() else None
    except OSError:
        named = None
    return ([named] if named in steps else []) + [d for d in steps if d != named]


def check_inputs(cfg: TrainConfig):
    """Another command's output where an input or --out goes, refused by name before anything loads (runlog.
    output_kind): a draft export as --target was a RuntimeError traceback from transformers, a run written into an
    export or a feature store mixed their files (export.py --out then replaces an export's directory whole)."""
    model = "a Hugging Face causal-LM directory, a .gguf file or 'smollm2'"
    if kind := output_kind(cfg.target):
        raise ConfigError(
            f"--target {cfg.target} is {kind}, not a target model: pass the model the draft is for ({model})"
        )
    if not cfg.features and (kind := output_kind(cfg.data)):
        raise ConfigError(f"--data {cfg.data} is {kind}, not chats: pass a ShareGPT/messages-style file or directory")
    if cfg.features and (kind := output_kind(cfg.features)) and not kind.startswith("a feature store"):
        raise ConfigError(f"--features {cfg.features} is {kind}, not a feature store (capture.py features --out)")
    if cfg.init_draft:
        if not Path(cfg.init_draft).exists():
            raise ConfigError(f"--init-draft {cfg.init_draft}: no such checkpoint or run directory")
        kind = output_kind(cfg.init_draft) or ""
        if kind.startswith(("a draft export", "a draft model")):
            raise ConfigError(
                f"--init-draft {cfg.init_draft} is {kind}; --init-draft takes a training checkpoint or run: make one "
                f"from it with `python export.py --import-from auto {cfg.init_draft} --out RUN`, then --init-draft RUN"
            )
        if kind and not kind.startswith("a training"):
            raise ConfigError(f"--init-draft {cfg.init_draft} is {kind}, not a training checkpoint or run")
    if (kind := output_kind(cfg.out)) and not kind.startswith("a training run"):
        raise ConfigError(
            f"--out {cfg.out} is {kind}: a run written there would mix with its files; give another --out"
        )
    control = Path(cfg.deploy.control)
    if cfg.deploy.control and not cfg.resume and control.is_dir() and not (control / "control.db").exists():
        if found := sorted(p.name for p in control.iterdir()):  # a fresh run deletes its features/ and control.db
            shown = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
            raise ConfigError(
                f"--control {control} holds files of no run's control directory ({shown}): a fresh run deletes the "
                "control.db and features/ it finds there; give a new or empty directory"
            )
    if not cfg.out.strip():  # was the current directory: a run written among the files there
        raise ConfigError("--out is empty: give the run's directory (a new or empty one, e.g. runs/NAME)")
    out = Path(cfg.out)
    if out.is_dir() and not kind and not previous_run(out):  # e.g. the target's folder, `--out .`, `--out runs`
        # a log is allowed: `mkdir runs/x && python train.py --out runs/x > runs/x/train.log` is how runs are logged
        found = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "pipeline")
        found = [n for n in found if not n.endswith(".log")]
        if found:
            shown = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
            raise ConfigError(
                f"--out {out} holds files no run wrote ({shown}): the run ({', '.join(RUN_FILES)}) would be written "
                "among them; give a new or empty directory"
            )


def check_out(cfg: TrainConfig, rank: int = 0):
    """--out before anything is loaded: a directory train.py can write (rank 0 writes), not an earlier run's
    unless --resume or --overwrite, and with a checkpoint for --resume."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    if rank == 0:
        base = _first_existing(out)
        if not base.is_dir():
            raise ConfigError(f"--out {out}: {base} is a file, not a directory")
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=out)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            why = {
                errno.EROFS: "it is on a read-only file system",
                errno.EACCES: "no permission to write there",
                errno.EPERM: "no permission to write there",
                errno.ENOSPC: "no space left on that device",
            }.get(e.errno, e.strerror or str(e))
            raise ConfigError(f"--out {out}: cannot write the run there: {why}") from None
    if cfg.resume:
        if not (ck := checkpoints(out)):
            again = (
                "--overwrite instead of --resume to start it again"
                if previous_run(out)
                else "no --resume to start a run there"
            )
            raise ConfigError(f"--resume: no checkpoint in {out / 'ckpt'} (pass {again})")
        # the run's record is continued, never started over: without a readable run.json, stop (history kept)
        rec, fresh = out / "run.json", f"--init-draft {ck[0]} starts a new run in another --out from its weights"
        try:
            ok = isinstance(json.loads(rec.read_text()), dict)
        except FileNotFoundError:
            raise ConfigError(
                f"--resume: {rec} is missing, so this run's record cannot be continued (metrics.jsonl and the "
                f"checkpoints are left as they are): restore it, or {fresh}"
            ) from None
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"--resume: {rec} is damaged or unreadable ({type(e).__name__}: {e}); nothing was changed: "
                f"restore it, or {fresh}"
            ) from None
        if not ok:
            raise ConfigError(
                f"--resume: {rec} does not hold a run's record (not a JSON object): restore it, or {fresh}"
            )
    elif not cfg.overwrite and (old := previous_run(out)):
        ck = checkpoints(out)
        raise ConfigError(
            f"--out {out} holds a previous run ({', '.join(old)}{f'; checkpoint {ck[0].name}' if ck else ''}): "
            "pass --resume to continue it, --overwrite to replace it, or another --out"
        )


def target_vocab_size(target_dir: Path) -> int | None:
    try:
        c = json.loads((Path(target_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup then cosine down to min_lr_ratio * lr."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


class Trainer:
    def __init__(self, cfg: TrainConfig):
        validate(cfg)
        self.family = FAMILIES[cfg.strategy]
        if cfg.objective == "auto":
            cfg = dataclasses.replace(cfg, objective=self.family.objectives[0])
        if cfg.objective not in self.family.objectives:
            raise ConfigError(
                f"--objective {cfg.objective!r} is not one of {cfg.strategy}'s: {', '.join(self.family.objectives)}"
            )
        if cfg.compile and cfg.objective.startswith("lk"):
            raise ConfigError(
                "--compile with the LK objectives is untested "
                "(their batch-mean acceptance is all-reduced inside the step)"
            )
        if cfg.device not in ("auto", "cpu", "cuda"):  # anything else ran on the CPU without a word
            raise ConfigError(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
        kind = ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
        auto = self.family.auto(kind)
        cfg = dataclasses.replace(cfg, **{k: v for k, v in auto.items() if getattr(cfg, k) == "auto"})
        if kind == "cpu" and cfg.attention.startswith("flex"):
            raise ConfigError(
                "--attention flex has no backward on CPU (torch raises NotImplementedError); use lse or eager"
            )
        if cfg.backend not in ("auto", *BACKENDS):
            raise ConfigError(f"--backend must be auto or one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
        self.cfg = cfg
        self.rank, self.world, local = init_distributed(kind)
        self.device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(self.device)
        # --tp: a (dp, tp) mesh, rank = d*tp + t. Ranks of one tp group (contiguous, so on one host's
        # NVLink) run the target on one batch together: data is split by dp rank, not rank. The draft
        # stays FSDP2 over the whole world: tp peers get identical batches, hence identical gradients,
        # and the global normalisers (summed over all ranks) and FSDP's world average count each tp-fold,
        # which cancels; one sharded copy cannot drift apart as dp-only replicas could under GPU
        # nondeterminism.
        self.dp_rank, self.dp_size, self.tp_mesh = self.rank, self.world, None
        if cfg.tp > 1:
            if self.world % cfg.tp or cfg.backend not in ("auto", "compiled") or cfg.features or cfg.deploy.role:
                raise ConfigError(
                    f"--tp {cfg.tp} must divide the number of ranks ({self.world}) and needs --backend compiled "
                    "with an online target (no --features, no disaggregated roles)"
                )
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(kind, (self.world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
            self.tp_mesh, self.dp_rank, self.dp_size = mesh["tp"], mesh.get_local_rank("dp"), mesh.size(0)
        # bf16 on GPU; fp32 on CPU, where bf16 matmuls are emulated and ~30x slower
        self.dtype = torch.bfloat16 if kind == "cuda" else torch.float32
        torch.manual_seed(cfg.seed)
        self.out = Path(cfg.out)
        self.log = RunLog(self.out, enabled=self.rank == 0)
        self.schedule = 0.0  # fraction of training done (loss schedules, e.g. Domino's curriculum)

        target_dir = resolve_target(cfg.target) if self.rank == 0 else None
        self.barrier()
        target_dir = resolve_target(cfg.target)
        if cfg.backend == "auto":
            backend, why = pick_backend(target_dir, kind)
            if why and not (cfg.features or cfg.deploy.role == "consumer"):  # else no target forward runs here
                self.print(f"[target] --backend hf: {why}")
            self.cfg = cfg = dataclasses.replace(cfg, backend=backend)
            if cfg.tp > 1 and backend == "hf":
                raise SystemExit(
                    f"--tp {cfg.tp} needs the compiled target: {why or 'hf on CPU'}; pass --backend compiled"
                )
        if not cfg.features and (why := past_context(target_dir, cfg.max_len, "--max-len")):  # (a store: its own)
            raise ConfigError(f"{why}: a longer conversation would run the target past it; pass a smaller --max-len")
        V = target_vocab_size(target_dir)
        if self.family.draft_vocab and V and cfg.draft_vocab_size > V:
            raise ConfigError(
                f"--draft-vocab-size {cfg.draft_vocab_size} is larger than the target's vocabulary ({V} tokens in "
                f"{target_dir / 'config.json'}): the draft vocabulary is a subset of the target's"
            )
        self.store = None
        if cfg.features:
            self.store, self._stored, self.target = open_for_training(
                cfg.features, target_dir, cfg.aux_layers, self.dtype, self.device
            )
        elif cfg.deploy.role == "consumer":  # disaggregated: the producers run the target (disagg/roles.py)
            self.target = consumer_target(target_dir, cfg.aux_layers, self.dtype, self.device)
        else:
            aux = list(cfg.aux_layers) or None
            self.target = load_target(
                cfg.backend, target_dir, aux, self.dtype, self.device, cfg.max_len, vllm_target, tp_mesh=self.tp_mesh
            )
            if self.tp_mesh is not None:
                self.print(
                    f"[target] tensor parallel over {self.tp_mesh.size()} ranks, {self.dp_size} data-parallel group(s)"
                )
        self.tokenizer = load_tokenizer(target_dir)
        self.pack = self._packing(kind)
        self.cfg = cfg = self._batching(kind)
        self.row_multiple = cfg.pack_row_multiple or (0 if kind == "cuda" else 1)  # 0: data/packing.bucket_rows
        self._load_data()
        self._build_draft()

    def _packing(self, kind: str) -> bool:
        """--pack auto|on|off -> whether rows are packed; a run that cannot keep documents apart
        refuses --pack on and runs auto unpacked, saying why."""
        attn_impl = getattr(getattr(getattr(self.target, "model", None), "config", None), "_attn_implementation", None)
        why = packing_blocker(self.cfg, self.family, kind, attn_impl)
        if self.cfg.pack == "on" and why:
            raise ConfigError(f"--pack on: {why}; pass --pack off (one conversation per row)")
        if self.cfg.pack == "auto" and why:
            self.print(f"[data] one conversation per row: {why}")
        return self.cfg.pack != "off" and why is None

    def _batching(self, kind: str) -> "TrainConfig":
        """--batch-tokens -1 (auto) resolved for this device (auto_batch_tokens), saying so when it is a budget."""
        cfg = self.cfg
        budget = auto_batch_tokens(cfg, kind, self.pack)
        if budget == cfg.batch_tokens:
            return cfg
        if budget:
            self.print(
                f"[data] batching: --batch-tokens {budget} ({cfg.batch_size} packed rows of --max-len {cfg.max_len}) a "
                f"step, the one shape a GPU compiles once; --batch-tokens 0 batches {cfg.batch_size} conversations"
            )
        return dataclasses.replace(cfg, batch_tokens=budget)

    def barrier(self):
        barrier()

    def print(self, *a):
        if self.rank == 0:
            print(*a, flush=True)

    heartbeat: Heartbeat | None = None  # while train() runs

    def progress(self, what: str):
        """Something finished (a step, an evaluation batch): the heartbeat's quiet clock restarts."""
        if self.heartbeat is not None:
            self.heartbeat.mark(what)

    def bar(self, it, desc: str, total: int | None = None):
        """`it` with a progress bar on rank 0 (--progress), for the minutes before training's own bar."""
        if not (self.cfg.progress and self.rank == 0):
            return it
        from tqdm import tqdm

        return tqdm(it, desc=desc, total=total, dynamic_ncols=True, leave=False)

    def _load_data(self):
        cfg, stats = self.cfg, Counter()
        if cfg.batch_tokens > 0 and not self.pack:  # before minutes of tokenizing
            raise ConfigError(
                "--batch-tokens fills packed rows, and this run is not packed "
                "(--pack off, or the [data] line above says why)"
            )
        if self.store is not None:  # tokenized at capture time, exactly as below
            examples, n_records = self._stored, self.store.schema["data"]["records"]
            stats.update(self.store.schema["data"]["stats"])
        else:
            records = load_records(cfg.data, cfg.num_records or None)
            workers = tokenize_workers(len(records))  # a pool of processes has no per-record bar
            src = records if workers > 1 else self.bar(records, "tokenize")
            examples, n_records = build_examples(src, self.tokenizer, cfg.max_len, stats, workers), len(records)
        try:
            self.train_set, self.eval_set = split_holdout(examples, cfg.holdout)
            # rows of --max-len tokens; a feature store captured at a larger --max-len holds longer conversations,
            # whose rows then grow to the longest (each conversation still fits one row)
            longest = max(len(e.input_ids) for e in [*self.train_set, *self.eval_set])
            self.row_len = max(cfg.max_len, longest)
            self.batches = plan_batches(cfg, self.train_set, self.row_len)
        except DataError as e:  # say why so few examples are left: what was skipped, at which --max-len
            counts = json.dumps(dict(stats, records=n_records))
            raise DataError(
                f"{e}. [data] {cfg.features or cfg.data} at --max-len {cfg.max_len}: {counts} "
                "(skipped_* are conversations dropped: no assistant turn, only empty ones, or nothing trainable "
                "within --max-len; see README 'Training your own draft')"
            ) from None
        self.data_stats = dict(stats, records=n_records, train=len(self.train_set), holdout=len(self.eval_set))
        self.print(f"[data] {cfg.features or cfg.data}: {json.dumps(self.data_stats)}")
        if self.row_len > cfg.max_len:
            self.print(
                f"[data] conversations up to {longest} tokens (> --max-len {cfg.max_len}): rows of {longest} tokens"
            )
        if cfg.batch_tokens > 0:
            self.print(
                f"[data] --batch-tokens {cfg.batch_tokens}: {self.batches.rows} rows of {self.row_len} tokens a step, "
                f"{self.batches.per_epoch} steps an epoch"
            )
        self.total_steps = cfg.steps or self.batches.per_epoch

    def _init_from(self, draft, d: Path):
        """Load --init-draft's tensors (its d2t/t2d too) into the freshly built draft, refusing another config."""
        from safetensors.torch import load_file

        if not (d / "draft.safetensors").exists():
            found = checkpoints(d)
            if not found:
                raise CheckpointError(f"--init-draft {d}: no draft.safetensors and no checkpoint in {d / 'ckpt'}")
            d = found[0]
        try:
            meta = json.loads((d / "config.json").read_text())
            sd = load_file(d / "draft.safetensors")
        except Exception as e:  # missing or damaged file
            raise CheckpointError(f"--init-draft {d}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
        ours = self.draft_config.to_dict()
        differ = sorted(k for k in {*ours, *meta.get("draft", {})} if ours.get(k) != meta.get("draft", {}).get(k))
        if meta.get("strategy") != self.cfg.strategy or differ:
            raise CheckpointError(
                f"--init-draft {d}: a {meta.get('strategy')} draft whose config differs from the {self.cfg.strategy} "
                f"draft these flags build in {differ} (theirs {[meta.get('draft', {}).get(k) for k in differ]}, "
                f"ours {[ours.get(k) for k in differ]})"
            )
        draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
        self.print(f"[draft] initialised from {d}")

    def _build_draft(self):
        cfg, t = self.cfg, self.target
        counts = count_tokens(self.train_set, t.config.vocab_size)
        try:
            draft = self.family.build(cfg, t, counts, self.tokenizer)
        except MoESizeError as e:  # needs the target's MLP size: known only now
            raise ConfigError(f"--moe-experts {cfg.moe_experts} on this target: {e}") from None
        self.draft_config = draft.config
        if cfg.init_draft:
            self._init_from(draft, Path(cfg.init_draft))
        t2d = getattr(draft, "t2d", None)
        vocab = (
            ""
            if t2d is None
            else (
                f", draft vocab {int(t2d.sum())} covers "
                f"{counts[t2d].sum().item() / max(1, counts.sum().item()):.1%} of trained tokens"
            )
        )
        draft.to(self.device)
        self.print(f"[draft] {cfg.strategy}: {param_count(draft) / 1e6:.1f}M params{vocab}")
        if self.world > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
            # ZeRO-2 style: parameters stay gathered between forward and backward
            fully_shard(draft, reshard_after_forward=False, mp_policy=mp)
        elif self.dtype != torch.float32:
            draft.to(self.dtype)
        self.draft = draft
        # the training step compiled as a unit; the Triton CE stays eager (kernels/ce.py), evaluation eager.
        # Several ranks: the FSDP2 module is compiled; dynamo skips FSDP's unshard/reshard hooks (they run
        # eagerly around the one graph, no break), so the gathered parameters are plain inputs to it
        self.draft_step = torch.compile(draft, dynamic=None) if cfg.compile else draft
        if cfg.optimizer == "muon":
            self.opt = MuonAdamW(muon_groups(draft.named_parameters(), cfg.weight_decay), lr=cfg.lr)
        else:
            decay = [p for n, p in draft.named_parameters() if p.ndim >= 2]
            no_decay = [p for n, p in draft.named_parameters() if p.ndim < 2]
            self.opt = torch.optim.AdamW(
                [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                lr=cfg.lr,
                betas=(0.9, 0.95),
                eps=1e-8,
                fused=True if self.device.type == "cuda" and self.world == 1 else None,
            )
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_at(s, cfg, self.total_steps))

    # ---- one batch -> the family's loss ----
    def host_batch(self, examples, key: int = 0, row_sizes: list[int] | None = None, first: int | None = None) -> dict:
        """Everything about a batch that the host knows without the GPU: collated tensors, the
        family's host-side parts (EAGLE-3 on GPU: the trained rows of each TTT step; block
        drafters: anchors), token count, whether anything is padded. Runs on the prefetch thread
        during training. key seeds the family's random draws (the step; eval batches: < 0). row_sizes,
        first: a --batch-tokens step's rows (examples per row, in order) and its examples' global offset."""
        if self.pack:  # + doc_ids, position_ids, where
            b = pack(examples, self.row_len, row_sizes=row_sizes)
        else:
            b = collate(examples)
        # row counts that repeat: one compiled shape per count (--batch-tokens steps have one count already)
        if self.pack and self.row_multiple != 1 and row_sizes is None:
            R = b["input_ids"].shape[0]
            b = pad_batch_rows(
                b, bucket_rows(R) if self.row_multiple == 0 else -(-R // self.row_multiple) * self.row_multiple
            )
        # one shape for every batch: pad to max_len, a multiple of the flex block (--batch-tokens rows are full)
        if self.cfg.compile or self.cfg.pad_to_max_len or row_sizes is not None:
            b = pad_rows(b, max(b["input_ids"].shape[1], -(-self.row_len // 128) * 128))
        first = self.dp_rank * len(examples) if first is None else first
        b = self.family.host(b, self.cfg, self.device, key, first=first)
        # ntok: real tokens; row_tokens: what the rows hold, padding included (both this rank's)
        b.update(
            examples=examples,
            ntok=int(b["attention_mask"].sum()),
            row_tokens=b["attention_mask"].numel(),
            padded=not bool(b["attention_mask"].all()),
        )
        return b

    def forward(self, examples, scale: float = 1.0, global_counts: bool = True, b: dict | None = None, key: int = 0):
        """Target features -> the family's batch -> its loss. With global_counts the per-position
        normalisers are summed over ranks first, so every rank's loss is a share of one
        global mean (scale=world undoes FSDP's gradient averaging). b: the batch of `examples`
        already built and on the device (the prefetcher's)."""
        if b is None:
            b = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in self.host_batch(examples, key).items()}
        if self.store is not None:
            feats = batch_features(
                self.store,
                examples,
                b["input_ids"].shape[1],
                self.device,
                self.dtype,
                where=b.get("where"),
                n_rows=b["input_ids"].shape[0],
            )
        elif "doc_ids" in b:  # packed rows: each document attends to itself only, positions restart
            feats = self.target(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"])
        else:
            feats = self.target(b["input_ids"], b["attention_mask"] if b["padded"] else None)
        batch = self.family.make_batch(feats, b, self.target, self.draft)
        counts = self.family.counts(batch, self.draft, self.cfg)
        if global_counts:
            counts = all_sum(counts)
        draft = self.draft_step if torch.is_grad_enabled() else self.draft
        loss, stats = self.family.step(draft, batch, counts, self.cfg, b, self.schedule)
        return loss * scale, stats, counts, b["ntok"]

    def metrics(self, stats, counts) -> dict:
        loss_sum, correct = all_sum(stats["loss_sum"].clone()), all_sum(stats["correct"].clone().float())
        out = {}
        for k in range(self.cfg.ttt_length):
            out[f"loss_{k}"] = (loss_sum[k] / counts[k, 1].clamp(min=1)).item()
            out[f"acc_{k}"] = (correct[k] / counts[k, 0].clamp(min=1)).item()
        return out

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out acc_k / loss_k over all ranks (each takes every world-th batch)."""
        K, bs = self.cfg.ttt_length, self.cfg.eval_batch_size
        tot_loss, tot_correct, tot_counts = torch.zeros(K), torch.zeros(K), torch.zeros(K, 2)
        # every rank runs the same number of forwards (FSDP all-gathers are collectives); a rank
        # past the end reruns its first batch with weight 0
        n_iter = math.ceil(len(self.eval_set) / (bs * self.dp_size))
        for j in self.bar(range(n_iter), "eval"):
            self.progress(f"evaluation, {j} of {n_iter} batches done" if j else "evaluation started")
            i = (j * self.dp_size + self.dp_rank) * bs
            w = float(i < len(self.eval_set))
            _, stats, counts, _ = self.forward(
                self.eval_set[i : i + bs] if w else self.eval_set[:bs], global_counts=False, key=-1 - j
            )
            tot_loss += w * stats["loss_sum"].float().cpu()
            tot_correct += w * stats["correct"].float().cpu()
            tot_counts += w * counts.float().cpu()
        for x in (tot_loss, tot_correct, tot_counts):
            all_sum(x)
        out = {}
        for k in range(K):
            out[f"acc_{k}"] = (tot_correct[k] / tot_counts[k, 0].clamp(min=1)).item()
            out[f"loss_{k}"] = (tot_loss[k] / tot_counts[k, 1].clamp(min=1)).item()
        return out

    # ---- checkpoints ----
    def save(self, step: int):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.draft, self.opt, options=opts)
        rng = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
        }
        rngs = [None] * self.world
        if dist.is_initialized():
            dist.all_gather_object(rngs, rng)
        else:
            rngs = [rng]
        if self.rank == 0:
            self._write_checkpoint(step, model_sd, optim_sd, rngs)
        self.barrier()

    def _write_checkpoint(self, step: int, model_sd: dict, optim_sd: dict, rngs: list):
        """ckpt/step_N with the training state beside the draft (runlog.write_checkpoint: complete or absent,
        ckpt/latest replaced atomically); a failed write (disk full, ...) is one CheckpointError naming it."""
        ck = self.out / "ckpt"
        d = ck / f"step_{step}"
        meta = {"strategy": self.cfg.strategy, "draft": self.draft_config.to_dict(), "target": str(self.target.path)}
        state = {"optim": optim_sd, "sched": self.sched.state_dict(), "step": step, "rng": rngs, "world": self.world}
        try:
            write_checkpoint(ck, d.name, model_sd, meta, lambda tmp: torch.save(state, tmp / "train_state.pt"))
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError ("file write failed")
            why = (
                "no space left on the device"
                if getattr(e, "errno", None) == errno.ENOSPC
                else f"{type(e).__name__}: {e}"
            )
            try:
                free = f"; {shutil.disk_usage(ck).free / 2**20:.0f} MiB free there"
            except OSError:
                free = ""
            kept = [c.name for c in checkpoints(self.out)]
            raise CheckpointError(
                f"cannot write checkpoint {d} ({why}{free}); removed the partial {d.name}.tmp; "
                + (
                    f"earlier checkpoints kept: {', '.join(kept)} (continue with --resume)"
                    if kept
                    else "no earlier checkpoint"
                )
            ) from None

    def latest_checkpoint(self) -> Path | None:
        found = checkpoints(self.out)
        return found[0] if found else None

    def load(self) -> int:
        """Restore the latest checkpoint; if its files are damaged (truncated, corrupted), the newest intact
        earlier one, saying so."""
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        found = checkpoints(self.out)
        if not found:
            raise CheckpointError(f"--resume: no checkpoint in {self.out / 'ckpt'}")
        damaged = []
        for d in found:
            try:
                f = d / "train_state.pt"
                state = torch.load(f, weights_only=False)
                if not isinstance(state, dict) or not {"optim", "sched", "step", "rng", "world"} <= state.keys():
                    raise ValueError("not a train_state (keys missing)")
                f = d / "draft.safetensors"
                model_sd = load_file(f)
            except Exception as e:  # any unreadable file: truncated zip, bad safetensors header, missing file, ...
                why = str(e).splitlines()[0][:200] if str(e) else ""
                damaged.append(f"{f} ({type(e).__name__}{': ' + why if why else ''})")
                self.print(f"[resume] {f} is damaged or unreadable ({type(e).__name__}{': ' + why if why else ''})")
                continue
            break
        else:
            raise CheckpointError(f"--resume: no intact checkpoint in {self.out / 'ckpt'}: " + "; ".join(damaged))
        if damaged:
            self.print(
                f"[resume] falling back to the previous intact checkpoint {d} (the later one(s) are left as they are)"
            )
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        try:
            set_state_dict(
                self.draft, self.opt, model_state_dict=model_sd, optim_state_dict=state["optim"], options=opts
            )
            self.sched.load_state_dict(state["sched"])
        except (RuntimeError, KeyError, ValueError) as e:
            raise CheckpointError(
                f"--resume: checkpoint {d} does not fit this draft (was it written with other options, "
                f"e.g. --strategy, --ttt-length, --draft-vocab-size?): {str(e).splitlines()[0][:300]}"
            ) from None
        if state["world"] == self.world:  # per-rank RNG streams only line up with the same world size
            rng = state["rng"][self.rank]
            torch.set_rng_state(rng["torch"])
            if rng["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng["cuda"])
        self.print(f"[resume] {d} at step {state['step']}")
        return state["step"]

    # ---- throughput ----
    def throughput(self) -> Throughput:
        """The run's token counter; MFU's model FLOPs per real token (runlog.Throughput says what they count),
        only for a family whose draft runs over every row token once per TTT step (EAGLE-3): the others' work per
        token (P-EAGLE's sampled rollouts, the block drafters' anchors) has no such simple count, so no MFU."""
        if not self.family.ttt_passes:
            return Throughput(None, self.world, None)
        K = self.cfg.ttt_length
        n_draft = param_count(self.draft)  # DTensor numel is the global size
        n_target = 0
        if not isinstance(
            self.target, TargetHeads
        ):  # a target forward runs here (not offline / a consumer of producers / --backend vllm: vLLM's process)
            t = self.target
            n_target = (
                param_count(t)
                - t.embed_tokens.weight.numel()
                + (t.lm_head.weight.numel() if t.lm_head.weight is t.embed_tokens.weight else 0)
            )  # lookups are not matmuls; lm_head is
        return Throughput(6 * n_draft * K + 2 * n_target, self.world, peak_flops(self.device))

    def sync_device(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def global_token_sum(self, xs: list[int]) -> list[float]:
        """Token counts summed over data-parallel ranks (tp peers hold the same batch)."""
        t = all_sum(torch.tensor(xs, dtype=torch.float64, device=self.device if self.device.type == "cuda" else "cpu"))
        return (t / self.cfg.tp).tolist()

    def packing_summary(self, speed: Throughput) -> dict:
        """run.json: how full the rows of this invocation's training steps were."""
        real, rows = self.global_token_sum([speed.total_real, speed.total_rows])
        return {
            "packed": self.pack,
            "row_len": self.row_len,
            "real_tokens": int(real),
            "row_tokens": int(rows),
            "efficiency": real / max(rows, 1),
        }

    # ---- hooks (disagg/roles.py's consumer overrides them) ----
    def step_examples(self, step: int) -> list:
        """This rank's examples of optimizer step `step`."""
        return [self.train_set[i] for i in self.batches.indices(step, self.dp_rank, self.dp_size)]

    def after_step(self, step: int):
        """Called after each optimizer step."""

    # ---- the loop ----
    def train(self) -> dict:
        self.heartbeat = Heartbeat(QUIET_S, self.print)
        try:
            return self._train()
        finally:
            self.heartbeat.close()

    def _train(self) -> dict:
        cfg = self.cfg
        if cfg.overwrite and not cfg.resume and self.rank == 0 and (old := clear_previous_run(self.out)):
            self.print(f"[out] --overwrite: removed the previous run's {', '.join(old)} from {self.out}")
        start = self.load() if cfg.resume else 0
        meta = run_metadata(
            cfg,
            world=self.world,
            device=self.device,
            extra={"data": self.data_stats, "draft": self.draft_config.to_dict(), "target_dir": str(self.target.path)},
        )
        # rows of the checkpoint's step and before are the run's record; later ones were logged after it, before
        # a kill, and are logged again (the final evaluation only follows the last checkpoint: redone too)
        end = self.total_steps
        self.log.start(
            meta,
            resume=cfg.resume,
            resume_step=start,
            keep=lambda r: (
                r.get("step", 0) < start or (r.get("step") == start and not (start == end and r.get("split") == "eval"))
            ),
        )
        results = {}
        if not self.eval_set:  # accuracies over no examples would print as 0.000
            self.print("[eval] --holdout 0: no held-out examples, so no held-out evaluation")
        if start == 0 and self.eval_set and cfg.eval_at_start:
            results["eval_start"] = self.evaluate()
            self.print(f"[eval @0] {fmt(results['eval_start'])}")
            self.log.write({"step": 0, "split": "eval", **results["eval_start"]})
        bar = None
        if cfg.progress and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=self.total_steps, initial=start, desc="train", dynamic_ncols=True)
        t0 = time.time()
        speed = self.throughput()

        def examples_of(step):
            if isinstance(self.batches, TokenBatches):  # the step's rows as planned (a fixed count of them)
                rows = self.batches.step_rows(step, self.dp_rank, self.dp_size)
                first = self.batches.first(step, self.dp_rank, self.dp_size)
                return self.host_batch(
                    self.step_examples(step), key=step, row_sizes=[len(r) for r in rows], first=first
                )
            return self.host_batch(self.step_examples(step), key=step)

        prefetch = Prefetcher(examples_of, range(start, self.total_steps), self.device)
        stop = StopRequest(cfg.time_limit, self.device, self.world)
        try:
            return self.loop(start, prefetch, stop, speed, bar, t0, results)
        finally:
            stop.close()

    def loop(self, start, prefetch, stop, speed, bar, t0, results) -> dict:
        cfg = self.cfg
        for step in range(start, self.total_steps):
            b = next(prefetch)
            self.schedule = step / self.total_steps
            loss, stats, counts, ntok = self.forward(b["examples"], scale=float(self.world), b=b)
            # the finiteness check waits for the GPU: on GPU only at steps that sync anyway (log,
            # eval, checkpoint, stop), so a bad step is caught before anything is saved
            n = step + 1
            why = stop.why(check_ranks=n % cfg.log_every == 0) if n < self.total_steps else ""
            if not why and cfg.stop_after and n - start >= cfg.stop_after and n < self.total_steps:
                why = f"--stop-after {cfg.stop_after}"
            sync = (
                n % cfg.log_every == 0
                or n == self.total_steps
                or (cfg.ckpt_every and n % cfg.ckpt_every == 0)
                or (cfg.eval_every and n % cfg.eval_every == 0)
                or why
            )
            if (sync or self.device.type == "cpu") and not torch.isfinite(loss):
                prefetch.close()
                last = self.latest_checkpoint()
                when = (
                    ""
                    if self.device.type == "cpu"
                    else " at this step (on GPU the loss is checked at log/eval/checkpoint steps)"
                )
                raise FloatingPointError(
                    f"non-finite loss at step {step}; parameters were not updated{when}. "
                    + (
                        f"Last good checkpoint: {last} "
                        "(continue from it with --resume and a lower --lr, or check the data)"
                        if last
                        else f"No checkpoint was saved before it ({self.out / 'ckpt'} has none; "
                        "--ckpt-every N saves along the way): "
                        "lower --lr or check the data, then rerun with --overwrite"
                    )
                )
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(self.draft.parameters(), cfg.grad_clip)
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad(set_to_none=True)
            self.after_step(step)
            self.progress(f"step {step + 1}")
            speed.step(ntok, b["row_tokens"], self.sync_device)
            if (step + 1) % cfg.log_every == 0 or step + 1 == self.total_steps:
                m = self.metrics(stats, counts)
                m.update(
                    loss=(all_sum(loss.detach().clone()) / self.world).item(),
                    lr=self.sched.get_last_lr()[0],
                    grad_norm=float(gnorm.full_tensor() if hasattr(gnorm, "full_tensor") else gnorm),
                )
                m.update(speed.report(self.global_token_sum))  # real / row tokens per s, step seconds, mfu
                m["compiled_graphs"] = compiled_graphs()  # growing after warm-up: recompiles
                self.log.write({"step": step + 1, "split": "train", **m})
                if bar:
                    bar.set_postfix(
                        loss=f"{m['loss']:.3f}",
                        acc0=f"{m['acc_0']:.3f}",
                        acc3=f"{m.get('acc_3', 0):.3f}",
                        graphs=m["compiled_graphs"],
                    )
            if bar:
                bar.update(1)
            evaluate = (
                cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < self.total_steps and self.eval_set
            )
            save = cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0
            if evaluate or save:
                speed.pause(self.sync_device)  # evaluation and checkpoints are not training throughput
                if evaluate:
                    ev = self.evaluate()
                    self.log.write({"step": step + 1, "split": "eval", **ev})
                if save:
                    self.save(step + 1)
                speed.resume()
            if why:
                if bar:
                    bar.close()
                prefetch.close()
                if not (cfg.ckpt_every and n % cfg.ckpt_every == 0):  # else saved just above
                    self.save(n)
                self.print(
                    f"[stop] {why}: after step {n}, checkpoint {self.out / 'ckpt' / f'step_{n}'}; "
                    "continue with --resume"
                )
                self.log.finish(
                    {"stopped_at": n, "stopped_by": why, "packing": self.packing_summary(speed)}, status="stopped"
                )
                return {"stopped_at": n, "stopped_by": why}
        if bar:
            bar.close()
        self.save(self.total_steps)
        if self.eval_set:
            results["eval_end"] = self.evaluate()
        results["train_seconds"] = time.time() - t0
        results["packing"] = self.packing_summary(speed)
        if self.eval_set:
            self.print(f"[eval @{self.total_steps}] {fmt(results['eval_end'])}")
            self.log.write({"step": self.total_steps, "split": "eval", **results["eval_end"]})
        self.log.finish(results)
        o = self.out
        self.print(
            f"[out] {o}: checkpoint {o / 'ckpt' / f'step_{self.total_steps}'}, metrics {o / 'metrics.jsonl'}, "
            f"config and results {o / 'run.json'}, TensorBoard {o / 'tb'}; serve it: python export.py {o}"
        )
        return results


class StopRequest:
    """--time-limit, SIGTERM and SIGINT: whether to stop, with a checkpoint, after the current step. The first
    SIGTERM or Ctrl-C only raises a flag (a second one acts as before: SIGTERM kills, Ctrl-C raises
    KeyboardInterrupt); every rank must stop at the same step, so on several ranks the flags are summed at log
    steps (where the loop syncs anyway), on one rank read each step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, time_limit: float, device: torch.device, world: int):
        self.deadline = STARTED + time_limit if time_limit else math.inf
        self.device, self.world = device, world
        self.signalled = ""  # the name of the first signal received
        self.previous = {}  # the handlers before ours (SIG_DFL where not set from Python); empty: not ours
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for s in self.SIGNALS:
                before = signal.signal(s, self.on_signal)
                self.previous[s] = signal.SIG_DFL if before is None else before

    def on_signal(self, signum, frame):
        self.signalled = self.signalled or signal.Signals(signum).name
        signal.signal(signum, self.previous[signum])
        # os.write, not print: a handler may run in the middle of a print on the main thread
        os.write(2, f"\n[stop] {self.signalled}: stopping after this step (send it again to stop now)\n".encode())

    def why(self, check_ranks: bool) -> str:
        """Why to stop now ('' = go on); with several ranks only where check_ranks (the same step on all)."""
        mine = self.signalled or ("--time-limit" if time.monotonic() >= self.deadline else "")
        if self.world == 1:
            return mine
        if not check_ranks:
            return ""
        flag = all_sum(torch.tensor([float(bool(mine))], device=self.device))
        return mine or ("another rank's stop" if flag.item() else "")

    def close(self):
        for s, before in self.previous.items():
            if signal.getsignal(s) == self.on_signal:
                signal.signal(s, before)


def fmt(m: dict) -> str:
    keys = sorted((k for k in m if k.startswith("acc_")), key=lambda k: int(k[4:]))
    return " ".join(f"{k}={m[k]:.3f}" for k in keys)


def main(cfg: TrainConfig):
    """Train; the exit status says how it ended (exit_status). run.json's "status" says so too."""
    trainer = None
    try:
        validate(cfg)
        check_inputs(cfg)
        check_out(cfg, int(os.environ.get("RANK", 0)))
        trainer = Trainer(cfg)
        res = trainer.train()
        barrier()  # every rank's collectives (async ones of --tp too) done before any rank tears the group down
    except (DataError, FileNotFoundError, FloatingPointError, ConfigError, CheckpointError) as e:
        if trainer is not None:
            trainer.log.fail(str(e))
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:
        if trainer is not None:
            trainer.log.fail("interrupted (SIGINT)", status="interrupted")
        print("\ninterrupted (SIGINT): stopped without saving a checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    finally:
        if trainer is not None and hasattr(trainer.target, "close"):  # --backend vllm: the engine process
            trainer.target.close()
        destroy()
    if code := exit_status(res):
        raise SystemExit(code)
    return res


def exit_status(res: dict) -> int:
    """0: finished, or stopped after --stop-after steps as asked; EXIT_STOPPED: stopped early by a signal or
    --time-limit, with a checkpoint (scripts tell an unfinished run from a finished one by it)."""
    why = res.get("stopped_by")
    return EXIT_STOPPED if why and not why.startswith("--stop-after") else 0


def config_path(argv: list[str]) -> str:
    """The --config file named on the command line (cli() reads it and drops it from the flags)."""
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return ""


if __name__ == "__main__":
    cfg = cli(TrainConfig)  # flags, or --config run.yaml with flags overriding it
    cfg = dataclasses.replace(cfg, config=config_path(sys.argv[1:]) or cfg.config)
    if cfg.deploy.role or cfg.deploy.producers:
        try:
            if (
                not cfg.deploy.role
            ):  # the launcher: the options and --out before starting the pools (a consumer restarted
                validate(cfg)  # by hand into its own --out resumes: disagg/roles.py)
                check_inputs(cfg)
                check_out(cfg)
            disagg_main(cfg, Trainer, vllm_target)
        except (ConfigError, CheckpointError) as e:
            raise SystemExit(f"error: {e}") from None
    else:
        main(cfg)
