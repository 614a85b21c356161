import torch

from data.vocab import build_vocab_mapping, count_tokens, draft_to_target
from tests.tiny import random_examples


def test_round_trip_and_most_frequent_kept():
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 50, (300,), generator=g)
    counts[::7] = 0
    d2t, t2d = build_vocab_mapping(counts, 64)
    ids = draft_to_target(d2t)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.sum() == 64
    assert torch.equal(torch.nonzero(t2d).squeeze(1), ids)  # t2d marks exactly the d2t targets
    assert bool((ids[1:] > ids[:-1]).all())  # ascending target ids
    # draft id -> target id -> draft id round trip
    t2d_index = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(t2d_index[ids], torch.arange(64))
    # every kept token is at least as frequent as every dropped one
    assert counts[t2d].min() >= counts[~t2d].max()


def test_ties_break_to_lower_ids():
    counts = torch.tensor([5, 3, 3, 3, 1])
    d2t, t2d = build_vocab_mapping(counts, 3)
    assert draft_to_target(d2t).tolist() == [0, 1, 2]


def test_fewer_unique_tokens_than_draft_vocab():
    counts = torch.zeros(100, dtype=torch.long)
    counts[[90, 40, 7]] = torch.tensor([3, 2, 1])
    d2t, t2d = build_vocab_mapping(counts, 10)
    ids = draft_to_target(d2t).tolist()
    assert len(ids) == 10 and {90, 40, 7} <= set(ids)
    assert sorted(set(ids) - {90, 40, 7}) == [0, 1, 2, 3, 4, 5, 6]  # filled with the lowest unused ids


def test_counts_only_trained_positions():
    ex = random_examples(20, 50, seed=3)
    c = count_tokens(ex, 50)
    ref = torch.zeros(50, dtype=torch.long)
    for e in ex:
        for i, m in zip(e.input_ids, e.loss_mask):
            ref[i] += m
    assert torch.equal(c, ref)
