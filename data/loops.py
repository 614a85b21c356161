"""Where a greedy reply starts looping, so training data can keep a loop's first repeat and drop
the rest.

A 135M target decoding greedily falls into exact loops: a block of p tokens repeated until the
token cap (60% of the default data's replies ran to the cap). Those tokens are nearly free to
predict, so they inflate held-out accuracy, and they crowd out everything else in a fixed token
budget. A draft still has to continue a loop when the target loops at serving time, so the cut
keeps the block and one repeat of it (`loop_cut`) rather than the whole reply up to the loop.
"""

import numpy as np


def loop_cut(ids, max_period: int = 256, min_run: int = 32, keep_min: int = 16) -> int | None:
    """Length to keep of `ids` (a reply's token ids), or None when it never loops.

    A loop of period p is a stretch where ids[i] == ids[i - p] for `need = max(2p, min_run)`
    positions in a row: at least three copies of the block, and for short periods (a repeated
    character, `| --- |` table rules) at least min_run tokens of repetition. Of all periods, the
    loop whose evidence completes first wins; the cut keeps its first copy and one more period
    (at least keep_min tokens), the part a draft learns "continue the loop" from.
    """
    a = np.asarray(ids, dtype=np.int64)
    n, top = len(a), min(max_period, len(a) // 3)
    if top < 1:
        return None
    p = np.arange(1, top + 1)  # [P] periods
    need = np.maximum(2 * p, min_run)  # [P]
    pad = np.concatenate((a, np.full(top, -1)))  # -1 never equals a token id
    eq = np.stack([pad[q : q + n] == a for q in p])  # [P, n]: eq[p-1, i] = a[i + p] == a[i]
    c = np.zeros((top, n + 1), dtype=np.int64)
    np.cumsum(eq, axis=1, out=c[:, 1:])
    j = np.arange(n + 1)  # window start; the window eq[p-1, j : j + need] must lie inside [0, n - p)
    stop = j[None, :] + need[:, None]  # [P, n+1]
    ok = stop <= (n - p)[:, None]
    full = ok & (np.take_along_axis(c, np.minimum(stop, n), axis=1) - c == need[:, None])
    has = full.any(axis=1)
    if not has.any():
        return None
    first = full.argmax(axis=1)  # the first window of each period that repeats
    end = np.where(has, first + p + need, np.iinfo(np.int64).max)  # where that loop's evidence completes
    k = int(end.argmin())  # the loop seen first (ties: the shortest period)
    return int(first[k] + p[k] + max(p[k], keep_min))
