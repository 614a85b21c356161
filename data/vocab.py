"""Draft vocabulary: the `draft_vocab_size` target tokens the draft can propose.

  d2t [Vd] int64: target_id = draft_id + d2t[draft_id]   (the serving engines' convention)
  t2d [V]  bool:  t2d[target_id] is True iff the token is in the draft vocabulary

The kept tokens are the most frequent ones under the loss mask (ties broken by lower id), in
ascending id order. When the data has fewer distinct trained tokens than draft_vocab_size,
the rest is filled with the lowest unused ids, so the mapping is always exactly Vd long.
"""

import torch


def count_tokens(examples, vocab_size: int) -> torch.Tensor:
    """counts[v] = how often token v appears at a trained (loss-mask) position."""
    # one bincount over all trained ids: a [vocab_size] bincount per example cost minutes on 41k examples
    ids = [t for e in examples for t, m in zip(e.input_ids, e.loss_mask) if m]
    return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)[:vocab_size].clone()


def build_vocab_mapping(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in [1, target vocab {V}]")
    # stable sort on -count keeps lower ids first among equal counts; zero-count ids come last
    # in id order, which is the fill rule
    order = torch.sort(-counts, stable=True).indices
    kept = order[:draft_vocab_size].sort().values
    d2t = kept - torch.arange(draft_vocab_size)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary, [Vd]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def coverage_rows(outs: list[list[int]], in_vocab: torch.Tensor, windows=()) -> dict:
    """How much of the replies `outs` (token ids, one list per reply) a draft vocabulary can propose,
    for its mask t2d-style `in_vocab` [V] bool: tokens, coverage (share of the tokens inside) and
    window_k for k in `windows` (share of positions whose next k tokens of the same reply are all
    inside: only there can a chain of k drafts be accepted whole)."""
    row = {"tokens": sum(map(len, outs))}
    flags = [in_vocab[torch.tensor(o, dtype=torch.long)] if len(o) else torch.zeros(0, dtype=torch.bool) for o in outs]
    row["coverage"] = round(float(torch.cat(flags).float().mean()), 4) if row["tokens"] else float("nan")
    for k in windows:
        full = sum(int(f.unfold(0, k, 1).all(1).sum()) if len(f) >= k else 0 for f in flags)
        row[f"window_{k}"] = round(full / max(1, sum(max(0, len(f) - k + 1) for f in flags)), 4)
    return row
