"""EAGLE-3 chain drafting for a batch of prompts at once: the same per-prompt steps as
core/speculative.py (Eagle3Proposer with topk 1 + speculative_generate), run in lockstep.

Why: batch-1 decoding is launch-bound on a GPU (the H200 spent 39 ms per verification step of
SmolLM2-135M, almost all of it kernel launches and Python) and weight-bandwidth-bound on a CPU (each
forward streams every weight for 8 tokens). B prompts per forward cost about one.

Ragged rows without moving memory: both KV caches are shared slot arrays [B, H, S, D] that grow by
the same number of slots for every row each step; a per-row bool `valid` [B, S] says which slots
hold that row's committed entries, and every query attends only its row's valid slots (plus its
own causal new slots). Rejected drafts stay in the cache as invalid slots; finished rows leave
the batch (their rows are dropped from both caches).

Per row, the outputs and counters are those of the batch-1 path; numerically the batched matmuls
may round differently, so near-ties can resolve differently (tests compare in float64).
"""

import torch

from core.speculative import SpecStats, cache_kwarg, trim_output
from models.eagle3 import Eagle3Draft


def _causal_new(valid_BS: torch.Tensor, new_valid_BT: torch.Tensor) -> torch.Tensor:
    """Mask [B, 1, T, S + T]: query t of row b sees b's valid old slots and its new slots <= t
    that are valid (a padding query still sees slot 0 of its new block, so no row is empty)."""
    B, T = new_valid_BT.shape
    causal = torch.ones(T, T, dtype=torch.bool, device=valid_BS.device).tril()
    new = causal[None] & (new_valid_BT[:, None, :] | torch.eye(T, dtype=torch.bool, device=valid_BS.device)[None])
    return torch.cat([valid_BS[:, None, :].expand(B, T, -1), new], -1)[:, None]


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
            attention_mask=_causal_new(valid, new_valid),
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


class _Drafter:
    """The EAGLE-3 draft over its own slot cache, in step with _Target: `past` (its KV cache), `valid` [B, S]
    (the slots holding each row's committed entries) and `h_last` [B, 1, H] (the hidden state that proposes
    the next step's first draft)."""

    def __init__(self, draft: Eagle3Draft, embed, dev):
        self.draft, self.embed, self.dev, self.dtype = draft, embed, dev, draft.fc.weight.dtype
        self.draft_ids = draft.draft_ids.to(dev)  # [V_draft] draft-vocab id -> target id
        self.past = self.valid = self.h_last = None

    def prefill(self, nxt: torch.Tensor, aux: torch.Tensor, valid: torch.Tensor, P: torch.Tensor):
        """Draft position t gets fc(aux_t) and embed(ids[t + 1]), t < P_b. nxt [B, Pmax]: each row's ids
        shifted by one; aux [B, Pmax, K * H_target] (K aux layers); valid [B, Pmax]; P [B]: prompt lengths."""
        B, Pmax = nxt.shape
        ar = torch.arange(Pmax, device=self.dev)
        out, self.past = self.draft.decode(
            self.embed(nxt).to(self.dtype),
            self.draft.project(aux.to(self.dtype)),
            ar[None].expand(B, -1),
            None,
            _causal_new(torch.zeros(B, 0, dtype=torch.bool, device=self.dev), valid),
        )
        self.valid = valid
        self.h_last = out[torch.arange(B, device=self.dev), P - 1][:, None]  # [B, 1, H]

    def propose(self, N: torch.Tensor, depth: int) -> torch.Tensor:
        """The chain of `depth` drafts per row, [A, depth] target ids; N [A]: committed lengths."""
        A = N.shape[0]
        # propose: depth 1 from h_last; depth j+1 feeds node j at draft position N - 2 + j
        toks, h, spec = [], self.h_last, self.past
        for j in range(1, depth + 1):
            toks.append(self.draft.logits(h[:, -1]).float().argmax(-1))  # [A] draft-vocab ids
            if j == depth:
                break
            S = spec[0].shape[2]
            mask = torch.cat(
                [self.valid, torch.ones(A, S - self.valid.shape[1] + 1, dtype=torch.bool, device=self.dev)], 1
            )[:, None, None]
            h, spec = self.draft.decode(
                self.embed(self.draft_ids[toks[-1]][:, None]).to(self.dtype),
                self.draft.carry(h),
                (N - 2 + j)[:, None],
                spec,
                mask,
            )
        return self.draft_ids[torch.stack(toks, 1)]  # [A, depth] target ids

    def commit(self, drafts: torch.Tensor, pred: torch.Tensor, n_acc: torch.Tensor, aux: torch.Tensor, N: torch.Tensor):
        """drafts [A, depth], pred [A, T] (the target's argmax), n_acc [A] (accepted drafts), aux [A, T, K * H_target]
        (the verify step's), N [A] (committed lengths before the step)."""
        # commit: the draft catches up over the n+1 new positions N-1 .. N-1+n with their aux rows
        M = int(n_acc.max()) + 1
        m = torch.arange(M, device=self.dev)
        new_valid = m[None] <= n_acc[:, None]  # [A, M]
        hid = self.draft.project(aux[:, :M].to(self.dtype))  # M <= T: the verified rows 0..n (padding: later rows)
        # the tokens fed: the n accepted drafts, then the target's bonus token (padding repeats it)
        bonus = pred.gather(1, n_acc[:, None])  # [A, 1]
        emb_ids = torch.where(m[None] < n_acc[:, None], torch.cat([drafts, bonus], 1)[:, :M], bonus)
        out, self.past = self.draft.decode(
            self.embed(emb_ids).to(self.dtype),
            hid,
            (N - 1)[:, None] + m[None],
            self.past,
            _causal_new(self.valid, new_valid),
        )
        self.valid = torch.cat([self.valid, new_valid], 1)
        self.h_last = out.gather(1, n_acc[:, None, None].expand(-1, 1, out.shape[-1]))  # [A, 1, H]

    def keep_rows(self, rows: torch.Tensor):
        self.past = tuple(t.index_select(0, rows) for t in self.past)
        self.valid, self.h_last = self.valid.index_select(0, rows), self.h_last.index_select(0, rows)


def _keep_rows(target: _Target, drafter: _Drafter, rows: list[int]):
    """Drop the finished rows (rows: the batch indices to keep) from both caches and the draft state."""
    keep = torch.tensor(rows, dtype=torch.long, device=drafter.dev)
    target.keep_rows(keep)
    drafter.keep_rows(keep)


def _prefill(target: _Target, drafter: _Drafter, prompts: list[list[int]], ids: list[list[int]], stats: list):
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


@torch.no_grad()
def batched_chain_generate(
    model, draft: Eagle3Draft, prompts: list[list[int]], depth: int, max_new_tokens: int, eos_ids=()
) -> list[tuple[list[int], SpecStats]]:
    """[(output ids, SpecStats)] per prompt: greedy speculative decoding with a chain of `depth`
    EAGLE-3 drafts per step, all prompts in one batch."""
    dev, eos = model.device, set(eos_ids)
    drafter = _Drafter(draft, model.get_input_embeddings(), dev)
    target = _Target(model.eval(), draft.config.aux_layers)
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
