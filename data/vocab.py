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
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        ids = torch.tensor(e.input_ids)
        counts += torch.bincount(ids[torch.tensor(e.loss_mask, dtype=torch.bool)], minlength=vocab_size)
    return counts


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
