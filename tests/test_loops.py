"""data/loops.py against a brute-force search, on random sequences with planted loops."""

import random

from data.loops import loop_cut


def brute_loop_cut(ids, max_period=256, min_run=32, keep_min=16):
    """The definition, spelled out: for every period p, the first j whose next `need` tokens each
    equal the token p before them; the loop whose evidence ends first wins (ties: shorter p)."""
    best = None
    for p in range(1, min(max_period, len(ids) // 3) + 1):
        need = max(2 * p, min_run)
        for j in range(0, len(ids) - p - need + 1):
            if all(ids[j + p + t] == ids[j + t] for t in range(need)):
                end = j + p + need
                if best is None or end < best[0]:
                    best = (end, j + p + max(p, keep_min))
                break
    return None if best is None else best[1]


def test_loop_cut_matches_brute_force():
    rng = random.Random(0)
    for trial in range(300):
        vocab = rng.choice([3, 8, 50, 1000])  # small vocabularies make accidental repeats
        head = [rng.randrange(vocab) for _ in range(rng.randrange(0, 80))]
        block = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        ids = head + block * rng.randrange(0, 8) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 30))]
        assert loop_cut(ids) == brute_loop_cut(ids), (trial, ids)
        assert loop_cut(ids, max_period=5, min_run=4) == brute_loop_cut(ids, max_period=5, min_run=4), (trial, ids)


def test_loop_cut_keeps_one_repeat():
    head = list(range(100, 140))
    block = list(range(7, 27))  # period 20
    ids = head + block * 10
    cut = loop_cut(ids)
    assert cut == len(head) + 2 * len(block)  # the block and one repeat of it
    assert loop_cut(head + block * 2) is None  # two copies are not yet a loop
    assert loop_cut([]) is None and loop_cut([5, 5]) is None
