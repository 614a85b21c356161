"""data/vocab.coverage_rows (experiments/vocab_coverage.py's and evaluate.py's counting): coverage
and full-window shares on hand-made replies."""

import torch

from data.vocab import coverage_rows


def test_coverage_and_windows_by_hand():
    inside = torch.zeros(10, dtype=torch.bool)
    inside[[1, 2, 3]] = True
    # reply a: 1 2 9 3 (3 of 4 inside; windows of 3: [1 2 9] no, [2 9 3] no)
    # reply b: 1 2 3 (all inside; one window of 3, full); reply c: 3 (no window of 3)
    outs = [[1, 2, 9, 3], [1, 2, 3], [3]]
    row = coverage_rows(outs, inside, windows=(1, 3))
    assert row["tokens"] == 8
    assert row["coverage"] == round(7 / 8, 4) == row["window_1"]
    assert row["window_3"] == round(1 / 3, 4)  # windows: 2 in a, 1 in b, 0 in c; only b's is full
    assert coverage_rows([[5, 6]], inside, windows=(3,))["window_3"] == 0.0  # too short for any window
    assert coverage_rows([[]], inside)["coverage"] != coverage_rows([[]], inside)["coverage"]  # nan: no tokens
