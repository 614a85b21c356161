"""Domino (Huang et al., 2026, "Domino: Decoupling Causal Modeling from Autoregressive Drafting
in Speculative Decoding", arXiv 2605.29707; code github.com/jianuo-huang/Domino): the DFlash
block drafter (models/dflash.py, unchanged: blocks of K + 1 slots, clean anchor first) plus a
light causal correction head over the block's previous tokens.

Head (names as the authors' checkpoints and SGLang rollout use them):
  prefix_gru  nn.GRU(E -> G), one layer, over the frozen target embeddings of the tokens before
              each drafted token: drafted token k (k = 0..K-1) reads s_k = GRU state after
              [anchor, t_0, .., t_{k-1}] (teacher-forced with the data tokens in training,
              the draft's own greedy tokens at inference)
  embed_proj  Linear(H + G -> r), SiLU, Linear(r -> V): a rank-r residual on the logits
    base_k  = z_k @ lm_head^T                          (z_k: backbone output of drafted token k)
    final_k = base_k + embed_proj([z_k ; s_k])   for k >= 1;   final_0 = base_0
  Drafted token 0 has no drafted predecessor, so the authors' rollout takes it from the base
  logits; we train it the same way (no correction at k = 0).

Loss (the paper's "base-anchored curriculum"): L = (1 - λ)·CE(base) + λ·CE(final), each the
DFlash per-slot CE (optional exp decay, normalised by the decay-weighted trained-slot count);
λ ramps linearly from 0 to 1 over the first RAMP of training (progress = step / total steps),
so the parallel backbone is learned first and the head then takes over the residual. The paper
describes the ramp as linear from the base to the corrected distribution; its exact length is
not public in what we could read, RAMP = 0.5 is our choice (README, 'Draft families').
acc_k / loss_k in the logs are those of the final (corrected) logits: what the proposer drafts.
No inference engine we can reach loads Domino drafts (vLLM 0.32 has no loader; the authors ship an
SGLang fork), so export.py refuses them; evaluate.py drafts with them in PyTorch.
"""

from dataclasses import dataclass

import torch
from torch import nn

from kernels.ce import hard_cross_entropy
from models.dflash import (
    BlockBatch,
    DFlashConfig,
    DFlashDraft,
    DFlashOptions,
    block_counts,
    block_family_batch,
    block_family_host,
    block_proposer,
    slot_decay,
    slot_stats,
)
from models.family import PARALLEL_ATTENTIONS, Family, parallel_attention, parallel_auto, pick_mask_token

RAMP = 0.5  # fraction of training over which λ goes 0 -> 1


def curriculum(progress: float, ramp: float = RAMP) -> float:
    """λ of the base-anchored curriculum at a training progress in [0, 1]."""
    return min(1.0, max(0.0, progress / ramp)) if ramp > 0 else 1.0


@dataclass
class DominoConfig(DFlashConfig):
    gru_size: int = 256  # G
    correction_rank: int = 256  # r: width of embed_proj's bottleneck


class DominoDraft(DFlashDraft):
    family = "domino"

    def __init__(self, config: DominoConfig):
        super().__init__(config)
        c = config
        # the GRU reads the target's embeddings (width = target hidden size, as in make_block_batch)
        self.prefix_gru = nn.GRU(c.target_hidden_size, c.gru_size, num_layers=1, batch_first=True)
        self.embed_proj = nn.Sequential(
            nn.Linear(c.hidden_size + c.gru_size, c.correction_rank),
            nn.SiLU(),
            nn.Linear(c.correction_rank, c.vocab_size),
        )

    def _apply(self, fn, recurse=True):
        # torch's RNNs no longer flatten their weights when moved or cast (RNNBase._apply only re-reads them):
        # cuDNN then copies the four weights into one buffer at every call and warns each step (H100, 2026-12-07).
        # Flattened once here, after each .to() / .cuda() (a no-op off cuDNN).
        out = super()._apply(fn, recurse)
        self.prefix_gru.flatten_parameters()
        return out

    def correction(self, z_NH, s_NG):
        """Logit residual [N, V] of drafted slots with backbone states z and GRU states s."""
        return self.embed_proj(torch.cat([z_NH, s_NG.to(z_NH.dtype)], -1))

    # ---- training ----
    def forward(
        self,
        batch: BlockBatch,
        counts: torch.Tensor,
        progress: float = 1.0,
        loss_decay: float = 0.0,
        attention: str = "dense",
    ):
        """counts [K, 2] (global). Returns the curriculum loss and per-slot {loss_sum, correct} of
        the corrected logits."""
        if batch.prev_embeds is None:
            raise ValueError("domino needs make_block_batch(..., prev_embeds=True)")
        K = self.K
        h = self.backbone(batch, attention)  # [B, n, K, H]
        B, n = h.shape[:2]
        s, _ = self.prefix_gru(batch.prev_embeds.reshape(B * n, K, -1).to(h.dtype))  # [B*n, K, G]: s_k after prev 0..k
        sel = batch.weights > 0
        slot = torch.arange(K, device=h.device).expand_as(sel)[sel]
        z = h[sel]  # [N, H]
        head = batch.head.T.to(h.dtype)
        corr = self.correction(z, s.view(B, n, K, -1)[sel]) * (slot > 0)[:, None].to(h.dtype)  # none at k = 0
        labels = batch.labels[sel]
        decay = slot_decay(K, loss_decay, h.device)
        w, denom = decay[slot], (counts[:, 1].float() * decay).sum().clamp(min=1)
        lam = curriculum(progress)
        final = z @ head + corr  # [N, V]
        loss_final, top, rows = hard_cross_entropy(final, labels, w, return_argmax=True, return_rows=True)
        nll = rows / w  # per row, no gradient: the logs (the kernel's rows are w · nll, w > 0)
        loss = lam * loss_final / denom
        if lam < 1:  # base logits recomputed: the CE kernel's backward overwrites its input
            loss = loss + (1 - lam) * hard_cross_entropy(z @ head, labels, w) / denom
        return loss, slot_stats(K, slot, nll, top, labels)

    # ---- inference ----
    def gru_rows(self, emb_AE, state_AG):
        """One GRU step for A rows: embeddings [A, E], states [A, G] (None: zero) -> new states [A, G]."""
        h0 = None if state_AG is None else state_AG[None]
        _, s = self.prefix_gru(emb_AE[:, None].to(self.fc.weight.dtype), h0)
        return s[0]

    @torch.no_grad()
    def block_logits(
        self, anchor_id: int, anchor_pos: int, ctx_kv, embed_tokens, head_VH, tokens: list[int] | None = None
    ):
        """(base, final) logits [K, V] of one block. tokens = the K drafted tokens to condition the
        head on (teacher forcing); None = greedy: each drafted token is the argmax of its final
        logits and feeds the GRU for the next one."""
        z = self.block_hidden(anchor_id, anchor_pos, ctx_kv, embed_tokens)[None]  # [1, K, H]
        dev = z.device
        forced = None if tokens is None else torch.tensor([tokens], device=dev)
        base, final = self.head_rows(z, torch.tensor([anchor_id], device=dev), embed_tokens, head_VH, forced)
        return base[0], final[0]

    def head_rows(self, z_AKH, anchors_A, embed_tokens, head_VH, tokens_AK=None):
        """(base, final) logits [A, K, V] of A blocks: the GRU reads each anchor, then each drafted token (the
        greedy one, or tokens_AK's), and corrects the slots after the first."""
        base = z_AKH @ head_VH.T.to(z_AKH.dtype)
        final = base.clone()
        s = self.gru_rows(embed_tokens(anchors_A), None)  # after the anchor
        for k in range(self.K):
            if k > 0:
                final[:, k] += self.correction(z_AKH[:, k], s)
            t = final[:, k].argmax(-1) if tokens_AK is None else tokens_AK[:, k]
            if k + 1 < self.K:
                s = self.gru_rows(embed_tokens(t), s)
        return base, final

    def greedy_rows(self, z_AKH, anchors_A, embed_tokens, head_VH) -> torch.Tensor:
        """Greedy drafts [A, K]: one parallel backbone forward, then K - 1 cheap GRU steps."""
        return self.head_rows(z_AKH, anchors_A, embed_tokens, head_VH)[1].argmax(-1)

    @torch.no_grad()
    def propose(self, anchor_id: int, anchor_pos: int, ctx_kv, embed_tokens, head_VH) -> list[int]:
        """Greedy drafts of one block: one parallel backbone forward, then K - 1 cheap GRU steps."""
        _, final = self.block_logits(anchor_id, anchor_pos, ctx_kv, embed_tokens, head_VH)
        return final.argmax(-1).tolist()


# ---------------------------------------------------------------- the family contract (models/family.py)
def _build(cfg, target, counts, tokenizer):
    c = DominoConfig.from_target(
        target.config, target.aux_layers, cfg.ttt_length + 1, pick_mask_token(tokenizer, counts), cfg.draft_layers
    )
    return DominoDraft(c)


def _step(module, batch, counts, cfg, b, schedule):  # the schedule drives the base -> corrected curriculum
    return module(batch, counts, progress=schedule, loss_decay=cfg.loss_decay, attention=parallel_attention(cfg))


FAMILY = Family(
    name="domino",
    config_cls=DominoConfig,
    draft_cls=DominoDraft,
    objectives=("ce",),
    options_cls=DFlashOptions,
    build=_build,
    host=block_family_host,
    make_batch=lambda feats, b, target, draft: block_family_batch(feats, b, target, draft, prev_embeds=True),
    counts=lambda batch, draft, cfg: block_counts(batch),
    step=_step,
    proposer=block_proposer,
    serving=None,
    attentions=PARALLEL_ATTENTIONS,
    auto=parallel_auto,
    packs=True,  # no engine loader (vLLM 0.32 has none)
)
