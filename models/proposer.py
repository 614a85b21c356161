"""The drafting interface the speculative decoding loop (core/speculative.py) drives: a proposer keeps
the draft's own KV cache, proposes a Tree of target token ids from the committed ids, and catches
up on the rows the target verified. Each family's proposer lives in its file in models/; this
base proposes nothing (plain greedy decoding through the same loop: the τ = 1 baseline)."""

from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    """Draft tokens (target ids) and their parents (-1 = the root, i.e. the last committed
    token); parents come before children. A chain is parents = [-1, 0, 1, ...]."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)

    def __len__(self):
        return len(self.tokens)

    def depths(self) -> list[int]:
        d = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    def ancestors_mask(self) -> torch.Tensor:
        """bool [n, n]: row i attends node j iff j is i or an ancestor of i."""
        n = len(self)
        m = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            m[i, i] = True
            if p >= 0:
                m[i] |= m[p]
        return m


class Proposer:
    """No drafts: plain greedy decoding through the same loop (the τ = 1 baseline)."""

    name = "none"
    needs_aux = False
    # True: rows() gives the draft side for many prompts at once, which core/batched_chain.py runs in lockstep
    # (evaluate.py --batch; EAGLE-3 chains, P-EAGLE, DFlash / DSpark / Domino blocks); else one prompt at a time
    batches = False

    def rows(self):
        raise NotImplementedError(f"{self.name} decodes one prompt at a time")

    def prefill(self, ids: list[int], aux):
        pass

    def propose(self, ids: list[int]) -> Tree:
        return Tree()

    def commit(self, ids: list[int], aux):
        pass


def verified_depth(depth: int | None, K: int) -> int:
    """The drafted tokens a fixed-K proposer (block, parallel) verifies: `depth`, at most the K it
    was trained for (None = K)."""
    if depth is None:
        return K
    if not 1 <= depth <= K:
        raise ValueError(f"this draft proposes K = {K} tokens per step: verify 1..{K} of them, not {depth}")
    return depth
