"""Speculative decoding for a batch of prompts at once: the same per-prompt steps as core/speculative.py
(a proposer verified as a chain + speculative_generate), run in lockstep. The target side lives here; the
draft side is the proposer's `rows()` (models/eagle3.py ChainRows: EAGLE-3 chains; models/peagle.py ParallelRows;
models/dflash.py BlockRows: DFlash, DSpark and Domino blocks), which keeps each row's draft state over shared slots
the same way.

Why: batch-1 decoding is launch-bound on a GPU (the H200 spent 39 ms per verification step of
SmolLM2-135M, almost all of it kernel launches and Python) and weight-bandwidth-bound on a CPU (each
forward streams every weight for 8 tokens). B prompts per forward cost about one.

Ragged rows without moving memory: the KV caches are shared slot arrays [B, H, S, D] that grow by
the same number of slots for every row each step; a per-row bool `valid` [B, S] says which slots
hold that row's committed entries, and every query attends only its row's valid slots (plus its
own causal new slots: kernels/masks.slot_mask). Rejected drafts stay in the cache as invalid slots;
finished rows leave the batch (their rows are dropped from both caches).

Per row, the outputs and counters are those of the batch-1 path; numerically the batched matmuls
may round differently, so near-ties can resolve differently (tests compare in float64).

A drafter (`rows()`) has: prefill(nxt [B, Pmax], aux [B, Pmax, X], valid [B, Pmax], P [B]) (the prompts; nxt is
each row's ids shifted by one, so nxt[b, P_b - 1] is its first new token), propose(N [A], depth) -> [A, depth]
target ids (N: committed lengths), commit(drafts, pred [A, T], n_acc [A], aux [A, T, X], N) (the verified
step) and keep_rows(rows [A']).
"""

import torch

from core.speculative import SpecStats, cache_kwarg, trim_output
from kernels.masks import slot_mask
from models.eagle3 import ChainRows, Eagle3Draft


class _Target:
    """An HF causal LM over a slot cache: forward(ids [B, T], positions [B, T], new_valid [B, T])."""

    def __init__(self, model, aux_layers):
        from transformers import DynamicCache  # lazy: transformers (~1.5 s) stays out of evaluate.py --help

        self.model, self.aux_layers, self.kw = model, aux_layers, cache_kwarg(model)
        self.cache = DynamicCache(config=model.config)
        self.valid = None  # [B, S]

    @torch.no_grad()
    def forward(self, ids, positions, new_valid):
        B = ids.shape[0]
        valid = self.valid if self.valid is not None else torch.zeros(B, 0, dtype=torch.bool, device=ids.device)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=slot_mask(valid, new_valid),
            use_cache=True,
            output_hidden_states=True,
            **{self.kw: self.cache},
        )
        self.valid = torch.cat([valid, new_valid], 1)
        aux = torch.cat([out.hidden_states[i + 1] for i in self.aux_layers], -1)
        return out.logits.float(), aux

    def keep_rows(self, rows: torch.Tensor):
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
        self.valid = self.valid.index_select(0, rows)


def _keep_rows(target: _Target, drafter, rows: list[int]):
    """Drop the finished rows (rows: the batch indices to keep) from both caches and the draft state."""
    keep = torch.tensor(rows, dtype=torch.long, device=drafter.dev)
    target.keep_rows(keep)
    drafter.keep_rows(keep)


def _prefill(target: _Target, drafter, prompts: list[list[int]], ids: list[list[int]], stats: list):
    """Both caches take the prompts; each row's first new token is appended to ids[b] (its stats count the
    forward)."""
    dev, B = drafter.dev, len(prompts)
    P = torch.tensor([len(p) for p in prompts], device=dev)
    Pmax = int(P.max())
    ar = torch.arange(Pmax, device=dev)

    # prefill: right-padded prompts; row b's first new token is its argmax at position P_b - 1
    x = torch.zeros(B, Pmax, dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        x[b, : len(p)] = torch.tensor(p, device=dev)
    valid = ar[None] < P[:, None]
    logits, aux = target.forward(x, ar[None].expand(B, -1), valid)
    first = logits[torch.arange(B, device=dev), P - 1].argmax(-1).tolist()
    for b in range(B):
        ids[b].append(first[b])
        stats[b].target_forwards += 1

    # draft prefill: draft position t gets fc(aux_t) and embed(ids[t + 1]), t < P_b
    nxt = torch.zeros(B, Pmax, dtype=torch.long, device=dev)
    for b in range(B):
        nxt[b, : len(prompts[b])] = torch.tensor(ids[b][1:], device=dev)
    drafter.prefill(nxt, aux, valid, P)


def _verify(target: _Target, last: list[int], drafts: torch.Tensor, N: torch.Tensor):
    """The target scores each row's chain; returns (pred [A, T]: its argmax, n_acc [A]: accepted drafts,
    aux [A, T, K * H_target]). last [A]: the rows' last committed tokens; drafts [A, depth]; N [A]: committed
    lengths."""
    A, T, dev = drafts.shape[0], drafts.shape[1] + 1, drafts.device
    # verify: [last committed token] + drafts at positions N - 1 + (0..depth)
    x = torch.cat([torch.tensor(last, device=dev)[:, None], drafts], 1)
    pos = (N - 1)[:, None] + torch.arange(T, device=dev)[None]
    logits, aux = target.forward(x, pos, torch.ones(A, T, dtype=torch.bool, device=dev))
    pred = logits.argmax(-1)  # [A, T]
    match = (drafts == pred[:, :-1]).long().cumprod(1)
    n_acc = match.sum(1)  # accepted drafts per row (chain: a prefix)
    target.valid[:, -T:] = torch.arange(T, device=dev)[None] <= n_acc[:, None]  # root + accepted rows stay
    return pred, n_acc, aux


def batched_chain_generate(
    model, draft: Eagle3Draft, prompts: list[list[int]], depth: int, max_new_tokens: int, eos_ids=()
) -> list[tuple[list[int], SpecStats]]:
    """[(output ids, SpecStats)] per prompt: greedy speculative decoding with a chain of `depth`
    EAGLE-3 drafts per step, all prompts in one batch."""
    rows = ChainRows(draft, model.get_input_embeddings())
    return batched_generate(model, rows, draft.config.aux_layers, prompts, depth, max_new_tokens, eos_ids)


@torch.no_grad()
def batched_generate(
    model, drafter, aux_layers, prompts: list[list[int]], depth: int, max_new_tokens: int, eos_ids=()
) -> list[tuple[list[int], SpecStats]]:
    """[(output ids, SpecStats)] per prompt: greedy speculative decoding, `depth` drafts verified per step as a
    chain, all prompts in one batch. drafter: a proposer's rows() (the module doc says what it has); aux_layers:
    the target layers whose outputs the draft reads."""
    dev, eos = model.device, set(eos_ids)
    target = _Target(model.eval(), aux_layers)
    B = len(prompts)
    ids = [list(p) for p in prompts]
    stats = [SpecStats(prompts=1) for _ in prompts]
    _prefill(target, drafter, prompts, ids, stats)

    active = [b for b in range(B) if not (ids[b][-1] in eos or max_new_tokens <= 1)]
    if len(active) < B:
        _keep_rows(target, drafter, active)
    while active:
        A = len(active)
        N = torch.tensor([len(ids[b]) for b in active], device=dev)  # committed lengths
        drafts = drafter.propose(N, depth)  # [A, depth] target ids
        pred, n_acc, aux = _verify(target, [ids[b][-1] for b in active], drafts, N)
        n_list, pred_l, drafts_l = n_acc.tolist(), pred.tolist(), drafts.tolist()

        still = []
        for i, b in enumerate(active):
            n = n_list[i]
            new = drafts_l[i][:n] + [pred_l[i][n]]
            stats[b].add_step(depth, n)
            ids[b] += new
            if not (any(t in eos for t in new) or len(ids[b]) - len(prompts[b]) >= max_new_tokens):
                still.append(i)

        drafter.commit(drafts, pred, n_acc, aux, N)
        if len(still) < A:  # finished rows leave the batch
            _keep_rows(target, drafter, still)
            active = [active[i] for i in still]

    results = []
    for b in range(B):
        out_ids = trim_output(ids[b][len(prompts[b]) :], eos, max_new_tokens)
        stats[b].new_tokens = len(out_ids)
        results.append((out_ids, stats[b]))
    return results
