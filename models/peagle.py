"""P-EAGLE: parallel drafting with an EAGLE-3 draft (Amazon, 2026, "P-EAGLE: Parallel Drafting
EAGLE with Scalable Training"; vLLM's parallel_drafting for EAGLE-3, llama_eagle3.py).

The draft is an EAGLE-3 draft (same layer, same serving names) plus `mask_hidden` [n_aux * H_t],
a learned stand-in for the aux hidden states of positions the target has not run yet. At
inference, after the ordinary EAGLE-3 catch-up over committed positions (draft position t fed
embed(token t+1) and fc(aux_t); the last one, N-2, predicts token N), depths d = 1..K-1 are
drafted in the same forward: slot d sits at position N-2+d, is fed embed(mask token) and
fc(mask_hidden), attends to every committed position and causally to slots 1..d, and predicts
token N+d. K tokens for one draft forward (vLLM: speculative_config parallel_drafting=True).

Training (the paper's COD sampling, SpecForge's peagle.py): one flattened sequence per example
holds every depth-0 element (position t, fed as above, trained toward the target's distribution
of token t+2) and, for depth d >= 1, rollouts anchored at a random subset of positions p (a
fraction max(0.7^d, 0.2) of the trained ones, nested in depth d-1's so every rollout is complete
up to its depth): element (p, d) at rope position p+d, fed the mask token and mask_hidden,
trained toward the target's distribution of token p+2+d. Attention is kernels/masks.py's
peagle_mask: depth-0 elements see depth-0 elements at positions <= their own; (p, d) sees depth-0
elements at positions <= p and (p, 1..d). Loss: soft CE over the draft vocabulary (EAGLE-3's),
a mean over all trained elements; acc_d per depth (draft argmax mapped by d2t == target argmax).

Packed rows (data/packing.py): each conversation's rollouts are drawn as if it were alone (same
generator, its own loss mask), then moved to its place in its row: pos is the row position, the
element's doc its document label (peagle_mask keeps documents apart), its rope position and the
"token p+2+d exists" test are relative to its own document (start / end).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from data.packing import bucket
from kernels.masks import create_block_mask, flex_train, mask_grid, peagle_mask, slot_mask
from models.eagle3 import ChainRows, Eagle3Config, Eagle3Draft, Eagle3Proposer, EagleOptions
from models.eagle_serving import EagleServing
from models.family import (
    PARALLEL_ATTENTIONS,
    Family,
    generator,
    parallel_attention,
    parallel_auto,
    pick_mask_token,
    with_vocab,
)
from models.proposer import Tree, verified_depth

DOWN_SAMPLE_RATIO, DOWN_SAMPLE_MIN = 0.7, 0.2


@dataclass
class PEagleConfig(Eagle3Config):
    mask_token_id: int = 0
    depths: int = 4  # K: tokens drafted per forward


class PEagleDraft(Eagle3Draft):
    family = "peagle"

    def __init__(self, config: PEagleConfig):
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.randn(len(config.aux_layers) * config.target_hidden_size))

    @property
    def K(self) -> int:
        return self.config.depths

    def forward(self, batch: "PEagleBatch", counts: torch.Tensor, attention: str = "dense"):
        """counts [K, 2] (global). Returns the mean soft CE over trained elements and per-depth
        {loss_sum, correct}."""
        B, L = batch.pos.shape
        is0 = (batch.depth == 0)[..., None]
        aux = torch.where(is0, batch.aux_hidden.to(self.mask_hidden.dtype), self.mask_hidden)
        hidden = self.project(aux)
        q, k, v = self.qkv(
            batch.embeds.to(hidden.dtype), hidden, batch.pos - batch.start + batch.depth
        )  # rope: inside the document
        mask_mod = peagle_mask(batch.pos, batch.depth, batch.doc)
        if attention == "flex":
            bm = create_block_mask(mask_mod, B, None, L, L, device=q.device)
            attn = flex_train(q, k, v, bm, enable_gqa=True)
        else:  # dense [B, 1, L, L]; padding rows (see nothing) attend to themselves to stay finite
            m = mask_grid(mask_mod, B, 1, L, L, device=q.device) | (batch.doc < 0)[:, None, :, None] & torch.eye(
                L, dtype=torch.bool, device=q.device
            )
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        out = self.finish(attn, hidden)
        sel = batch.acc_mask.reshape(-1).nonzero().squeeze(1)
        weight = batch.loss_mask.reshape(-1)[sel]
        depth = batch.depth.reshape(-1)[sel]
        p, top = batch.target_p.reshape(B * L, -1)[sel], batch.target_top.reshape(-1)[sel]
        logits = self.logits(out.reshape(B * L, -1)[sel]).float()
        ce = -(p * logits.log_softmax(-1)).sum(-1) * weight
        loss = ce.sum() / counts[:, 1].sum().clamp(min=1)
        hit = self.draft_ids[logits.argmax(-1)] == top
        K = self.K
        stats = {
            "loss_sum": torch.zeros(K, device=out.device).index_add_(0, depth, ce.detach()),
            "correct": torch.zeros(K, device=out.device, dtype=torch.long).index_add_(0, depth, hit.long()),
        }
        return loss, stats


@dataclass
class PEagleBatch:
    """One flattened sequence of L elements per example (right padded: doc = -1)."""

    pos: torch.Tensor  # [B, L] anchor position p (depth 0: its own position t)
    depth: torch.Tensor  # [B, L]
    doc: torch.Tensor  # [B, L] document label of the element (packed rows: several per row), -1 = padding
    start: torch.Tensor  # [B, L] row position where the element's document starts (0 unless packed)
    embeds: torch.Tensor  # [B, L, H] embed(token t+1) at depth 0, embed(mask token) at depth > 0
    aux_hidden: torch.Tensor  # [B, L, n_aux*H_t] aux_t at depth 0 (zeros elsewhere: mask_hidden is used)
    target_p: torch.Tensor  # [B, L, Vd] target distribution (draft vocab) of token p+2+d
    target_top: torch.Tensor  # [B, L] target argmax of token p+2+d
    acc_mask: torch.Tensor  # [B, L] bool: token p+2+d is assistant output
    loss_mask: torch.Tensor  # [B, L] float: acc_mask and the target's argmax is in the draft vocab


def sample_rollouts(loss_mask: list[int], K: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """(pos, depth) of one example's elements: depth 0 at every position t with a next token
    (t <= n-2), then the nested random rollouts of depths 1..K-1."""
    n = len(loss_mask)
    pos, depth = list(range(n - 1)), [0] * (n - 1)
    prev = list(range(n - 1))
    for d in range(1, K):
        trained = [p for p in range(n - 1) if p + 2 + d < n and loss_mask[p + 2 + d]]
        cand = [p for p in prev if p + 2 + d < n and loss_mask[p + 2 + d]]
        size = min(len(cand), int(len(trained) * max(DOWN_SAMPLE_RATIO**d, DOWN_SAMPLE_MIN)))
        if size <= 0:
            break
        prev = sorted(cand[i] for i in torch.randperm(len(cand), generator=gen)[:size].tolist())
        pos += prev
        depth += [d] * len(prev)
    return pos, depth


def peagle_host(b: dict, K: int, gen_of, bucketed: bool = False) -> dict:
    """The flattened element sequences of a collated or packed batch: pe_pos, pe_depth, pe_doc,
    pe_start, pe_end [rows, L] (end: where the element's document ends in its row; L = the most elements
    of any row, bucketed: rounded up by data/packing.py's bucket)."""
    R, T = b["input_ids"].shape
    if "where" in b:  # packed: example i at (row, start) of its row, its labels from doc_ids
        place = [tuple(w) for w in b["where"].tolist()]
        n_of = [int((b["doc_ids"][r] == b["doc_ids"][r, s]).sum()) for r, s in place]
    else:
        place, n_of = [(i, 0) for i in range(R)], b["attention_mask"].sum(1).tolist()
    rows = [[] for _ in range(R)]  # per row: its elements (pos, depth, doc, start, end), one document after another
    for i, ((r, s), n) in enumerate(zip(place, n_of)):
        p, d = sample_rollouts(b["loss_mask"][r, s : s + n].tolist(), K, gen_of(i))  # as if alone: same draws
        label = int(b["doc_ids"][r, s]) if "where" in b else 0
        rows[r] += [(s + x, dd, label, s, s + n) for x, dd in zip(p, d)]
    L = max(1, max(len(e) for e in rows))
    L = bucket(L) if bucketed else L
    out = torch.zeros(5, R, L, dtype=torch.long)  # pos, depth, doc, start, end
    out[2] = -1  # padding elements
    for r, elems in enumerate(rows):
        if elems:
            out[:, r, : len(elems)] = torch.tensor(elems, dtype=torch.long).T
    b.update(pe_pos=out[0], pe_depth=out[1], pe_doc=out[2], pe_start=out[3], pe_end=out[4])
    return b


@torch.no_grad()
def make_peagle_batch(
    features,
    input_ids,
    loss_mask,
    pos,
    depth,
    doc,
    embed_tokens,
    lm_head,
    draft_ids,
    t2d,
    mask_token_id,
    start=None,
    end=None,
) -> PEagleBatch:
    """start / end [B, L]: the element's document span in its row (default: the whole row)."""
    B, T = input_ids.shape
    start = torch.zeros_like(pos) if start is None else start
    end = torch.full_like(pos, T) if end is None else end
    valid = doc >= 0
    tgt = (pos + 1 + depth).clamp(max=T - 1)  # position whose target logits predict token p+2+d
    lab = (pos + 2 + depth).clamp(max=T - 1)
    tok = torch.where(depth == 0, input_ids.gather(1, (pos + 1).clamp(max=T - 1)), mask_token_id)
    aux = features.aux_hidden.gather(1, pos[..., None].expand(-1, -1, features.aux_hidden.shape[-1]))
    aux = torch.where(((depth == 0) & valid)[..., None], aux, 0)
    target_p = torch.empty(B, pos.shape[1], draft_ids.numel(), device=input_ids.device)
    target_top = torch.empty(B, pos.shape[1], dtype=torch.long, device=input_ids.device)
    for b in range(B):  # one sequence at a time: the [L, V] target logits exist once
        logits = lm_head(features.final_hidden[b, tgt[b]])
        target_p[b] = logits[:, draft_ids].float().softmax(-1)
        target_top[b] = logits.argmax(-1)
    inside = valid & (pos + 2 + depth < end)  # token p+2+d exists in the element's own document
    acc = inside & loss_mask.gather(1, lab).bool()
    return PEagleBatch(
        pos=pos,
        depth=depth,
        doc=doc,
        start=start,
        embeds=embed_tokens(tok),
        aux_hidden=aux,
        target_p=target_p,
        target_top=target_top,
        acc_mask=acc,
        loss_mask=(acc & t2d[target_top]).float(),
    )


def peagle_counts(batch: PEagleBatch, K: int) -> torch.Tensor:
    """[K, 2] (accuracy rows, loss rows) per depth."""
    d = batch.depth
    return torch.stack(
        [torch.stack([(batch.acc_mask & (d == k)).sum(), ((batch.loss_mask > 0) & (d == k)).sum()]) for k in range(K)]
    )


# ---------------------------------------------------------------- decoding (evaluate.py, gate.py)
class PEagleProposer(Eagle3Proposer):
    """P-EAGLE parallel drafting: the EAGLE-3 catch-up, then K tokens from one draft forward:
    depth 0 from the last committed position's output, depths 1..K-1 from K-1 slots at positions
    N-1 .. N+K-3 fed the mask token and fc(mask_hidden), attending the draft cache and causally
    to each other (vLLM's parallel_drafting layout). depth k < K drafts the first k (the slots are
    causal, so they are the first k of the K)."""

    batches = True  # core/batched_chain.py runs it through rows() (ParallelRows)

    def __init__(self, draft, embed_tokens, depth: int | None = None):
        super().__init__(draft, embed_tokens, depth=verified_depth(depth, draft.K))
        self.name = f"peagle-parallel{draft.K}" + (f"-first{self.depth}" if self.depth < draft.K else "")

    @torch.no_grad()
    def propose(self, ids) -> Tree:
        d, N, K = self.draft, len(ids), self.depth
        toks = [int(d.logits(self.h_last[0, -1]).argmax())]
        if K > 1:
            emb = self._emb([d.config.mask_token_id] * (K - 1))
            hid = d.project(d.mask_hidden.to(self.dtype)).expand(1, K - 1, -1)
            pos = torch.arange(N - 1, N + K - 2, device=emb.device)[None]
            out, _ = d.decode(emb, hid, pos, self.past)  # causal among the slots, full view of the cache
            toks += d.logits(out[0]).argmax(-1).tolist()
        return Tree([int(self.draft_ids[t]) for t in toks], list(range(-1, K - 1)))

    def rows(self) -> "ParallelRows":
        return ParallelRows(self.draft, self.embed)


class ParallelRows(ChainRows):
    """P-EAGLE drafting for many prompts at once: EAGLE-3's rows (the same cache and catch-up), proposing each
    row's tokens from one parallel forward as PEagleProposer.propose does."""

    def propose(self, N, depth: int):
        d, A = self.draft, N.shape[0]
        toks = [d.logits(self.h_last[:, -1]).float().argmax(-1)[:, None]]  # [A, 1] draft-vocab ids
        if depth > 1:
            ids = torch.full((A, depth - 1), d.config.mask_token_id, dtype=torch.long, device=self.dev)
            hid = d.project(d.mask_hidden.to(self.dtype)).expand(A, depth - 1, -1)
            pos = (N - 1)[:, None] + torch.arange(depth - 1, device=self.dev)[None]
            new = torch.ones(A, depth - 1, dtype=torch.bool, device=self.dev)  # causal among the slots
            out, _ = d.decode(self.embed(ids).to(self.dtype), hid, pos, self.past, slot_mask(self.valid, new))
            toks.append(d.logits(out).float().argmax(-1))  # [A, depth - 1]
        return self.draft_ids[torch.cat(toks, 1)]  # [A, depth] target ids


# ---------------------------------------------------------------- the family contract (models/family.py)
def _build(cfg, target, counts, tokenizer):
    c = PEagleConfig.from_target(
        target.config,
        cfg.draft_vocab_size,
        target.aux_layers,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        mask_token_id=pick_mask_token(tokenizer, counts),
        depths=cfg.ttt_length,
    )
    return with_vocab(PEagleDraft(c), counts, cfg.draft_vocab_size)


def _make_batch(feats, b, target, draft):
    return make_peagle_batch(
        feats,
        b["input_ids"],
        b["loss_mask"],
        b["pe_pos"],
        b["pe_depth"],
        b["pe_doc"],
        target.embed_tokens,
        target.lm_head,
        draft.draft_ids,
        draft.t2d,
        draft.config.mask_token_id,
        b["pe_start"],
        b["pe_end"],
    )


FAMILY = Family(
    name="peagle",
    config_cls=PEagleConfig,
    draft_cls=PEagleDraft,
    objectives=("kl",),
    options_cls=EagleOptions,
    build=_build,
    # flex compiles once per element count L: bucketed, or a new L (and a recompile) nearly every step (dflash.py's
    # block_family_host)
    host=lambda b, cfg, device, key, first=0: peagle_host(
        b, cfg.ttt_length, lambda i: generator(cfg.seed, key, first + i), parallel_attention(cfg) == "flex"
    ),
    make_batch=_make_batch,
    counts=lambda batch, draft, cfg: peagle_counts(batch, cfg.ttt_length),
    step=lambda module, batch, counts, cfg, b, schedule: module(batch, counts, attention=parallel_attention(cfg)),
    proposer=lambda draft, model, depth, topk: PEagleProposer(draft, model.get_input_embeddings(), depth),
    # vLLM drafts P-EAGLE as EAGLE-3 with parallel_drafting (SGLang has no parallel drafting here)
    serving=EagleServing(
        ("vllm",),
        "eagle3",
        {"parallel_drafting": True},
        speculators=("peagle", "PEagleSpeculator"),
        missing="SGLang has no EAGLE-3 parallel drafting here",
    ),
    attentions=PARALLEL_ATTENTIONS,
    auto=parallel_auto,
    packs=True,
)
