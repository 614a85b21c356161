"""Sequence packing: the conversations of one batch share rows of --max-len tokens.

Real chats are short (the packaged sharegpt-greedy ones average 1,021 tokens with SmolLM2's
template), so one conversation per row of a 4096-token budget is mostly padding (75%: BENCHMARKS.md).
pack() places a batch's conversations into as few rows as
first-fit decreasing finds (longest first, ties by their order in the batch: a pure function of
the batch, hence of (seed, step) as GlobalBatches chooses it), and labels every token with its
document, so that nothing downstream mixes them:

    doc_ids       [R, T] int32: 0, 1, ... numbers the documents of a row in row order (so the
                  labels never decrease along a row), -1 = padding at the end of the row
    position_ids  [R, T] long: position inside the token's own document (rope restarts); padding
                  counts on from 0 as one more document, so its rows stay finite (never trained)
    where         [N, 2] long: (row, start) of example i of the batch

The batch keeps collate()'s keys too (input_ids, loss_mask, attention_mask = 1 on real tokens),
so a consumer that ignores doc_ids would silently attend across documents: that is why train.py
packs only where every consumer honours them (core/train_config.py packing_blocker names what does not).
T is the fullest row's length (like collate's longest example), not always row_len.
"""

import torch

from data.chat import DataError, Example
from data.datasets import GlobalBatches, epoch_permutation


def first_fit_decreasing(lengths: list[int], row_len: int) -> list[tuple[int, int]]:
    """(row, start) of every item: longest first (ties: earlier first) into the first row it fits."""
    if any(n > row_len for n in lengths):
        i = max(range(len(lengths)), key=lambda j: lengths[j])
        raise ValueError(f"example {i} has {lengths[i]} tokens, more than the row length {row_len}")
    fill: list[int] = []
    where = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        r = next((j for j, f in enumerate(fill) if f + lengths[i] <= row_len), len(fill))
        if r == len(fill):
            fill.append(0)
        where[i] = (r, fill[r])
        fill[r] += lengths[i]
    return where


def consecutive_rows(lengths: list[int], row_sizes: list[int], row_len: int) -> list[tuple[int, int]]:
    """(row, start) when the first row_sizes[0] items fill row 0 in order, the next row_sizes[1] row 1, ..."""
    if sum(row_sizes) != len(lengths):
        raise ValueError(f"row sizes {row_sizes} do not add up to {len(lengths)} examples")
    where, i = [], 0
    for r, k in enumerate(row_sizes):
        start = 0
        for n in lengths[i : i + k]:
            where.append((r, start))
            start += n
        if start > row_len:
            raise ValueError(f"row {r} holds {start} tokens, more than the row length {row_len}")
        i += k
    return where


def pack(
    examples: list[Example], row_len: int, pad_id: int = 0, row_sizes: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """A batch of examples -> packed rows (see the module docstring for the keys). row_sizes: the
    rows are given (TokenBatches: the first row_sizes[0] examples share row 0, in order, ...);
    else first-fit decreasing places them."""
    lengths = [len(e.input_ids) for e in examples]
    where = (
        first_fit_decreasing(lengths, row_len) if row_sizes is None else consecutive_rows(lengths, row_sizes, row_len)
    )
    R = 1 + max(r for r, _ in where)
    T = max(s + n for (_, s), n in zip(where, lengths))
    ids = torch.full((R, T), pad_id, dtype=torch.long)
    loss = torch.zeros((R, T), dtype=torch.long)
    attn = torch.zeros((R, T), dtype=torch.long)
    doc = torch.full((R, T), -1, dtype=torch.int32)
    pos = torch.zeros((R, T), dtype=torch.long)
    label = [0] * R  # a row's documents are numbered 0, 1, ... by start, so labels grow along the row
    for i in sorted(range(len(examples)), key=lambda j: where[j]):
        (r, s), n = where[i], lengths[i]
        ids[r, s : s + n] = torch.tensor(examples[i].input_ids)
        loss[r, s : s + n] = torch.tensor(examples[i].loss_mask)
        attn[r, s : s + n] = 1
        doc[r, s : s + n] = label[r]
        pos[r, s : s + n] = torch.arange(n)
        label[r] += 1
    for r in range(R):  # the padding run counts on from 0 (one more document, never trained)
        end = int(attn[r].sum())
        pos[r, end:] = torch.arange(T - end)
    return {
        "input_ids": ids,
        "loss_mask": loss,
        "attention_mask": attn,
        "doc_ids": doc,
        "position_ids": pos,
        "where": torch.tensor(where, dtype=torch.long).view(-1, 2),
    }


def pad_rows(b: dict[str, torch.Tensor], T: int) -> dict[str, torch.Tensor]:
    """Right-pad every [R, t] tensor of a (packed or collated) batch to T columns: doc_ids with -1,
    position_ids counting on (the padding document), the rest with 0."""
    out = {}
    for k, v in b.items():
        if k == "where" or not torch.is_tensor(v) or v.dim() != 2 or v.shape[1] >= T:
            out[k] = v
        elif k == "doc_ids":
            out[k] = torch.nn.functional.pad(v, (0, T - v.shape[1]), value=-1)
        elif k == "position_ids":  # the padding run continues (or starts) counting from its first position
            t = v.shape[1]
            start = torch.where(b["doc_ids"][:, -1:] < 0, v[:, -1:] + 1, 0)
            out[k] = torch.cat([v, start + torch.arange(T - t)], 1)
        else:
            out[k] = torch.nn.functional.pad(v, (0, T - v.shape[1]))
    return out


def bucket(n: int) -> int:
    """The smallest count >= n of the form m * 2**e with m in 4..7 (n itself up to 4): four counts per
    octave, so a count that varies from step to step (a packed batch's rows, the most DFlash blocks or
    P-EAGLE elements of any row) falls on a few shapes for compiled code, for at most 25% padding (about
    10% on average): 9 -> 10, 28 -> 28, 29 -> 32, 33 -> 40."""
    if n <= 4:
        return n
    e = n.bit_length() - 3  # n in [4 * 2**e, 8 * 2**e)
    return -(-n // (1 << e)) * (1 << e)


def pad_batch_rows(b: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Add rows of padding to a packed batch until it has `rows` rows (>= its own).
    The row count of pack() follows the batch's lengths (32 conversations of the packaged chats fill
    24-29 rows of 1024), and on a GPU every new count recompiles flex and the compiled target: seven
    TTT steps forward and backward, ~3 s each (experiments/pack_probe.sh, H200, 2026-12-01), so
    whole minutes go to compiling before the counts repeat; train.py pads to bucket(R) there.
    A padding row is one padding document (doc_ids -1, positions from 0, nothing trained,
    attention_mask 0), like the padding at a row's end."""
    R, T = b["input_ids"].shape
    extra = rows - R
    assert extra >= 0, f"a batch of {R} rows cannot be padded to {rows}"
    if not extra:
        return b
    out = {}
    for k, v in b.items():
        if k == "where" or not torch.is_tensor(v) or v.dim() != 2 or v.shape[0] != R:
            out[k] = v
        elif k == "doc_ids":
            out[k] = torch.cat([v, v.new_full((extra, T), -1)])
        elif k == "position_ids":
            out[k] = torch.cat([v, torch.arange(T, dtype=v.dtype).expand(extra, T)])
        else:
            out[k] = torch.cat([v, v.new_zeros((extra, T))])
    return out


def plan_rows(lengths: list[int], order: list[int], row_len: int, window: int = 64) -> list[list[int]]:
    """Rows of row_len tokens filled first-fit with whole examples taken in `order`: each goes into the
    first of the `window` most recently opened rows that has room, else into a new row. Rows come in
    the order they were opened, each listing its examples in the order they came. O(len(order) * window)."""
    rows: list[list[int]] = []
    fill: list[int] = []
    open_rows: list[int] = []  # rows still taking examples, oldest first
    for i in order:
        n = lengths[i]
        if n > row_len:
            raise ValueError(f"example {i} has {n} tokens, more than the row length {row_len}")
        r = next((j for j in open_rows if fill[j] + n <= row_len), None)
        if r is None:
            r = len(rows)
            rows.append([])
            fill.append(0)
            open_rows.append(r)
            if len(open_rows) > window:
                open_rows.pop(0)
        rows[r].append(i)
        fill[r] += n
        if fill[r] == row_len:
            open_rows.remove(r)
    return rows


class TokenBatches:
    """Global batches of a fixed token budget: every step is `rows` rows of row_len tokens filled
    first-fit (plan_rows) with whole examples of epoch e's permutation (seeded by (seed, e) as in
    GlobalBatches); an epoch's last rows short of a full step wait for no one (dropped, like the
    remainder of GlobalBatches). So every step has the same row count (one compiled shape, no rows
    of padding) and its rows are nearly full, whatever the conversations' lengths.

    The plan is a pure function of (lengths, rows, row_len, seed): resume and any number of ranks
    see the same steps. Rank r of W takes the r-th contiguous block of rows / W rows of each step,
    so one rank trains the same rows as W ranks together."""

    def __init__(self, lengths: list[int], rows: int, row_len: int, seed: int):
        if rows < 1:
            raise DataError(f"a token budget of less than one row of {row_len} tokens")
        self.lengths, self.rows, self.row_len, self.seed = list(lengths), rows, row_len, seed
        self.n = len(self.lengths)  # examples (GlobalBatches' name: the plan's eval ids start here)
        self._steps: list[int] = []  # steps of epochs 0, 1, ... (each needs its plan once)
        self._plan_epoch, self._plan = -1, []
        self.per_epoch = self._epoch_steps(0)
        if self.per_epoch == 0:
            raise DataError(
                f"the data fill only {len(self._rows_of(0))} rows of {row_len} tokens, fewer than one step's {rows}"
            )

    def _rows_of(self, epoch: int) -> list[list[int]]:
        if epoch != self._plan_epoch:
            perm = epoch_permutation(self.n, self.seed, epoch)
            self._plan, self._plan_epoch = plan_rows(self.lengths, perm, self.row_len), epoch
        return self._plan

    def _epoch_steps(self, epoch: int) -> int:
        while len(self._steps) <= epoch:
            self._steps.append(len(self._rows_of(len(self._steps))) // self.rows)
        return self._steps[epoch]

    def step_rows(self, step: int, rank: int = 0, world: int = 1) -> list[list[int]]:
        """This rank's rows of step `step`: lists of example indices."""
        if self.rows % world:
            raise ValueError(f"{self.rows} rows a step do not split over {world} ranks")
        epoch = 0
        while step >= self._epoch_steps(epoch):
            step -= self._epoch_steps(epoch)
            epoch += 1
        rows = self._rows_of(epoch)[step * self.rows : (step + 1) * self.rows]
        k = self.rows // world
        return rows[rank * k : (rank + 1) * k]

    def indices(self, step: int, rank: int = 0, world: int = 1) -> list[int]:
        return [i for row in self.step_rows(step, rank, world) for i in row]

    def first(self, step: int, rank: int = 0, world: int = 1) -> int:
        """How many examples of the step the ranks before `rank` hold (its examples' global offset)."""
        k = self.rows // world
        return sum(len(r) for r in self.step_rows(step)[: rank * k])


def plan_batches(cfg, train: list[Example], row_len: int):
    """A run's data order, built alike by core/trainer.py's Trainer and the disaggregated producers: GlobalBatches
    of cfg.batch_size conversations, or with cfg.batch_tokens TokenBatches of batch_tokens // max_len rows
    of row_len tokens (row_len >= cfg.max_len: a feature store captured at a larger --max-len has longer rows).
    batch_tokens -1 (train.py's auto) reaches here only where it means conversations (disaggregated runs)."""
    if cfg.batch_tokens > 0:
        return TokenBatches([len(e.input_ids) for e in train], cfg.batch_tokens // cfg.max_len, row_len, cfg.seed)
    return GlobalBatches(len(train), cfg.batch_size, cfg.seed)
