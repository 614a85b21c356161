"""train.py's configuration: TrainConfig (every flag; the deployment section is core/config.py's DeployConfig)
and the checks that refuse a run before anything loads: `validate` (option values and their combinations),
`check_inputs` (--target / --data / --features / --init-draft of the right kind) and `check_out` (an --out that
is this run's, a finished run's with --resume or --overwrite, or new). Library code: gate.py and experiments/
build train.py's flags from it (core/config.py to_flags) without importing the script."""

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from core.checkpoint import checkpoints
from core.cli_options import DataOption, DeviceOption, MaxLenOption, NumRecordsOption, StrategyOption, TargetOption
from core.config import DeployConfig, cli, config_path, flag_values, load_yaml
from core.runlog import RUN_FILES, os_why, output_kind, previous_run, probe_write
from models.families import FAMILIES, FAMILY_OPTIONS
from models.target import PACKABLE_ATTENTION

MAX_MOE_EXPERTS = 256
MAX_PROCESSES = 1024  # --producers, --consumer-ranks: processes the disaggregated launcher starts on one host


@dataclass
class BaseTrainConfig(DeviceOption, MaxLenOption, NumRecordsOption, DataOption, TargetOption, StrategyOption):
    """The options every family reads (--strategy, --target, --data, --num-records, --max-len and --device are
    core/cli_options.py's groups); each family's own are its file's options dataclass (models/family.py
    `options_cls`), and TrainConfig below is this plus all of them."""

    features: str = ""
    """offline: train from a FeatureStore written by `capture.py features` (no target forward; only the
    target's embeddings and lm_head are loaded; the samples, hence --data/--num-records/--max-len, are the store's)"""
    num_records: int = 1200  # a CPU demo's worth; 0 reads all
    holdout: int = 32
    """examples held out for the final evaluation"""
    ttt_length: int = 7
    """drafted tokens K trained per position: TTT steps (eagle3), parallel depths (peagle), block
    predictions (dflash/domino: blocks of K+1 after the clean anchor; dspark: blocks of K)"""
    objective: str = "auto"
    """eagle3: kl (default) | lk-alpha | lk-lambda (LK losses) | tv | rkl | jsd (per-row divergences, as in
    speculators; models/eagle3.py); peagle: kl; dflash: ce (default, per-slot hard CE) |
    dpace (slots reweighted by detached prefix-acceptance estimates); domino: ce; dspark: ce-l1-conf"""
    aux_layers: tuple[int, ...] = ()
    """target layers whose outputs feed the draft (default [1, L//2-1, L-4])"""
    batch_size: int = 4
    """global batch in sequences (split over ranks)"""
    batch_tokens: int = -1
    """a token budget instead of --batch-size: every step is batch_tokens // max_len packed rows of --max-len,
    filled first-fit with whole conversations of the shuffled data (data/packing.TokenBatches): one row count
    (one compiled shape, no rows of padding) and rows nearly full; needs packing; 0 = --batch-size conversations;
    -1 (auto) = on a GPU where rows are packed, as many rows as its memory holds (estimated from the model's
    sizes, at most 65,536 tokens a GPU; printed): the same step shape every step, nothing recompiles after
    warm-up (packed conversations vary the row count); on a resumed run the budget it started with; elsewhere
    --batch-size conversations"""
    steps: int = 80
    """optimizer steps (0 = one epoch)"""
    lr: float = 3e-3
    optimizer: str = "adamw"
    """adamw, or muon: Muon on the draft's hidden matrices and AdamW on its head and vectors (core/optim.py;
    the update is scaled to AdamW's RMS, so --lr and --weight-decay keep their meaning)"""
    warmup: int = 8
    """steps of linear learning-rate warm-up, then cosine decay to --min-lr-ratio; 8 suits the short default
    run. For long runs use more: on the shipped draft's 5,600-step H200 recipe at --lr 3e-3, 200 steps avoided
    the early gradient spikes of 8 and gained 0.07-0.25 τ (experiments/results/scale_h200/warmup200_5600)"""
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
    """held-out conversations per evaluation batch (with --batch-tokens: the training step's rows instead)"""
    attention: str = "auto"
    """eagle3's TTT attention: eager (reference) | lse (fused causal + diagonal, CPU/GPU) | flex (GPU;
    FlexAttention, K/V concatenated each step) | flex_buf (GPU; K/V written once into buffers, one
    shape for all steps so flex compiles once; more memory: BENCHMARKS.md); auto = flex on GPU, lse on
    CPU. peagle, dflash, domino, dspark: eager (dense masks) | flex (GPU); auto = flex on GPU, eager on CPU"""
    loss: str = "auto"
    """eagle3's head + loss: torch (reference) | triton (in-place CE) | fused (chunked linear+CE); auto = triton
    on GPU (fastest end-to-end step on the H200, see BENCHMARKS.md), torch on CPU; the other families compute
    their own (none reads --loss)"""
    backend: str = "auto"
    """target forward: hf (transformers, any model; the reference) | compiled (models/fast_target.py: Llama,
    Qwen2/3, Qwen3-MoE; layers torch.compile'd on GPU) | vllm (a vLLM engine in its own venv, NANOSPEC_VLLM_VENV
    or .venv-vllm; core/vllm_features.py; online training and the disaggregated producers) | auto = compiled on a
    GPU where it builds the target's architecture (else hf, saying why), hf on CPU (compiling pays only on a GPU;
    hf is the reference)"""
    pad_to_max_len: bool = False
    """pad every batch to --max-len (rounded up to 128): flex then compiles one shape per TTT step instead
    of one per (length bucket, step); worth it on a GPU where small steps are launch-bound (--compile implies it)"""
    pack: str = "auto"
    """several conversations per row of --max-len (data/packing.py; document boundaries kept everywhere, --batch-size
    still counts conversations): auto = on where the family and target backend keep documents apart (eagle3, incl.
    EAGLE-3.1 / LK / MoE, peagle, dflash, domino, dspark; with the hf (sdpa/eager) or compiled target, online or
    offline; --compile too), off where they cannot (lse on GPU, other HF attention) | on = refuse
    to run there | off = one conversation per row"""
    gpu_memory: float = 0.0
    """GiB of each GPU this run may use (0: all of it): --batch-tokens auto is sized for it and PyTorch's allocator
    is capped there (an out-of-memory error past it), as on a smaller GPU or one shared with another process"""
    pack_row_multiple: int = 0
    """packed batches get rows of padding up to a multiple of this many rows (1: none); 0 = on a GPU up to the
    next of four row counts per octave (8, 10, 12, 14, 16, 20, ...; data/packing.py bucket), none on CPU:
    on a GPU each new row count compiles flex and the target anew"""
    compile: bool = False
    """compile the draft step (TTT forward + loss + backward) as a unit; batches are padded to --max-len so
    shapes repeat (with several ranks the FSDP2-wrapped draft is compiled: one graph, its hooks stay eager)"""
    compile_after: int = 2000
    """without --compile, a run of at least this many steps compiles the draft step anyway where that was
    measured to pay (eagle3, --objective kl, a token budget, on one GPU: 1.34x the eager step, ~1.5 min more of
    compiling, ahead after ~1,450 steps; BENCHMARKS.md); 0 = only with --compile"""
    tp: int = 1
    """tensor-parallel size of the compiled target: torchrun ranks [d*tp, (d+1)*tp) run it together on one batch
    (dp = world/tp data-parallel groups); the draft stays FSDP2 over all ranks"""
    progress: bool = True
    """progress bars (tokenizing, evaluation, training) on rank 0"""
    config: str = ""
    """YAML file with any of these options (underscored names; deployment ones under `deploy:` or at top level);
    flags given with it override it (core/config.py)"""
    deploy: Annotated[DeployConfig, tyro.conf.OmitArgPrefixes] = dataclasses.field(default_factory=DeployConfig)
    """disaggregated online training: producer and consumer pools (core/disagg/)"""


def _with_options(name: str, option_classes) -> type:
    """BaseTrainConfig's fields, then those of option_classes (a class that another one extends is left out:
    it comes with it)."""
    leaves = [
        c for c in dict.fromkeys(option_classes) if not any(o is not c and issubclass(o, c) for o in option_classes)
    ]
    cls = dataclasses.make_dataclass(name, [], bases=(*leaves, BaseTrainConfig))
    cls.__module__ = __name__
    return cls


# train.py's whole configuration: the common options and every family's own (a run reads its family's; validate
# refuses another family's set away from its default). Adding a family with new options needs no line here.
TrainConfig = _with_options("TrainConfig", [f.options_cls for f in FAMILIES.values()])
TrainConfig.__doc__ = "train.py's options: BaseTrainConfig's and every family's own (models/family.py options_cls)."


def family_cli_class(strategy: str) -> type:
    """The flags `train.py --strategy NAME` takes (and its --help shows): the common ones and NAME's own."""
    return _with_options("TrainConfig", [FAMILIES[strategy].options_cls])


def parse_cli(args: list[str]) -> TrainConfig:
    """train.py's command line (flags, or --config FILE.yaml with flags over it) -> its TrainConfig. The strategy
    (its flag, else the YAML's, else eagle3) picks the options it takes: a flag of another family's option is
    refused, naming the families that read it; --help lists the strategy's own."""
    strategy = next(reversed(flag_values(args, "--strategy")), None)  # the last one given, as the parser keeps
    if strategy is None and (path := config_path(args)):
        strategy = load_yaml(TrainConfig, path).strategy
    strategy = strategy or BaseTrainConfig.strategy
    if strategy not in FAMILIES:
        raise SystemExit(f"error: unknown strategy {strategy!r}: choose one of {', '.join(FAMILIES)}")
    for a in args:
        name = a.split("=", 1)[0].removeprefix("--").replace("-", "_")
        name = name.removeprefix("no_") if a.startswith("--no-") and name not in FAMILY_OPTIONS else name
        if a.startswith("--") and name in FAMILY_OPTIONS - FAMILIES[strategy].options:
            users = ", ".join(n for n, f in FAMILIES.items() if name in f.options)
            raise SystemExit(f"error: --{name.replace('_', '-')} applies to --strategy {users}, not {strategy}")
    if "-h" in args or "--help" in args:
        cli(family_cli_class(strategy), args)  # prints this family's flags and exits
    return cli(TrainConfig, args)  # the same values: the flags were checked above, a YAML by validate


class ConfigError(ValueError):
    """A bad option value or --out; reported as one line, before the model and data are loaded."""


def validate(cfg: TrainConfig, world: int | None = None):
    """Option values that cannot work, as one message each, before anything is loaded or written.
    world: the ranks that split --batch-size (default: torchrun's WORLD_SIZE, or the launcher's consumer ranks)."""
    if world is None:
        world = (
            cfg.deploy.consumer_ranks
            if (cfg.deploy.producers and not cfg.deploy.role)
            else int(os.environ.get("WORLD_SIZE", 1))
        )
    _check_ranges(cfg)
    _check_model(cfg, world)
    _check_batching(cfg, world)
    _check_run(cfg)
    _check_family(cfg)


def _check_ranges(cfg: TrainConfig):
    """Counts below their least value and floats outside their interval (or not finite)."""
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
        "gpu_memory": (0.0, True, math.inf),
    }
    for name, (low, closed, high) in floats.items():
        v = getattr(cfg, name)
        if not math.isfinite(v) or v < low or (v == low and not closed) or v > high:
            rng = f"{'[' if closed else '('}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number in {rng}, got {v}")


def _check_model(cfg: TrainConfig, world: int):
    """The draft's and target's shape options (aux layers, TTT against --max-len, MoE, tensor parallel, the
    optimizer) and the disaggregated options."""
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


def _check_batching(cfg: TrainConfig, world: int):
    """--batch-size, --batch-tokens and --pack-row-multiple against the rows a step holds and the data-parallel
    ranks that split them."""
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


def _check_run(cfg: TrainConfig):
    """--resume against --init-draft and --overwrite; --pack's value."""
    if cfg.resume and cfg.init_draft:
        raise ConfigError("--resume continues the run in --out with its own weights; --init-draft starts a new one")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it: pass one of them")
    if cfg.pack not in ("auto", "on", "off"):
        raise ConfigError(f"--pack must be auto, on or off, got {cfg.pack!r}")


def _check_family(cfg: TrainConfig):
    """--strategy, and every family option given to a family that does not read it (refused, never ignored)."""
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
    """The disaggregated options (core/disagg/): values that cannot work (--producers -1 was a ZeroDivisionError, 10**12
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


# --batch-tokens -1 on a GPU: the step's tokens sized from the GPU's memory (gpu_batch_tokens)
GPU_MEMORY_SHARE = 0.85
"""of the GPU's memory a step is planned to fill: the rest is the allocator's slack and the estimate's error"""
GPU_TOKENS_CAP = 65_536
"""tokens per GPU a step at most: SmolLM2's step takes ~0.1 s from 1.5k to 32k tokens on the H200 (launch-bound;
experiments/results/defaults_h200/), so a budget this large keeps the GPU busy; more would only change optimization"""


def step_bytes_per_token(hidden: int, intermediate: int, vocab: int, draft_vocab: int, ttt: int) -> int:
    """Peak bytes one token of an online training step holds, from the model's sizes: per TTT step the draft's
    activations kept for the backward (~12 hidden-sized and 3 intermediate-sized bf16 tensors) and its logits
    (fp32), plus the target's logits (fp32) and the captured hidden states. Against the H200's peaks at 32,768
    tokens a step (2026-11/12): Llama-3.1-8B's shape (draft vocabulary 32,000) 112 GiB estimated with the
    weights, 106 measured; SmolLM2-135M's 19 estimated, 11.6 measured: on the safe side for both."""
    return ttt * (24 * hidden + 6 * intermediate + 4 * draft_vocab) + 4 * vocab + 64 * hidden


def draft_state_bytes(hidden: int, intermediate: int, draft_vocab: int, layers: int) -> int:
    """The draft's fp32 weights, gradients and two AdamW moments (16 bytes a parameter): its input projection
    (3H x H), decoder layers (attention ~7H^2 with the doubled input, MLP 3HI) and head (V_d x H)."""
    return 16 * (
        3 * hidden * hidden + layers * (7 * hidden * hidden + 3 * hidden * intermediate) + draft_vocab * hidden
    )


def gpu_batch_tokens(cfg: TrainConfig, sizes: dict, total: int, in_use: int, dp: int) -> tuple[int, str]:
    """--batch-tokens -1 on a GPU: rows of --max-len, as many as GPU_MEMORY_SHARE of the GPU's `total` bytes
    holds after `in_use` (the target, loaded) and the draft's state, at most GPU_TOKENS_CAP tokens, times the
    `dp` data-parallel ranks (each takes its share of the rows). sizes: the target's hidden_size,
    intermediate_size and vocab_size. Returns (tokens, why) where why says how it was chosen."""
    h, i, v = sizes["hidden_size"], sizes["intermediate_size"], sizes["vocab_size"]
    per_token = step_bytes_per_token(h, i, v, cfg.draft_vocab_size, cfg.ttt_length)
    if cfg.features:  # two more batches of stored features (bf16 aux + final: 8H bytes a token) wait on the GPU
        per_token += 2 * 8 * h  # (core/trainer.py's prefetch: one ready, one copied while it waits)
    fixed = in_use + draft_state_bytes(h, i, cfg.draft_vocab_size, cfg.draft_layers)
    free = GPU_MEMORY_SHARE * total - fixed
    fits = max(0, int(free // per_token))
    rows = max(1, min(fits, GPU_TOKENS_CAP) // cfg.max_len)
    gib, whose = 2**30, "--gpu-memory's" if cfg.gpu_memory else "the GPU's"
    why = (
        f"sized from {whose} {total / gib:.1f} GiB: the target {in_use / gib:.1f} GiB, the draft's state "
        f"{fixed / gib - in_use / gib:.1f} GiB, ~{per_token / 2**20:.2f} MiB a token"
    )
    if fits < cfg.max_len:
        why += f"; not even one row of --max-len {cfg.max_len} is estimated to fit (a smaller --max-len would)"
    elif fits > GPU_TOKENS_CAP:
        why += f"; capped at {GPU_TOKENS_CAP} tokens a GPU"
    return rows * cfg.max_len * dp, why


def auto_batch_tokens(cfg: TrainConfig, kind: str, pack: bool, gpu=None) -> int:
    """--batch-tokens as the run uses it: -1 (auto) is a budget on a GPU with packed rows (one step shape: the
    compiled target and flex compile once; packed conversations vary the row count and recompile): `gpu()`'s
    tokens (train.py: gpu_batch_tokens for this GPU), else --batch-size rows of --max-len; elsewhere 0
    (--batch-size conversations). Disaggregated runs keep -1, which means conversations there: the producers lay
    out the plan before any packing is decided, and their fingerprint carries it."""
    if cfg.batch_tokens != -1 or cfg.deploy.role or cfg.deploy.producers:
        return cfg.batch_tokens
    if kind != "cuda" or not pack:
        return 0
    return gpu() if gpu is not None else cfg.batch_size * cfg.max_len


def auto_compile(cfg: TrainConfig, kind: str, total_steps: int, world: int = 1) -> str | None:
    """Why this run compiles its draft step without --compile (None: it does not). Only where it was measured
    (experiments/results/defaults_h100_run2/: SmolLM2's defaults on an H100, 361,506 against 270,516 real
    tokens/s, one compiled shape from the first step, 86 s more before it; the 8B shape's harness compiles the same
    step: 1.08x train.py's eager one at less memory): eagle3 with --objective kl, no MoE, flex attention, a token
    budget (one step shape), on one GPU (several ranks compile the FSDP2 draft: equal to one rank on the CPU,
    tests/test_draft_step.py, but not yet timed on GPUs), for a run long enough to pay the compile back."""
    if cfg.compile or not cfg.compile_after or total_steps < cfg.compile_after or kind != "cuda" or world > 1:
        return None
    if cfg.strategy != "eagle3" or cfg.objective != "kl" or cfg.moe_experts or not cfg.attention.startswith("flex"):
        return None
    if cfg.batch_tokens <= 0:  # --batch-size conversations: the row count varies, each count compiles anew
        return None
    return f"{total_steps} steps >= --compile-after {cfg.compile_after} (--compile-after 0: eager)"


def packing_blocker(cfg: TrainConfig, family, kind: str, attn_impl: str | None) -> str | None:
    """Why this run cannot pack rows without mixing documents (None: it can). attn_impl: the HF
    target's attention implementation (None for the compiled target or stored features)."""
    if not family.packs:
        packing = ", ".join(n for n, s in FAMILIES.items() if s.packs)
        return (
            f"--strategy {cfg.strategy} does not keep packed documents apart in its masks yet "
            f"(families that pack: {packing})"
        )
    # --compile with packed rows: correct on CPU inductor (tests/test_packing.py); on a GPU it was refused until
    # measured at speed (on the H200 on 2026-12-01 its first step never finished: each new row count recompiled
    # flex). Measured on an H100 on 2026-12-05 (experiments/results/defaults_h100_run2/): one shape a step under
    # --batch-tokens, 17 compiled graphs from the first step to the last, 1.34x the eager step's tokens/s.
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
    fresh = cfg.deploy.control and not cfg.resume and control.is_dir() and not (control / "control.db").exists()
    if fresh and (found := sorted(p.name for p in control.iterdir())):  # a fresh run deletes features/, control.db
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
            probe_write(out)
        except OSError as e:
            raise ConfigError(f"--out {out}: cannot write the run there: {os_why(e)}") from None
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
