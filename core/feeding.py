"""Data feeding for core/trainer.py's loop: whether rows are packed (`packing`), the batch budget on this device
(`batching`), the run's examples tokenized, split and planned into steps (`load_data`), and each step's host-side
batch (`Batcher`, run on the prefetch thread while the previous step trains)."""

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from core.distributed import all_min
from core.train_config import ConfigError, TrainConfig, auto_batch_tokens, gpu_batch_tokens, packing_blocker
from data.chat import DataError
from data.datasets import build_examples, collate, load_records, split_holdout, tokenize_workers
from data.packing import TokenBatches, bucket, pack, pad_batch_rows, pad_rows, plan_batches, plan_rows
from models.target import config_int


def packing(cfg: TrainConfig, family, target, kind: str, say) -> bool:
    """--pack auto|on|off -> whether rows are packed; a run that cannot keep documents apart
    refuses --pack on and runs auto unpacked, saying why."""
    attn_impl = getattr(getattr(getattr(target, "model", None), "config", None), "_attn_implementation", None)
    why = packing_blocker(cfg, family, kind, attn_impl)
    if cfg.pack == "on" and why:
        raise ConfigError(f"--pack on: {why}; pass --pack off (one conversation per row)")
    if cfg.pack == "auto" and why:
        say(f"[data] one conversation per row: {why}")
    return cfg.pack != "off" and why is None


def gpu_memory(cfg: TrainConfig, device: torch.device) -> int:
    """Bytes of this GPU the run may use: all of them, or --gpu-memory GiB with PyTorch's allocator capped there
    (called before the target loads, so the cap holds for everything the run allocates)."""
    total = torch.cuda.get_device_properties(device).total_memory
    if not cfg.gpu_memory:
        return total
    cap = int(cfg.gpu_memory * 2**30)
    if cap > total:
        raise ConfigError(f"--gpu-memory {cfg.gpu_memory:g} GiB is more than this GPU has ({total / 2**30:.1f} GiB)")
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    return cap


def batching(
    cfg: TrainConfig, kind: str, pack: bool, target, device, gpu_bytes: int, dp_size: int, out: Path, say
) -> TrainConfig:
    """--batch-tokens -1 (auto) resolved for this device (auto_batch_tokens), saying so when it is a budget:
    on a GPU sized from the `gpu_bytes` the run may use (gpu_memory's) by gpu_batch_tokens; a resumed run keeps
    the budget it started with (the same batches)."""
    why = []

    def sized() -> int:
        tokens = None
        if cfg.resume:  # run.json's config is the first start's (core/runlog.RunLog.start)
            try:
                tokens = json.loads((out / "run.json").read_text())["config"]["batch_tokens"]
            except (OSError, ValueError, KeyError, TypeError):
                pass  # no readable run.json: restore() and RunLog.start say so
        if isinstance(tokens, int) and tokens > 0:
            why.append("the budget this run started with (--resume)")
            return tokens
        sizes = {k: config_int(target.path, k) for k in ("hidden_size", "intermediate_size", "vocab_size")}
        if None in sizes.values():  # a config without them: the --batch-size rows
            why.append(f"{cfg.batch_size} rows: the target's config.json names no {', '.join(sizes)}")
            return cfg.batch_size * cfg.max_len
        tokens, text = gpu_batch_tokens(cfg, sizes, gpu_bytes, torch.cuda.memory_allocated(device), dp_size)
        agreed = int(all_min(torch.tensor([tokens], device=device)).item())  # every rank the same batches
        why.append(text + (f"; {agreed} tokens, the smallest rank's" if agreed != tokens else ""))
        return agreed

    budget = auto_batch_tokens(cfg, kind, pack, sized)
    if budget == cfg.batch_tokens:
        return cfg
    if budget:
        say(
            f"[data] batching: --batch-tokens {budget} ({budget // cfg.max_len} packed rows of --max-len "
            f"{cfg.max_len}) a step, the one shape a GPU compiles once; {'; '.join(why)}. --batch-tokens N sets "
            f"it, --batch-tokens 0 batches --batch-size ({cfg.batch_size}) conversations"
        )
    return dataclasses.replace(cfg, batch_tokens=budget)


@dataclass
class RunData:
    """A run's examples: the training and held-out ones, the plan of steps over them, rows of row_len tokens."""

    train_set: list
    eval_set: list
    batches: object  # data/packing.py's GlobalBatches or TokenBatches
    row_len: int
    stats: dict  # run.json's "data": what tokenizing kept and skipped, records, train, holdout


def load_data(cfg: TrainConfig, tokenizer, pack: bool, store, stored, say, bar) -> RunData:
    """--data tokenized (or a feature store's examples, `stored`, tokenized at capture time exactly alike), the
    held-out split, and the steps planned over the rest; too few examples left is a DataError saying what was
    skipped. say: rank 0's print; bar(iterable, desc): a progress bar when --progress."""
    stats = Counter()
    if cfg.batch_tokens > 0 and not pack:  # before minutes of tokenizing
        raise ConfigError(
            "--batch-tokens fills packed rows, and this run is not packed "
            "(--pack off, or the [data] line above says why)"
        )
    if store is not None:
        examples, n_records = stored, store.schema["data"]["records"]
        stats.update(store.schema["data"]["stats"])
    else:
        records = load_records(cfg.data, cfg.num_records or None)
        workers = tokenize_workers(len(records))  # a pool of processes has no per-record bar
        src = records if workers > 1 else bar(records, "tokenize")
        examples, n_records = build_examples(src, tokenizer, cfg.max_len, stats, workers), len(records)
    try:
        train_set, eval_set = split_holdout(examples, cfg.holdout)
        # rows of --max-len tokens; a feature store captured at a larger --max-len holds longer conversations,
        # whose rows then grow to the longest (each conversation still fits one row)
        longest = max(len(e.input_ids) for e in [*train_set, *eval_set])
        row_len = max(cfg.max_len, longest)
        batches = plan_batches(cfg, train_set, row_len)
    except DataError as e:  # say why so few examples are left: what was skipped, at which --max-len
        counts = json.dumps(dict(stats, records=n_records))
        raise DataError(
            f"{e}. [data] {cfg.features or cfg.data} at --max-len {cfg.max_len}: {counts} "
            "(skipped_* are conversations dropped: no assistant turn, only empty ones, or nothing trainable "
            "within --max-len; see README 'Training your own draft')"
        ) from None
    data = RunData(
        train_set,
        eval_set,
        batches,
        row_len,
        dict(stats, records=n_records, train=len(train_set), holdout=len(eval_set)),
    )
    say(f"[data] {cfg.features or cfg.data}: {json.dumps(data.stats)}")
    if row_len > cfg.max_len:
        say(f"[data] conversations up to {longest} tokens (> --max-len {cfg.max_len}): rows of {longest} tokens")
    if cfg.batch_tokens > 0:
        say(
            f"[data] --batch-tokens {cfg.batch_tokens}: {batches.rows} rows of {row_len} tokens a step, "
            f"{batches.per_epoch} steps an epoch"
        )
    return data


@dataclass
class Batcher:
    """Examples -> the batch the step takes, as far as the host knows it without the GPU. pack: rows packed;
    row_len: tokens a row holds; row_multiple: row counts rounded up to a multiple of it (0: data/packing.py's
    bucket, 1: as they come); dp_rank, dp_size: this rank's place among the data-parallel ranks."""

    cfg: TrainConfig
    family: object  # models/family.py's Family
    device: torch.device
    pack: bool
    row_len: int
    row_multiple: int
    dp_rank: int
    dp_size: int

    def host_batch(
        self,
        examples,
        key: int = 0,
        row_sizes: list[int] | None = None,
        first: int | None = None,
        rows: int | None = None,
    ) -> dict:
        """Everything about a batch that the host knows without the GPU: collated tensors, the
        family's host-side parts (EAGLE-3 on GPU: the trained rows of each TTT step; block
        drafters: anchors), token count, whether anything is padded. Runs on the prefetch thread
        during training. key seeds the family's random draws (the step; eval batches: < 0). row_sizes,
        first: a --batch-tokens step's rows (examples per row, in order) and its examples' global offset;
        rows: padding rows added up to this count (eval_batches' evaluation in the training step's shape)."""
        if self.pack:  # + doc_ids, position_ids, where
            b = pack(examples, self.row_len, row_sizes=row_sizes)
        else:
            b = collate(examples)
        # row counts that repeat: one compiled shape per count (--batch-tokens steps have one count already)
        if self.pack and self.row_multiple != 1 and row_sizes is None:
            R = b["input_ids"].shape[0]
            b = pad_batch_rows(
                b, bucket(R) if self.row_multiple == 0 else -(-R // self.row_multiple) * self.row_multiple
            )
        if rows:
            b = pad_batch_rows(b, rows)
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

    def eval_batches(self, eval_set: list, batches) -> list[tuple[list, list[int]]]:
        """The held-out examples in batches: (examples, row_sizes) for host_batch, every rank's (rank r takes
        batches r, r + dp_size, ...). A --batch-tokens run packs them into rows of the training step (first-fit,
        in order) and each rank's batch holds as many rows as its training step: with padding rows up to that
        count on a GPU (evaluate_rows), evaluation and training are one shape for the compiled target and flex.
        (Batches of eval_batch_size conversations each packed their own row count: on a GPU a compile of the
        target and of flex per count, none of them the training step's.) Otherwise batches of eval_batch_size
        conversations."""
        if not isinstance(batches, TokenBatches):
            bs = self.cfg.eval_batch_size
            return [(eval_set[i : i + bs], None) for i in range(0, len(eval_set), bs)]
        k = batches.rows // self.dp_size
        planned = plan_rows([len(e.input_ids) for e in eval_set], list(range(len(eval_set))), self.row_len)
        out = []
        for i in range(0, len(planned), k):
            chunk = planned[i : i + k]
            out.append(([eval_set[j] for row in chunk for j in row], [len(row) for row in chunk]))
        return out

    def evaluate_rows(self, batches) -> int | None:
        """The row count eval_batches' batches are padded to: the training step's on a GPU (one compiled shape;
        row_multiple != 1), none on CPU, where padding rows are work and nothing compiles per shape."""
        if isinstance(batches, TokenBatches) and self.row_multiple != 1:
            return batches.rows // self.dp_size
        return None

    def step_batch(self, batches, step: int, examples: list) -> dict:
        """Optimizer step `step`'s batch of this rank's `examples`: a --batch-tokens step's rows as planned (a
        fixed count of them), else the examples collated (packed or one per row)."""
        if isinstance(batches, TokenBatches):
            rows = batches.step_rows(step, self.dp_rank, self.dp_size)
            first = batches.first(step, self.dp_rank, self.dp_size)
            return self.host_batch(examples, key=step, row_sizes=[len(r) for r in rows], first=first)
        return self.host_batch(examples, key=step)
