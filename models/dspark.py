"""DSpark (Cheng et al., 2026, "DSpark: Confidence-Scheduled Speculative Decoding with
Semi-Autoregressive Generation"; DeepSeek's DeepSpec): a DFlash backbone drafting a whole block in
one parallel pass, then a sequential low-rank Markov head and a confidence head.

Layout (vLLM 0.32 qwen3_dspark.py / v1/worker/gpu/spec_decode/dspark, sample_from_anchor=True):
a block anchored at position a (the newest committed token) holds B = K slots at positions
a .. a+K-1: slot 0 = the anchor token, slots 1..K-1 = the mask token, and EVERY slot predicts
the next token (slot k -> drafted token k = position a + k + 1); DFlash's K + 1 layout instead
predicts only at the mask slots. Same mask as DFlash (context j < a, the block both ways).

Heads (tensor names are vLLM's):
  markov_head.markov_w1  Embedding [V, r]   e_k = w1[x_{k-1}] (x_{-1} = the anchor, then drafted tokens)
  markov_head.markov_w2  [V, r]             logits_k = z_k @ lm_head^T + w2 @ e_k
  confidence_head.proj   Linear(H + r -> 1, bias)   c_k = sigmoid(proj([z_k ; e_k])): predicted
                         probability that drafted token k is accepted given its prefix was
The backbone's z_k is computed once per block; only the rank-r Markov step is sequential.

Training (DeepSpec compute_dspark_loss, teacher-forced prefixes x = the data tokens):
  rows  trained slots whose whole prefix in the block is trained (DeepSpec's cumprod eval mask)
  w_k   = exp(-k / gamma), gamma = 4 (DeepSpec's Qwen3 recipe)
  ce    Σ w·(-log softmax(logits)[label]) / Σ w                           (hard labels)
  l1    Σ w·||softmax(logits) - p_target||_1 / Σ w                        (target distribution)
  conf  Σ w·BCE(c_k logit, α_k) / Σ w,  α_k = 1 - ½||q - p||_1 (detached) = Σ min(p, q), the
        probability that sampling verification accepts the drafted token
  loss  = 0.1·ce + 0.9·l1 + 1.0·conf
acc_k = argmax(logits_k) == label; greedy verification accepts while that holds.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.ce import hard_cross_entropy
from models.block_serving import DSPARK, BlockServing
from models.dflash import (
    BlockBatch,
    BlockOptions,
    BlockProposer,
    DFlashConfig,
    DFlashDraft,
    block_counts,
    block_family_batch,
    block_family_host,
    slot_decay,
    slot_stats,
)
from models.family import PARALLEL_ATTENTIONS, Family, parallel_attention, parallel_auto, pick_mask_token
from models.proposer import Tree

GAMMA, CE_ALPHA, L1_ALPHA, CONF_ALPHA = 4.0, 0.1, 0.9, 1.0  # DeepSpec config/dspark/dspark_qwen3_8_27b.py


@dataclass
class DSparkConfig(DFlashConfig):
    markov_rank: int = 256  # r (DeepSpec's default)
    confidence_with_markov: bool = True  # confidence reads [z ; e] (else z alone)


class MarkovHead(nn.Module):
    def __init__(self, V: int, r: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)  # weight [V, r], as vLLM's ParallelLMHead


class ConfidenceHead(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, 1)


def prefix_rows(weights_BnK: torch.Tensor) -> torch.Tensor:
    """DSpark's trained rows: a slot counts only while every earlier slot of its block is trained."""
    return weights_BnK.cumprod(-1)


class DSparkDraft(DFlashDraft):
    family = "dspark"
    prediction_offset = 0  # the anchor slot predicts drafted token 0

    def __init__(self, config: DSparkConfig):
        super().__init__(config)
        c = config
        self.markov_head = MarkovHead(c.vocab_size, c.markov_rank)
        self.confidence_head = ConfidenceHead(c.hidden_size + (c.markov_rank if c.confidence_with_markov else 0))

    def confidence_logit(self, z_NH, e_Nr):
        x = torch.cat([z_NH, e_Nr], -1) if self.config.confidence_with_markov else z_NH
        w = self.confidence_head.proj.weight  # fp32 in training; the draft's dtype when served (bf16, or fp64 in tests)
        return self.confidence_head.proj(x.to(w.dtype)).float()[:, 0]

    # ---- training ----
    def forward(self, batch: BlockBatch, counts: torch.Tensor, attention: str = "dense", gamma: float = GAMMA):
        """counts [K, 2] (global, of batch.weights: make the batch with prefix_rows applied).
        Returns the loss and per-slot {loss_sum: Σ nll, correct}."""
        if batch.target_p is None:
            raise ValueError("dspark needs make_block_batch(..., target_p=True)")
        K = self.K
        h = self.backbone(batch, attention)  # [B, n, K, H]
        sel = batch.weights > 0
        slot = torch.arange(K, device=h.device).expand_as(sel)[sel]
        z = h[sel]  # [N, H]
        e = self.markov_head.markov_w1(batch.prev_ids[sel])  # [N, r]: teacher-forced previous token
        logits = z @ batch.head.T.to(h.dtype) + self.markov_head.markov_w2(e)  # [N, V]
        labels, p = batch.labels[sel], batch.target_p[sel].float()
        decay = slot_decay(K, gamma, h.device)
        w, denom = decay[slot], (counts[:, 1].float() * decay).sum().clamp(min=1)
        # the CE's backward overwrites logits with their gradient, so it must be their first consumer:
        # autograd runs the later ops' backward first, and under torch.compile the ops after this graph
        # break may save logits themselves (before it, they did: wrong-version error on the H200)
        ce, top, rows = hard_cross_entropy(logits, labels, w, return_argmax=True, return_rows=True)
        nll = rows / w  # per row, no gradient: the logs (the kernel's rows are w · nll, w > 0)
        q = logits.float().softmax(-1)
        tv = (q - p).abs().sum(-1)  # [N] L1 distance
        alpha = (1 - 0.5 * tv.detach()).clamp(0, 1)
        conf = F.binary_cross_entropy_with_logits(self.confidence_logit(z, e), alpha, reduction="none")
        loss = (CE_ALPHA * ce + L1_ALPHA * (w * tv).sum() + CONF_ALPHA * (w * conf).sum()) / denom
        return loss, slot_stats(K, slot, nll, top, labels)

    # ---- inference ----
    @torch.no_grad()
    def block_logits(
        self, anchor_id: int, anchor_pos: int, ctx_kv, embed_tokens, head_VH, tokens: list[int] | None = None
    ):
        """(logits [K, V], confidence [K]) of one block: the parallel backbone, then the Markov
        head left to right. tokens = the drafted tokens to condition on; None = greedy (what vLLM's
        DSparkSpeculator does with draft_sample_method greedy)."""
        z = self.block_hidden(anchor_id, anchor_pos, ctx_kv, embed_tokens)[None]  # [1, K, H]
        dev = z.device
        forced = None if tokens is None else torch.tensor([tokens], device=dev)
        logits, conf = self.head_rows(z, torch.tensor([anchor_id], device=dev), head_VH, forced)
        return logits[0], conf[0]

    def head_rows(self, z_AKH, anchors_A, head_VH, tokens_AK=None):
        """(logits [A, K, V], confidence [A, K]) of A blocks from their drafted slots' states z: the Markov head left
        to right from each anchor, fed the greedy token (tokens_AK None) or the given ones."""
        base = z_AKH @ head_VH.T.to(z_AKH.dtype)
        logits, conf = torch.empty_like(base), torch.empty(base.shape[:2], device=z_AKH.device)
        prev = anchors_A
        for k in range(self.K):
            e = self.markov_head.markov_w1(prev)  # [A, r]
            logits[:, k] = base[:, k] + self.markov_head.markov_w2(e)
            conf[:, k] = torch.sigmoid(self.confidence_logit(z_AKH[:, k], e))
            prev = logits[:, k].argmax(-1) if tokens_AK is None else tokens_AK[:, k]
        return logits, conf

    def greedy_rows(self, z_AKH, anchors_A, embed_tokens, head_VH) -> torch.Tensor:
        return self.head_rows(z_AKH, anchors_A, head_VH)[0].argmax(-1)

    @torch.no_grad()
    def propose(self, anchor_id: int, anchor_pos: int, ctx_kv, embed_tokens, head_VH) -> list[int]:
        return self.block_logits(anchor_id, anchor_pos, ctx_kv, embed_tokens, head_VH)[0].argmax(-1).tolist()


# ---------------------------------------------------------------- decoding (evaluate.py, gate.py)
class DSparkProposer(BlockProposer):
    """DSpark block drafting: the parallel backbone, then the Markov head left to right; the
    confidence head's c_k (acceptance of drafted token k given its prefix) can cut the block
    where the prefix survival Π_{j<=k} c_j drops below min_survival (DSpark's confidence-scheduled
    verification, reduced to one request: fewer tokens to verify, same greedy output). 0 keeps all K;
    a cut proposer's name ends in -cut<threshold> (evaluate.py --min-survival sets it on a built proposer)."""

    def __init__(self, draft, embed_tokens, head_weight, min_survival: float = 0.0, depth: int | None = None):
        super().__init__(draft, embed_tokens, head_weight, "dspark", depth)
        self._uncut_name = self.name
        self.min_survival = min_survival
        self.confidence: list[list[float]] = []  # c_k of every proposed block

    @property
    def min_survival(self) -> float:
        return self._min_survival

    @min_survival.setter
    def min_survival(self, v: float):
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"min_survival must be in [0, 1], got {v}")
        self._min_survival = v
        self.name = self._uncut_name + (f"-cut{v:g}" if v > 0 else "")

    @property
    def batches(self) -> bool:  # a confidence cut verifies a different number of drafts per row: one at a time
        return self.min_survival <= 0

    def propose(self, ids) -> Tree:
        logits, conf = self.draft.block_logits(ids[-1], len(ids) - 1, self.kv, self.embed, self.head)
        toks, survival = logits.argmax(-1).tolist()[: self.depth], conf.cumprod(0).tolist()[: self.depth]
        self.confidence.append(conf.tolist())
        keep = len(toks) if self.min_survival <= 0 else sum(1 for s in survival if s >= self.min_survival)
        return Tree(toks[:keep], list(range(-1, keep - 1)))


# ---------------------------------------------------------------- the family contract (models/family.py)
def _build(cfg, target, counts, tokenizer):  # blocks of K slots: the anchor slot predicts too
    c = DSparkConfig.from_target(
        target.config, target.aux_layers, cfg.ttt_length, pick_mask_token(tokenizer, counts), cfg.draft_layers
    )
    return DSparkDraft(c)


def _make_batch(feats, b, target, draft):
    batch = block_family_batch(feats, b, target, draft, target_p=True)
    batch.weights = prefix_rows(batch.weights)  # DSpark trains a slot only while its block prefix is trained
    return batch


FAMILY = Family(
    name="dspark",
    config_cls=DSparkConfig,
    draft_cls=DSparkDraft,
    objectives=("ce-l1-conf",),
    options_cls=BlockOptions,
    build=_build,
    host=block_family_host,
    make_batch=_make_batch,
    counts=lambda batch, draft, cfg: block_counts(batch),
    step=lambda module, batch, counts, cfg, b, schedule: module(batch, counts, attention=parallel_attention(cfg)),
    proposer=lambda draft, model, depth, topk: DSparkProposer(
        draft, model.get_input_embeddings(), model.get_output_embeddings().weight, depth=depth
    ),
    serving=BlockServing(("vllm",), "dspark", architecture=DSPARK, speculators=("dspark", "DSparkSpeculator")),
    attentions=PARALLEL_ATTENTIONS,
    auto=parallel_auto,
    packs=True,
)
