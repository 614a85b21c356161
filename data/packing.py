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
packs only where every consumer honours them (train.packing_blocker names what does not).
T is the fullest row's length (like collate's longest example), not always row_len.
"""

import torch

from data.chat import Example


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


def pack(examples: list[Example], row_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of examples -> packed rows (see the module docstring for the keys)."""
    lengths = [len(e.input_ids) for e in examples]
    where = first_fit_decreasing(lengths, row_len)
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


def bucket_rows(R: int) -> int:
    """The smallest row count >= R of the form m * 2**e with m in 4..7 (R itself up to 4): four
    counts per octave, so a run's varying row counts fall on a few shapes, for at most 25% padding
    rows (about 10% on average): 9 -> 10, 28 -> 28, 29 -> 32, 33 -> 40."""
    if R <= 4:
        return R
    e = R.bit_length() - 3  # R in [4 * 2**e, 8 * 2**e)
    return -(-R // (1 << e)) * (1 << e)


def pad_batch_rows(b: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """Add rows of padding to a packed batch until it has `rows` rows (>= its own).
    The row count of pack() follows the batch's lengths (32 conversations of the packaged chats fill
    24-29 rows of 1024), and on a GPU every new count recompiles flex and the compiled target: seven
    TTT steps forward and backward, ~3 s each (experiments/pack_probe.sh, H200, 2026-12-01), so
    whole minutes go to compiling before the counts repeat; train.py pads to bucket_rows(R) there.
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
