"""DFlash block-diffusion drafter (Chen et al., 2026, "DFlash: Block Diffusion for Flash
Speculative Decoding") and its objectives: per-slot hard CE (optionally decayed) and D-PACE.

Architecture (names are vLLM's qwen3_dflash.py loader's, DESIGN.md "Serving formats"):
  fc [n_aux*H_t -> H], hidden_norm [H]      context c_j = hidden_norm(fc(aux_j)) for target position j
  layers.i: input_layernorm, self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm (per head),
            post_attention_layernorm, mlp.{gate,up,down}_proj      (Qwen3 decoder layers)
  norm [H]
  the target's embeddings and lm_head (frozen, not owned: the engine shares the target's)
Every layer reads the context through its own k/v projections of c (k_norm and rope on k, no
query), the block tokens through the ordinary residual stream.

A block anchored at sequence position a (a token the target has committed) holds B = K + 1 slots
at positions a .. a+K: slot 0 = the anchor token (clean), slots 1..K = the mask token. Slot k
predicts token a + k (drafted token k-1). The block attends to context keys j < a (the target
has hidden states only for positions before the newest token) and to all of its own slots
(bidirectional); never to another block (kernels/masks.py dflash_mask).

Training (SpecForge's recipe): per sequence up to `num_anchors` random anchors a with a >= 1 and
token a+1 trained (assistant); labels are the data tokens a+1 .. a+K, each trained iff it is
assistant output and inside the sequence.
  ce     loss = Σ w_k·nll / Σ w_k over trained slots, w_k = exp(-(k-1)/gamma) (gamma = loss_decay; 0 = 1)
  dpace  D-PACE (prefix-acceptance-weighted CE): with q_k the draft's (detached) probability of
         the label at slot k, s_k = (1-β)·q_k + β (β = 0.5) and the prefix estimate
         P_k = Π_{j<=k} s_j, slot k is weighted by the detached suffix sum Σ_{j>=k} P_j (the
         expected accepted length its correct prediction unlocks); loss = Σ w·nll / #blocks.
acc_k (k = 0..K-1) = the draft's argmax at slot k+1 equals the data token a+k+1.

Packed rows (data/packing.py): each conversation's anchors are drawn as if it were alone (same
generator, its own loss mask) and moved to its place in its row; a block then sees context only
from its own document (dflash_mask's starts), labels past its document's end are not trained,
and rope positions (context and block) are positions inside the document.
"""

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from data.packing import bucket, pad_rows
from kernels.ce import hard_cross_entropy, nll_rows
from kernels.masks import create_block_mask, dflash_mask, flex_attention_compiled, mask_grid, slot_mask
from models.block_serving import DFLASH, BlockServing
from models.family import PARALLEL_ATTENTIONS, Family, generator, parallel_attention, parallel_auto, pick_mask_token
from models.layers import (
    MLP,
    Projections,
    RMSNorm,
    apply_rope,
    layer_shape,
    merge_heads,
    rope_cos_sin,
    rope_inv_freq,
    split_heads,
)
from models.proposer import Proposer, Tree, verified_depth

OBJECTIVES = ("ce", "dpace")
DPACE_BETA = 0.5  # smoothing of the prefix-acceptance estimate (SpecForge's default)


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    vocab_size: int
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)
    num_layers: int = 1
    block_size: int = 8  # slots per block (dflash/domino: K + 1; dspark: K)
    mask_token_id: int = 0
    hidden_act: str = "silu"

    @classmethod
    def from_target(cls, tc, aux_layers, block_size: int, mask_token_id: int, num_layers: int = 1, **extra):
        """Layers shaped like the target's (the DFlash recipe), a block of block_size slots."""
        return cls(
            **layer_shape(tc),
            target_hidden_size=tc.hidden_size,
            aux_layers=list(aux_layers),
            num_layers=num_layers,
            block_size=block_size,
            mask_token_id=mask_token_id,
            **extra,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class BlockAttention(Projections):
    def __init__(self, c: DFlashConfig):
        super().__init__(c.hidden_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def kv(self, x_BTH, cos, sin):
        """k (k_norm + rope), v [B, Hkv, T, D] of the context or of block tokens."""
        k = apply_rope(self.k_norm(split_heads(self.k_proj(x_BTH), self.n_kv, self.head_dim)), cos, sin)
        return k, split_heads(self.v_proj(x_BTH), self.n_kv, self.head_dim)

    def q(self, x_BTH, cos, sin):
        return apply_rope(self.q_norm(split_heads(self.q_proj(x_BTH), self.n_heads, self.head_dim)), cos, sin)


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = BlockAttention(c)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, x, ctx_k, ctx_v, cos, sin, attend):
        """x [B, Q, H] block tokens; ctx_k/v [B, Hkv, T, D]; attend(q, k, v) over [ctx | block]."""
        a = self.self_attn
        h = self.input_layernorm(x)
        k, v = a.kv(h, cos, sin)
        o = attend(a.q(h, cos, sin), torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2))
        x = x + a.o_proj(merge_heads(o))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class BlockBatch:
    """Target-side tensors of one block-drafter step. n blocks per sequence, bs slots each,
    K drafted tokens per block (drafted token k is sequence position anchor + k + 1)."""

    aux_hidden: torch.Tensor  # [B, T, n_aux*H_t]
    block_embeds: torch.Tensor  # [B, n*bs, H] target embeddings of the block tokens (anchor / mask)
    block_pos: torch.Tensor  # [B, n*bs] rope positions (anchor + slot)
    anchors: torch.Tensor  # [B, n] (0 for unused blocks, which see only themselves)
    anchor_start: torch.Tensor | None  # [B, n] packed rows: where each block's document starts (None: row start)
    ctx_pos: torch.Tensor | None  # [B, T] packed rows: context rope positions inside their documents (None: 0..T-1)
    labels: torch.Tensor  # [B, n, K] data token of drafted token k
    weights: torch.Tensor  # [B, n, K] 1 = trained
    prev_ids: torch.Tensor  # [B, n, K] token before drafted token k (anchor, then labels)
    head: torch.Tensor  # [V, H] the target's lm_head weight (frozen)
    target_p: torch.Tensor | None = None  # [B, n, K, V] target distribution of drafted token k (dspark)
    prev_embeds: torch.Tensor | None = None  # [B, n, K, H] target embeddings of prev_ids (domino)


def sample_anchors(loss_mask: list[int], n: int, gen: torch.Generator) -> list[int]:
    """Up to n distinct anchors a (sorted) with a >= 1 and token a+1 trained; [] if none."""
    valid = [a for a in range(1, len(loss_mask) - 1) if loss_mask[a + 1]]
    if len(valid) <= n:
        return valid
    pick = torch.randperm(len(valid), generator=gen)[:n].sort().values
    return [valid[i] for i in pick.tolist()]


def block_host(b: dict, num_anchors: int, gen_of, bucketed: bool = False, max_len: int | None = None) -> dict:
    """Anchors of a collated or packed batch: b["anchors"] [R, n] (0 = unused block), n = the most
    any row has (<= num_anchors per conversation), and for each block its document's span in the
    row, b["anchor_start"] / b["anchor_end"] [R, n]. gen_of(i) is example i's generator.
    bucketed (compiled flex, whose shapes are the queries n * block size and the keys T + n * block size):
    n rounded up by data/packing.py's bucket, and the rows' length T too, to at most max_len (padding columns;
    a packed row's length is fixed already, conversations are padded to the batch's longest)."""
    if bucketed and max_len:
        T = b["input_ids"].shape[1]
        b = pad_rows(b, max(T, min(bucket(T), max_len)))
    R = b["input_ids"].shape[0]
    if "where" in b:  # packed: example i at (row, start) of its row
        place = [tuple(w) for w in b["where"].tolist()]
        n_of = [int((b["doc_ids"][r] == b["doc_ids"][r, s]).sum()) for r, s in place]
    else:
        place, n_of = [(i, 0) for i in range(R)], b["attention_mask"].sum(1).tolist()
    rows = [[] for _ in range(R)]  # per row: (anchor, document start, document end) of every block
    for i, ((r, s), L) in enumerate(zip(place, n_of)):
        rows[r] += [
            (s + a, s, s + L) for a in sample_anchors(b["loss_mask"][r, s : s + L].tolist(), num_anchors, gen_of(i))
        ]
    n = max(1, max(len(p) for p in rows))
    n = bucket(n) if bucketed else n
    anchors, starts, ends = (torch.zeros(R, n, dtype=torch.long) for _ in range(3))
    for r, blocks in enumerate(rows):
        for j, t in enumerate((anchors, starts, ends)):
            t[r, : len(blocks)] = torch.tensor([x[j] for x in blocks], dtype=torch.long)
    b.update(anchors=anchors, anchor_start=starts, anchor_end=ends)
    return b


@torch.no_grad()
def make_block_batch(
    features,
    input_ids,
    loss_mask,
    attention_mask,
    anchors,
    embed_tokens,
    lm_head,
    K: int,
    block_size: int,
    mask_token_id: int,
    target_p: bool = False,
    prev_embeds: bool = False,
    anchor_start=None,
    anchor_end=None,
    position_ids=None,
) -> BlockBatch:
    """Blocks of block_size slots at the anchors: slot 0 = the anchor token, the rest the mask
    token; positions anchor + slot. DFlash (block_size = K + 1) predicts at slots 1..K, DSpark
    (block_size = K) at slots 0..K-1: either way drafted token k is position anchor + k + 1.
    Packed rows: anchor_start / anchor_end [B, n] (each block's document span in its row) and
    position_ids [B, T] (positions inside the documents); None = one document per row."""
    B, T = input_ids.shape
    n = anchors.shape[1]
    end = attention_mask.sum(1)[:, None] if anchor_end is None else anchor_end  # [B, 1 or n]
    keep = anchors > 0
    slot = torch.arange(block_size, device=input_ids.device)
    ids = torch.full((B, n, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    ids[:, :, 0] = torch.where(keep, input_ids.gather(1, anchors), mask_token_id)
    local = anchors if anchor_start is None else anchors - anchor_start  # anchor position inside its document
    pos = local[:, :, None] + slot
    k = torch.arange(K, device=input_ids.device)
    lab_pos = anchors[:, :, None] + 1 + k  # [B, n, K]
    inside = keep[:, :, None] & (lab_pos < end[:, :, None])  # inside the block's own document
    safe = lab_pos.clamp(max=T - 1).view(B, -1)
    labels = input_ids.gather(1, safe).view(B, n, K)
    weights = (inside & loss_mask.gather(1, safe).view(B, n, K).bool()).float()
    prev = torch.cat([input_ids.gather(1, anchors)[:, :, None], labels[:, :, :-1]], -1)
    tp = None
    if target_p:  # target distribution of token p = softmax(lm_head(final_hidden[p - 1])), full vocab
        h = features.final_hidden.gather(
            1, (safe - 1).clamp(min=0)[:, :, None].expand(-1, -1, features.final_hidden.shape[-1])
        )
        tp = lm_head(h).float().softmax(-1).view(B, n, K, -1)
    return BlockBatch(
        aux_hidden=features.aux_hidden,
        block_embeds=embed_tokens(ids.view(B, -1)),
        block_pos=pos.view(B, -1),
        anchors=anchors,
        anchor_start=anchor_start,
        ctx_pos=position_ids,
        labels=labels,
        weights=weights,
        prev_ids=prev,
        head=lm_head.weight,
        target_p=tp,
        prev_embeds=embed_tokens(prev) if prev_embeds else None,
    )


def block_counts(batch: BlockBatch) -> torch.Tensor:
    """[K, 2] trained rows of each drafted position (accuracy rows = loss rows)."""
    c = batch.weights.gt(0).sum((0, 1))
    return torch.stack([c, c], 1)


def slot_decay(K: int, gamma: float, device) -> torch.Tensor:
    """[K] fp32 loss weights exp(-k/gamma) of a block's slots (gamma 0: all 1). Floored at 1e-30, so a small gamma
    leaves every trained slot a positive weight: the CE kernel's per-row terms w · nll then give back its NLL for
    the logs (an exp that underflowed to 0 made the row untrained and its NLL 0/0)."""
    if gamma <= 0:
        return torch.ones(K, device=device)
    return torch.exp(-torch.arange(K, device=device).float() / gamma).clamp_min(1e-30)


def slot_stats(K: int, slot_N: torch.Tensor, nll_N: torch.Tensor, top_N: torch.Tensor, labels_N: torch.Tensor) -> dict:
    """The block drafters' per-slot logs of N trained slots (slot index, NLL, argmax, label [N]): {loss_sum: Σ nll
    [K] fp32, correct: count of argmax == label [K] int64}."""
    return {
        "loss_sum": torch.zeros(K, device=nll_N.device).index_add_(0, slot_N, nll_N),
        "correct": torch.zeros(K, device=nll_N.device, dtype=torch.long).index_add_(
            0, slot_N, (top_N == labels_N).long()
        ),
    }


def dpace_weights(q_BnK: torch.Tensor, mask_BnK: torch.Tensor, beta: float = DPACE_BETA) -> torch.Tensor:
    """D-PACE slot weights (detached): suffix sums of the smoothed prefix-acceptance estimate.
    Untrained slots are no-ops in the prefix product and absent from the suffix sums."""
    s = torch.where(mask_BnK > 0, (1 - beta) * q_BnK + beta, torch.ones_like(q_BnK))
    prefix = s.cumprod(-1)
    return (prefix * mask_BnK).flip(-1).cumsum(-1).flip(-1)


class DFlashDraft(nn.Module):
    family = "dflash"
    prediction_offset = 1  # slot of drafted token 0 (DSpark: 0)

    def __init__(self, config: DFlashConfig):
        super().__init__()
        c = self.config = config
        if c.hidden_act != "silu":
            raise ValueError(f"DFlash draft supports silu MLPs, the target uses {c.hidden_act}")
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        inv_freq, self.rope_scale = rope_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def K(self) -> int:
        return self.config.block_size - self.prediction_offset

    def rope(self, positions_BT, dtype):
        return rope_cos_sin(positions_BT, self.inv_freq, self.rope_scale, dtype)

    # ---- shared by training and inference ----
    def context(self, aux_BTX):
        """c = hidden_norm(fc(aux)) [B, T, H]: what every layer projects its context k/v from."""
        return self.hidden_norm(self.fc(aux_BTX.to(self.fc.weight.dtype)))

    def context_kv(self, ctx_BTH, positions_BT):
        """Per layer (k, v) [B, Hkv, T, D] of context states (what vLLM precomputes into its cache)."""
        cos, sin = self.rope(positions_BT, ctx_BTH.dtype)
        return [layer.self_attn.kv(ctx_BTH, cos, sin) for layer in self.layers]

    def blocks(self, embeds_BQH, positions_BQ, ctx_kv, attend):
        """Block tokens through the layers -> normed hidden states [B, Q, H]."""
        cos, sin = self.rope(positions_BQ, embeds_BQH.dtype)
        x = embeds_BQH.to(self.fc.weight.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            x = layer(x, k, v, cos, sin, attend)
        return self.norm(x)

    def backbone(self, batch: BlockBatch, attention: str = "dense"):
        """Training forward of every block -> hidden states of the drafted slots [B, n, K, H]."""
        B, T, _ = batch.aux_hidden.shape
        n, bs = batch.anchors.shape[1], self.config.block_size
        ctx = self.context(batch.aux_hidden)
        ctx_pos = batch.ctx_pos if batch.ctx_pos is not None else torch.arange(T, device=ctx.device).expand(B, T)
        kv = self.context_kv(ctx, ctx_pos)
        mask_mod = dflash_mask(
            T, bs, batch.anchors, starts=batch.anchor_start
        )  # packed: context of the block's document only
        if attention == "flex":  # GPU: the block mask as a FlexAttention BlockMask
            bm = create_block_mask(mask_mod, B, None, n * bs, T + n * bs, device=ctx.device)
            attend = lambda q, k, v: flex_attention_compiled(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
        else:  # dense boolean mask [B, 1, Q, T + Q] from the same mask_mod (CPU; O(Q * (T + Q)) bytes)
            m = mask_grid(mask_mod, B, 1, n * bs, T + n * bs, device=ctx.device)
            attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)  # noqa: E731
        h = self.blocks(batch.block_embeds, batch.block_pos, kv, attend)
        off = self.prediction_offset
        return h.view(B, n, bs, -1)[:, :, off : off + self.K]

    # ---- training ----
    def forward(
        self,
        batch: BlockBatch,
        counts: torch.Tensor,
        objective: str = "ce",
        loss_decay: float = 0.0,
        attention: str = "dense",
    ):
        """counts [K, 2] (global). Returns the loss and per-slot {loss_sum: Σ nll, correct}."""
        K = self.K
        h = self.backbone(batch, attention)
        sel = batch.weights > 0  # [B, n, K]
        slot = torch.arange(K, device=h.device).expand_as(sel)[sel]
        logits = h[sel] @ batch.head.T.to(h.dtype)  # [N, V], N = trained slots
        labels = batch.labels[sel]
        nll = None  # per row [N], no gradient: the logs (and D-PACE's weights)
        if objective == "ce":
            decay = slot_decay(K, loss_decay, h.device)
            w = decay[slot]
            denom = (counts[:, 1].float() * decay).sum()
        elif objective == "dpace":  # its weights need the NLL before the loss: one more pass over the logits
            nll = nll_rows(logits, labels)
            q = torch.ones_like(batch.weights)
            q[sel] = torch.exp(-nll)
            w = dpace_weights(q, batch.weights)[sel]
            denom = counts[0, 1].float()  # trained blocks (slot 1 is trained in every kept block)
        else:
            raise ValueError(f"unknown objective {objective!r}: choose one of {OBJECTIVES}")
        loss_sum, top, rows = hard_cross_entropy(logits, labels, w, return_argmax=True, return_rows=True)
        nll = rows / w if nll is None else nll  # the kernel's rows are w · nll (w > 0: slot_decay)
        loss = loss_sum / denom.clamp(min=1)
        return loss, slot_stats(K, slot, nll, top, labels)

    # ---- inference ----
    def block_hidden(self, anchor_id: int, anchor_pos: int, ctx_kv, embed_tokens):
        """One block at anchor_pos (the newest committed token), attending ctx_kv (positions <
        anchor_pos) -> hidden states of its drafted slots [K, H]."""
        dev = self.fc.weight.device
        at = lambda x: torch.tensor([x], device=dev)  # noqa: E731
        return self.block_hidden_rows(at(anchor_id), at(anchor_pos), ctx_kv, None, embed_tokens)[0]

    def block_hidden_rows(self, anchors_A, anchor_pos_A, ctx_kv, ctx_valid_AS, embed_tokens):
        """block_hidden for A rows at once -> [A, K, H]: row a's block sits at anchor_pos_A[a] and attends the
        context slots ctx_valid_AS [A, S] marks as its own (ctx_kv: per layer (k, v) [A, Hkv, S, D]) and itself;
        ctx_valid_AS None: every context slot (one prompt's cache, all of it < anchor_pos)."""
        bs, off = self.config.block_size, self.prediction_offset
        A, dev = anchors_A.shape[0], anchors_A.device
        ids = torch.full((A, bs), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors_A
        pos = anchor_pos_A[:, None] + torch.arange(bs, device=dev)[None]
        # the block sees itself both ways
        mask = None
        if ctx_valid_AS is not None:
            mask = slot_mask(ctx_valid_AS, torch.ones(A, bs, dtype=torch.bool, device=dev), causal=False)
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
        return self.blocks(embed_tokens(ids), pos, ctx_kv, attend)[:, off : off + self.K]

    def greedy_rows(self, z_AKH, anchors_A, embed_tokens, head_VH) -> torch.Tensor:
        """Greedy drafts [A, K] (target ids) from the drafted slots' hidden states (DSpark and Domino add
        their heads, left to right from the anchor)."""
        return (z_AKH @ head_VH.T.to(z_AKH.dtype)).argmax(-1)

    @torch.no_grad()
    def propose(self, anchor_id: int, anchor_pos: int, ctx_kv, embed_tokens, head_VH) -> list[int]:
        """Greedy drafts of one block: K target token ids (one parallel forward)."""
        z = self.block_hidden(anchor_id, anchor_pos, ctx_kv, embed_tokens)[None]
        return self.greedy_rows(z, torch.tensor([anchor_id], device=z.device), embed_tokens, head_VH)[0].tolist()


# ---------------------------------------------------------------- decoding (evaluate.py, gate.py)
class BlockProposer(Proposer):
    """Block drafting (DFlash, Domino: the draft's propose()): each step drafts one block of K tokens anchored at
    the newest committed token (position N-1), in one parallel forward. The draft caches per-layer context k/v of the
    committed positions 0..N-2 (from the target's aux hidden states, like vLLM's context-KV
    precompute) and extends it with the rows the target verified. depth k < K verifies the first k of the
    block (the block still holds all K slots: it attends to itself both ways, so a shorter one is not the
    trained draft)."""

    needs_aux = True
    batches = True  # core/batched_chain.py decodes many prompts at once through rows()

    def __init__(self, draft, embed_tokens, head_weight, family: str = "dflash", depth: int | None = None):
        self.draft, self.embed, self.head = draft.eval(), embed_tokens, head_weight
        self.depth = verified_depth(depth, draft.K)
        self.name = f"{family}-block{draft.K}" + (f"-first{self.depth}" if self.depth < draft.K else "")
        self.kv, self.n_ctx = None, 0

    @torch.no_grad()
    def _catch_up(self, ids, aux):
        N = len(ids)
        ctx = self.draft.context(aux[None])
        new = self.draft.context_kv(ctx, torch.arange(self.n_ctx, N - 1, device=ctx.device)[None])
        self.kv = (
            new
            if self.kv is None
            else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, new)]
        )
        self.n_ctx = N - 1

    def prefill(self, ids, aux):
        self.kv, self.n_ctx = None, 0
        self._catch_up(ids, aux)

    def commit(self, ids, aux):
        self._catch_up(ids, aux)

    def propose(self, ids) -> Tree:
        toks = self.draft.propose(ids[-1], len(ids) - 1, self.kv, self.embed, self.head)[: self.depth]
        return Tree(list(toks), list(range(-1, len(toks) - 1)))

    def rows(self) -> "BlockRows":
        return BlockRows(self.draft, self.embed, self.head)


class BlockRows:
    """Block drafting for many prompts at once (core/batched_chain.py runs it in lockstep with its target; the
    rows' version of BlockProposer): per layer context (k, v) [A, Hkv, S, D] over shared slots, `valid` [A, S] (the
    slots holding each row's committed context: positions 0..N-2) and `last` [A] (each row's newest committed
    token, the next block's anchor at position N - 1)."""

    def __init__(self, draft: DFlashDraft, embed_tokens, head_weight):
        self.draft, self.embed, self.head = draft, embed_tokens, head_weight
        self.dev = draft.fc.weight.device
        self.kv = self.valid = self.last = None

    def prefill(self, nxt, aux, valid, P):
        """The prompts' context: aux [B, Pmax, X] at positions 0..Pmax-1 (valid [B, Pmax]); nxt [B, Pmax] holds each
        row's first new token at P_b - 1 (the first anchor)."""
        B, Pmax = nxt.shape
        ctx = self.draft.context(aux)
        self.kv = self.draft.context_kv(ctx, torch.arange(Pmax, device=self.dev)[None].expand(B, -1))
        self.valid, self.last = valid, nxt[torch.arange(B, device=self.dev), P - 1]

    def propose(self, N, depth: int):
        """The first `depth` drafts of each row's block [A, depth] (target ids); N [A]: committed lengths."""
        z = self.draft.block_hidden_rows(self.last, N - 1, self.kv, self.valid, self.embed)
        return self.draft.greedy_rows(z, self.last, self.embed, self.head)[:, :depth]

    def commit(self, drafts, pred, n_acc, aux, N):
        """The verified rows 0..n_acc of aux [A, T, X] become context at positions N-1 .. N-1+n_acc; the target's
        token after them (pred [A, T] at n_acc) is the next anchor."""
        M = int(n_acc.max()) + 1
        m = torch.arange(M, device=self.dev)
        new = self.draft.context_kv(self.draft.context(aux[:, :M]), (N - 1)[:, None] + m[None])
        self.kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, new)]
        self.valid = torch.cat([self.valid, m[None] <= n_acc[:, None]], 1)
        self.last = pred.gather(1, n_acc[:, None])[:, 0]

    def keep_rows(self, rows):
        self.kv = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.kv]
        self.valid, self.last = self.valid.index_select(0, rows), self.last.index_select(0, rows)


# ---------------------------------------------------------------- the family contract (models/family.py)
@dataclass
class BlockOptions:
    """train.py's options of every block drafter (dflash, domino, dspark; core/train_config.py adds them to
    TrainConfig)."""

    draft_layers: int = 1
    """decoder layers of the block drafter"""
    num_anchors: int = 32
    """blocks per sequence: random anchors on assistant tokens"""


@dataclass
class DFlashOptions(BlockOptions):
    """dflash's and domino's options: the block ones and the slot weighting."""

    loss_decay: float = 0.0
    """weight exp(-(k-1)/gamma) on block slot k (0 = none; dspark always uses gamma 4)"""


def block_family_host(b, cfg, device, key, first=0):
    # flex: compiled once per block count, and the most blocks of any row is a new count nearly every step at
    # --num-anchors 512 (packed rows hold ~one block per reply token): a recompile a step, 5.8 s a step against
    # 0.2 s for a count seen before (2026-12-07, H100, experiments/results/families_probe2_h100/)
    bucketed = parallel_attention(cfg) == "flex"
    return block_host(b, cfg.num_anchors, lambda i: generator(cfg.seed, key, first + i), bucketed, cfg.max_len)


def block_family_batch(feats, b, target, draft, target_p=False, prev_embeds=False):
    c = draft.config
    packed = "doc_ids" in b  # packed rows: each block's document span, positions inside the documents
    return make_block_batch(
        feats,
        b["input_ids"],
        b["loss_mask"],
        b["attention_mask"],
        b["anchors"],
        target.embed_tokens,
        target.lm_head,
        draft.K,
        c.block_size,
        c.mask_token_id,
        target_p=target_p,
        prev_embeds=prev_embeds,
        anchor_start=b["anchor_start"] if packed else None,
        anchor_end=b["anchor_end"] if packed else None,
        position_ids=b.get("position_ids"),
    )


def block_proposer(draft, model, depth=None, topk=1):
    emb, head = model.get_input_embeddings(), model.get_output_embeddings().weight
    return BlockProposer(draft, emb, head, draft.family, depth)


def _build(cfg, target, counts, tokenizer):
    c = DFlashConfig.from_target(
        target.config, target.aux_layers, cfg.ttt_length + 1, pick_mask_token(tokenizer, counts), cfg.draft_layers
    )
    return DFlashDraft(c)


def _step(module, batch, counts, cfg, b, schedule):
    return module(batch, counts, objective=cfg.objective, loss_decay=cfg.loss_decay, attention=parallel_attention(cfg))


FAMILY = Family(
    name="dflash",
    config_cls=DFlashConfig,
    draft_cls=DFlashDraft,
    objectives=OBJECTIVES,
    options_cls=DFlashOptions,
    build=_build,
    host=block_family_host,
    make_batch=block_family_batch,
    counts=lambda batch, draft, cfg: block_counts(batch),
    step=_step,
    proposer=block_proposer,
    serving=BlockServing(("vllm",), "dflash", architecture=DFLASH, speculators=("dflash", "DFlashSpeculator")),
    attentions=PARALLEL_ATTENTIONS,
    auto=parallel_auto,
    packs=True,
)
