"""EAGLE-3 draft (Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of LLMs via
Training-Time Test") and its training-time-test objective.

Architecture (parameter names are the serving format's, DESIGN.md "Serving formats"):
  fc:        [3*H_t -> H]   fuses three target layers' hidden states
  midlayer:  one Llama decoder layer whose q/k/v read concat(input_layernorm(embed),
             hidden_norm(hidden)) [2H]; residual is the un-normed hidden
  norm, lm_head [H -> Vd]   over the draft vocabulary; d2t/t2d map it to the target's
The token embeddings are the target's (frozen) and are passed in, not owned.

Training-time test (TTT), step k = 0..K-1, position t (features from target position t):
  input embedding  = embed(token t+1+k)
  input hidden     = fc(aux_t) at k = 0, else the step k-1 layer output at t
  rope position    = t + k
  attention        = causal over step-0 keys + the diagonal (position t) of steps 1..k
Packed rows (data/packing.py; the batch's doc_ids / position_ids): t is the position inside its
document (rope restarts), step-0 keys are those of t's own document, and a row is trained only
if token t+2+k is in t's document, so nothing read by a trained row crosses a boundary.
  soft target      = target softmax over the draft vocab at position t+1+k (token t+2+k)
  trained iff      token t+2+k is assistant output and the target's argmax is in the draft vocab
  weight           = 0.8^k

EAGLE-3.1 options (the fields vLLM's llama_eagle3 loader reads): `fc_norm` puts one RMSNorm per
aux source before fc (fc(cat(norm_i(aux_i)))), `norm_output` carries the *normed* layer output to
the next step (and to the next draft position at inference) instead of the pre-norm one.

Objectives (`objective`): kl = soft cross-entropy against the target (KL up to a constant, the
EAGLE-3 recipe); the LK losses (Samarin et al., 2026, "LK Losses: Direct Acceptance Rate
Optimization for Speculative Decoding") optimise the expected acceptance α = Σ_v min(p_v, q_v)
of each trained row directly:
  lk-alpha   loss_k = -log(mean_rows α)                      (batch-mean α of TTT step k)
  lk-lambda  loss_k = w·KL_k + (1 - w)·(1 - mean α),  w = LK_KL_SCALE·exp(-LK_KL_DECAY·mean α)
             (w detached: a trust region that hands over from KL to α as acceptance grows)
The batch mean is over the global batch: the α sums are all-reduced (detached), and each rank's
share of -log(Σα/N) is written so that the ranks' gradients sum to the exact global gradient.
The divergences speculators also trains with, per trained row and then averaged over the rows
like kl (q = the draft's softmax over the draft vocab, p = the target's):
  tv    loss_k = mean_rows ½ Σ_v |p_v - q_v|                 (= 1 - α, per row: LK's α, no log)
  rkl   loss_k = mean_rows KL(q ‖ p)                          (mode seeking)
  jsd   loss_k = mean_rows ½ KL(p ‖ m) + ½ KL(q ‖ m),  m = (p + q) / 2
"""

from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from data.vocab import draft_to_target
from kernels.ce import soft_cross_entropy
from kernels.fused_ce import fused_linear_soft_ce
from kernels.masks import slot_mask
from kernels.ttt_attention import TTTFlexAttention, ttt_attention_eager, ttt_attention_flex, ttt_attention_lse
from models.eagle_serving import EagleServing
from models.family import Family, with_vocab
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
from models.moe import MoEMLP
from models.proposer import Proposer, Tree

# TTT attention paths (same contract, see kernels/ttt_attention.py): eager materialises the
# [T, T] logits (reference); lse = fused causal SDPA + diagonal terms merged by log-sum-exp
# (runs on CPU, has a backward there); flex = one FlexAttention call with the TTT BlockMask
# (GPU; no flex backward on CPU), K/V of all steps so far concatenated anew every step.
# flex_buf: TTTFlexAttention, each step's K/V written once into shared buffers; meant to save the
# concatenations' memory, but measured on the H200 it took more (1.37 vs 0.83 GiB at seq 4096,
# TTT 7; BENCHMARKS.md). Every step's flex now takes the whole buffers (one shape: one compile for the
# unroll, not one per step): on an H100 the main job ends 21 s sooner, but each warm step is 6% slower, so
# flex stays the default (experiments/results/defaults_h100_run2/).
# Each entry makes the attend(q, ks, vs) of one unroll of n steps (flex keeps state across its steps).
ATTENTION = {
    "eager": lambda n: ttt_attention_eager,
    "lse": lambda n: ttt_attention_lse,
    "flex": lambda n: ttt_attention_flex,
    "flex_buf": TTTFlexAttention,
}
# head + loss paths: torch = logits then log_softmax (reference); triton = logits then the
# Triton soft-CE whose backward overwrites the logits in place (plain torch on CPU); fused =
# chunked linear + CE, the [rows, Vd] logits never exist at once.
LOSSES = ("torch", "triton", "fused")
DIVERGENCES = ("tv", "rkl", "jsd")  # per-row divergences, a mean over the trained rows like kl
OBJECTIVES = ("kl", "lk-alpha", "lk-lambda", *DIVERGENCES)
LK_KL_SCALE, LK_KL_DECAY = 1.0, 3.0  # lk-lambda: w = 1 at α = 0, 0.05 at α = 1


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict
    max_position_embeddings: int
    vocab_size: int  # target vocabulary V
    draft_vocab_size: int  # Vd
    target_hidden_size: int
    aux_layers: list[int] = field(default_factory=list)  # 0-based target layers whose outputs feed fc
    hidden_act: str = "silu"
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm per aux source before fc
    norm_output: bool = False  # EAGLE-3.1: carry norm(output) to the next step
    # MoE draft MLP (SpecForge's draft-architecture ablation; see models/moe.py). 0 experts = dense MLP
    moe_experts: int = 0
    moe_top_k: int = 1
    moe_shared: bool = False  # one always-on shared expert next to the routed ones
    moe_mode: str = "flops"  # flops: same active FLOPs as the dense MLP | params: same parameter count
    moe_aux_coef: float = 0.01  # Switch-Transformer load-balancing loss weight

    @classmethod
    def from_target(cls, tc, draft_vocab_size: int, aux_layers: list[int], **options) -> "Eagle3Config":
        """A draft shaped like one layer of the target (the EAGLE-3 recipe)."""
        return cls(
            **layer_shape(tc),
            draft_vocab_size=draft_vocab_size,
            target_hidden_size=tc.hidden_size,
            aux_layers=list(aux_layers),
            **options,
        )

    def to_dict(self) -> dict:
        return asdict(self)


class Attention(Projections):
    def __init__(self, c: Eagle3Config):
        super().__init__(2 * c.hidden_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.mlp = MoEMLP(c) if c.moe_experts else MLP(c.hidden_size, c.intermediate_size)


class Eagle3Draft(nn.Module):
    family = "eagle3"

    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        if c.hidden_act != "silu":
            raise ValueError(f"EAGLE-3 draft supports silu MLPs, the target uses {c.hidden_act}")
        self.fc = nn.Linear(len(c.aux_layers) * c.target_hidden_size, c.hidden_size, bias=False)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.aux_layers)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        inv_freq, self.rope_scale = rope_inv_freq(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    # ---- building blocks shared by training (TTT) and inference (KV-cached drafting) ----
    def project(self, aux):
        """fc over the concatenated aux hidden states [.., n_aux * H_t] (EAGLE-3.1: each source normed)."""
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:
            aux = torch.cat([norm(x) for norm, x in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def carry(self, out):
        """What a layer output hands to the next step / draft position as its hidden input."""
        return self.norm(out) if self.config.norm_output else out

    def rope(self, positions_BT: torch.Tensor, dtype):
        return rope_cos_sin(positions_BT, self.inv_freq, self.rope_scale, dtype)

    def qkv(self, embeds_BTH, hidden_BTH, positions_BT):
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] of one layer pass, rope applied."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        x = torch.cat([layer.input_layernorm(embeds_BTH), layer.hidden_norm(hidden_BTH)], dim=-1)
        q = split_heads(attn.q_proj(x), attn.n_heads, attn.head_dim)
        k = split_heads(attn.k_proj(x), attn.n_kv, attn.head_dim)
        v = split_heads(attn.v_proj(x), attn.n_kv, attn.head_dim)
        cos, sin = self.rope(positions_BT, q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def finish(self, attn_BHTD, hidden_BTH):
        """o_proj + residual + MLP block; returns the layer output (pre final norm)."""
        layer = self.midlayer
        h = hidden_BTH + layer.self_attn.o_proj(merge_heads(attn_BHTD))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, hidden):
        return self.lm_head(self.norm(hidden))

    # ---- inference: one KV-cached pass over new tokens ----
    def decode(self, embeds_BTH, hidden_BTH, positions_BT, past=None, attn_mask=None):
        """Run new tokens against a KV cache. past: (k, v) [B, Hkv, L, D] or None.
        attn_mask: bool [B or 1, 1, T, L + T] (True = attend); None = causal over new tokens
        with full view of the past. Returns (layer output [B, T, H], new past)."""
        q, k, v = self.qkv(embeds_BTH, hidden_BTH, positions_BT)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if attn_mask is None:
            T, L = q.shape[2], k.shape[2]
            attn_mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True)
        return self.finish(out, hidden_BTH), (k, v)

    # ---- training: the TTT unroll ----
    def forward(
        self,
        batch: "Eagle3Batch",
        ttt_length: int,
        counts: torch.Tensor,
        attention: str = "eager",
        loss: str = "torch",
        rows: torch.Tensor | None = None,
        objective: str = "kl",
    ):
        """TTT forward (the training entry point; FSDP hooks run on it). counts [K, 2] = (acc,
        loss) row counts per step, summed over ranks by the caller so that loss_k is a mean over
        the global batch whatever the rank split. rows [K, R] (optional, from select_rows on the
        host): the trained rows of each step, so nothing here waits for the GPU (the default
        selects them on the device with nonzero(), a host sync per step). Returns the weighted
        loss and detached per-step sums {loss_sum, correct} for logging (loss_sum: Σ CE for kl,
        Σ (1 - α) for the LK objectives, Σ divergence for tv / rkl / jsd)."""
        attend = ATTENTION[attention](ttt_length)
        if batch.doc_ids is not None:  # packed rows: step-0 keys of the query's own document only
            attend = _with_documents(attend, batch.doc_ids)
        B, T, _ = batch.embeds.shape
        positions = (
            batch.position_ids
            if batch.position_ids is not None
            else torch.arange(T, device=batch.embeds.device).expand(B, T)
        )
        masks = step_masks(batch, self.t2d, ttt_length) if rows is None else None
        draft_ids = self.draft_ids
        hidden = self.project(batch.aux_hidden)
        ks, vs, total = [], [], 0.0
        loss_sums, correct = [], []
        # kl on host-chosen rows (the fast path): every step's head and loss in one call after the unroll. The
        # Triton CE is kept out of compiled graphs (kernels/ce.py), and a graph break inside this loop made
        # dynamo skip the whole forward and compile its pieces (each step's attention a graph of its own);
        # outside the loop the unroll compiles as one graph, the CE one launch each way for all steps
        deferred = objective == "kl" and rows is not None and loss in ("torch", "triton")
        heads = []  # deferred: per step (h [R, H], the target rows src [R], weight [R], valid [R], top [R])
        for k in range(ttt_length):
            emb = _shift(batch.embeds, 1 + k).to(hidden.dtype)
            q, kk, vv = self.qkv(emb, hidden, positions + k)
            ks.append(kk)
            vs.append(vv)
            out = self.finish(attend(q, ks, vs), hidden)
            if rows is None:  # the head runs only where trained
                acc_mask, loss_mask = masks[k]
                sel = acc_mask.reshape(-1).nonzero().squeeze(1)
                p = _shift(batch.target_p, 1 + k).reshape(B * T, -1)[sel]
                top = _shift(batch.target_top, 1 + k).reshape(-1)[sel]
                weight, valid = loss_mask.reshape(-1)[sel], None
            else:  # row r = (b, t) reads target position t+1+k of the same sequence (t+2+k < T)
                valid = rows[k] >= 0  # -1 = padding to a fixed size
                sel = rows[k].clamp(min=0)
                src = torch.where(valid, sel + 1 + k, 0)
                top = batch.target_top.reshape(-1)[src]
                p = None if deferred else batch.target_p.reshape(B * T, -1)[src]
                weight = valid & self.t2d[top]
            if deferred:
                heads.append((out.reshape(B * T, -1)[sel], src, weight, valid, top))
            elif objective == "kl" or objective in DIVERGENCES:
                h = out.reshape(B * T, -1)[sel]
                if objective == "kl":
                    loss_sum, top_draft = self.head_loss(h, p, weight, loss)
                else:
                    loss_sum, top_draft = self.divergence_loss(h, p, weight, objective)
                total = total + (0.8**k) * loss_sum / counts[k, 1].clamp(min=1)
            else:
                loss_k, loss_sum, top_draft = self.lk_loss(
                    out.reshape(B * T, -1)[sel], p, weight, counts[k, 1], objective
                )
                total = total + (0.8**k) * loss_k
            if self.config.moe_experts:  # load balance, averaged over steps; a share per rank like the rest
                total = total + self.config.moe_aux_coef * self.midlayer.mlp.aux_loss / (ttt_length * _world())
            hidden = self.carry(out)
            if deferred:
                continue
            loss_sums.append(loss_sum.detach())
            # rows the loss skips (target top token outside the draft vocab) report argmax -1
            # from the kernels; the draft cannot be right there anyway
            hit = (top_draft >= 0) & (draft_ids[top_draft.clamp(min=0)] == top)
            correct.append((hit if valid is None else hit & valid).sum())
        if deferred:
            return self._deferred_kl(heads, batch, counts, loss, total)
        return total, {"loss_sum": torch.stack(loss_sums), "correct": torch.stack(correct)}

    def _deferred_kl(self, heads, batch: "Eagle3Batch", counts, impl: str, total):
        """The kl head of every TTT step at once (forward's `deferred`): step k's rows weighted 0.8^k / n_k
        (n_k its global loss-row count), so one weighted sum is the whole loss. heads: per step (h [R, H],
        target rows src [R], weight [R] bool, valid [R] bool, target top [R]); total: what the steps added
        (the MoE balance term). Returns forward's (loss, {loss_sum [K], correct [K]})."""
        K, R = len(heads), heads[0][0].shape[0]
        h, src, weight, valid, top = (torch.cat(x) for x in zip(*heads))  # [K R, ...]
        scale = (0.8 ** torch.arange(K, device=h.device)) / counts[:K, 1].clamp(min=1)  # [K] fp32
        w = weight.float() * scale.repeat_interleave(R)  # [K R]
        target_p = batch.target_p.reshape(-1, batch.target_p.shape[-1])  # [B T, Vd]
        loss_k, top_draft, rows_k = self.head_loss_rows(h, target_p, w, src, impl)
        hit = (top_draft >= 0) & (self.draft_ids[top_draft.clamp(min=0)] == top) & valid
        loss_sum = rows_k.detach().reshape(K, R).sum(1) / scale  # Σ weight · CE per step, for logging
        return total + loss_k, {"loss_sum": loss_sum, "correct": hit.reshape(K, R).sum(1)}

    def head_loss(self, hidden_NH, p_NV, mask_N, impl: str):
        """Σ mask · H(p, softmax(lm_head(norm(h)))) and the draft's argmax per row."""
        if impl == "fused":
            h = self.norm(hidden_NH)
            return fused_linear_soft_ce(h, self.lm_head.weight, p_NV.to(h.dtype), mask_N)
        loss_sum, top, _ = self.head_loss_rows(hidden_NH, p_NV, mask_N, None, impl)
        return loss_sum, top

    def head_loss_rows(self, hidden_NH, p_MV, w_N, t_rows, impl: str):
        """head_loss (torch or triton) with the per-row terms: w_N weights (bool or fp32); row n's target is
        p_MV[n], or with t_rows p_MV[t_rows[n]] (read in place by the Triton CE, no gathered copy; gathered on
        the torch path). Returns (Σ w · CE, the draft's argmax per row, the per-row terms w · CE without
        gradient, for logging)."""
        logits = self.lm_head(self.norm(hidden_NH))
        if impl == "triton":
            if t_rows is None:  # a p of these rows alone, saved for the backward: at the logits' width
                p_MV = p_MV.to(logits.dtype)
            return soft_cross_entropy(logits, p_MV, w_N, return_argmax=True, return_rows=True, t_rows=t_rows)
        logits = logits.float()
        ce = -((p_MV if t_rows is None else p_MV[t_rows]) * logits.log_softmax(-1)).sum(-1) * w_N
        return ce.sum(), logits.argmax(-1), ce.detach()

    def divergence_loss(self, hidden_NH, p_NV, mask_N, objective: str):
        """Σ mask · D(p, q) of one TTT step (tv / rkl / jsd, module docstring) and the draft's argmax
        per row. The probabilities are needed, so the head runs in plain torch whatever --loss says."""
        logits = self.lm_head(self.norm(hidden_NH)).float()
        logq = logits.log_softmax(-1)
        q = logq.exp()
        if objective == "tv":
            d = 0.5 * (p_NV - q).abs().sum(-1)
        elif objective == "rkl":  # p is a softmax, but may underflow to 0 in fp32: log p stays finite
            d = (q * (logq - p_NV.clamp(min=1e-38).log())).sum(-1)
        elif objective == "jsd":
            logm = (0.5 * (p_NV + q)).clamp(min=1e-38).log()
            d = 0.5 * (torch.xlogy(p_NV, p_NV) - p_NV * logm).sum(-1) + 0.5 * (q * (logq - logm)).sum(-1)
        else:
            raise ValueError(f"unknown objective {objective!r}: choose one of {OBJECTIVES}")
        w = mask_N.float()
        return (d * w).sum(), torch.where(w > 0, logits.argmax(-1), -1)

    def lk_loss(self, hidden_NH, p_NV, mask_N, n_global, objective: str):
        """One TTT step of an LK objective -> (this rank's loss term, Σ (1 - α), argmax). The
        probabilities are needed, so the head runs in plain torch whatever --loss says."""
        logits = self.lm_head(self.norm(hidden_NH)).float()
        logq = logits.log_softmax(-1)
        w = mask_N.float()
        alpha = torch.minimum(p_NV, logq.exp()).sum(-1)  # [N] expected acceptance of each row
        s = (alpha * w).sum()
        n = n_global.clamp(min=1).float()
        g = _all_sum(s.detach().clone()).clamp(min=1e-8)  # Σα over the global batch
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if objective == "lk-alpha":
            # value: this rank's share of -log(g / n); gradient: -ds / g (sums to d(-log mean α))
            term = (s.detach() - s) / g - torch.log(g / n) / world
        elif objective == "lk-lambda":
            kl_w = LK_KL_SCALE * torch.exp(-LK_KL_DECAY * g / n)
            ce = -(p_NV * logq).sum(-1)
            term = (kl_w * (ce * w).sum() + (1 - kl_w) * ((1 - alpha) * w).sum()) / n
        else:
            raise ValueError(f"unknown objective {objective!r}: choose one of {OBJECTIVES}")
        top = torch.where(w > 0, logits.argmax(-1), -1)
        return term, ((1 - alpha) * w).sum(), top

    @property
    def draft_ids(self) -> torch.Tensor:
        return draft_to_target(self.d2t)


@dataclass
class Eagle3Batch:
    """Target-side tensors for one TTT forward (all [B, T, ...], right padded)."""

    aux_hidden: torch.Tensor  # [B, T, 3*H_t]
    embeds: torch.Tensor  # [B, T, H]  target embeddings of input_ids (unshifted)
    target_p: torch.Tensor  # [B, T, Vd] target softmax over the draft vocab at each position
    target_top: torch.Tensor  # [B, T] target argmax over the full vocab
    loss_mask: torch.Tensor  # [B, T] 1 = assistant token
    doc_ids: torch.Tensor | None = None  # [B, T] packed rows: document label (-1 = padding); None = one per row
    position_ids: torch.Tensor | None = None  # [B, T] packed rows: position inside the document


@torch.no_grad()
def make_batch(
    features, input_ids, loss_mask, embed_tokens, lm_head, draft_ids, doc_ids=None, position_ids=None
) -> Eagle3Batch:
    # one sequence at a time: the [T, V] target logits (1 GiB at T = 4096, V = 128k, bf16)
    # exist once instead of B times
    B, T = input_ids.shape
    target_p = torch.empty(B, T, draft_ids.numel(), device=input_ids.device, dtype=torch.float32)
    target_top = torch.empty(B, T, device=input_ids.device, dtype=torch.long)
    for b in range(B):
        logits = lm_head(features.final_hidden[b])  # [T, V]
        target_p[b] = logits[:, draft_ids].float().softmax(-1)
        target_top[b] = logits.argmax(-1)
    return Eagle3Batch(
        aux_hidden=features.aux_hidden,
        embeds=embed_tokens(input_ids),
        target_p=target_p,
        target_top=target_top,
        loss_mask=loss_mask,
        doc_ids=doc_ids,
        position_ids=position_ids,
    )


def _with_documents(attend, doc_ids):
    """attend(q, ks, vs) of one TTT unroll restricted to the documents of packed rows."""
    return lambda q, ks, vs: attend(q, ks, vs, doc_ids=doc_ids)


def _all_sum(x):
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(x)
    return x


def _world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def _shift(x, n: int):
    """x[:, t] <- x[:, t + n], zero/False past the end (dim 1 is time)."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def trained(loss_mask_BT: torch.Tensor, k: int, doc_ids_BT: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T] bool: position t is trained at TTT step k (token t+2+k is assistant output and, in
    packed rows, of t's own document)."""
    acc = _shift(loss_mask_BT, 2 + k).bool()
    if doc_ids_BT is not None:
        acc = acc & (_shift(doc_ids_BT, 2 + k) == doc_ids_BT)
    return acc


def step_masks(batch: Eagle3Batch, t2d: torch.Tensor, ttt_length: int):
    """Per TTT step k: (acc_mask, loss_mask) [B, T] bool. acc counts every assistant target;
    the loss drops targets whose argmax the draft vocab cannot express (as SpecForge does)."""
    out = []
    for k in range(ttt_length):
        acc = trained(batch.loss_mask, k, batch.doc_ids)
        out.append((acc, acc & t2d[_shift(batch.target_top, 1 + k)]))
    return out


def select_rows(
    loss_mask_BT: torch.Tensor, ttt_length: int, multiple: int = 256, doc_ids_BT: torch.Tensor | None = None
) -> torch.Tensor:
    """[K, R] int64 flat row indices b*T + t trained at each TTT step (token t+2+k is assistant
    output, in t's document for packed rows), from the loss mask on the host, padded with -1 to
    one size R (a multiple of `multiple`, so compiled shapes repeat). Row counts shrink with k, so R fits every step."""
    B, T = loss_mask_BT.shape
    per_step = [trained(loss_mask_BT, k, doc_ids_BT).reshape(-1).nonzero().squeeze(1) for k in range(ttt_length)]
    R = max(multiple, -(-per_step[0].numel() // multiple) * multiple)
    out = torch.full((ttt_length, R), -1, dtype=torch.long)
    for k, r in enumerate(per_step):
        out[k, : r.numel()] = r
    return out


def local_counts(batch: Eagle3Batch, t2d, ttt_length: int) -> torch.Tensor:
    """[K, 2] (acc rows, loss rows) of this rank's batch; all-reduce it for global counts."""
    return torch.stack([torch.stack([a.sum(), l.sum()]) for a, l in step_masks(batch, t2d, ttt_length)])


# ---------------------------------------------------------------- decoding (evaluate.py, gate.py)
class ChainRows:
    """EAGLE-3 chains for many prompts at once (core/batched_chain.py runs them in lockstep, its target beside
    them; Eagle3Proposer.rows makes one): the draft over its own slot cache: `past` (its KV cache), `valid` [B, S]
    (the slots holding each row's committed entries) and `h_last` [B, 1, H] (the hidden state that proposes
    the next step's first draft)."""

    def __init__(self, draft: Eagle3Draft, embed):
        self.draft, self.embed = draft, embed
        self.dev, self.dtype = draft.fc.weight.device, draft.fc.weight.dtype
        self.draft_ids = draft.draft_ids.to(self.dev)  # [V_draft] draft-vocab id -> target id
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
            slot_mask(torch.zeros(B, 0, dtype=torch.bool, device=self.dev), valid),
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
            slot_mask(self.valid, new_valid),
        )
        self.valid = torch.cat([self.valid, new_valid], 1)
        self.h_last = out.gather(1, n_acc[:, None, None].expand(-1, 1, out.shape[-1]))  # [A, 1, H]

    def keep_rows(self, rows: torch.Tensor):
        self.past = tuple(t.index_select(0, rows) for t in self.past)
        self.valid, self.h_last = self.valid.index_select(0, rows), self.h_last.index_select(0, rows)


class Eagle3Proposer(Proposer):
    """EAGLE-3 drafting with KV cache; chain when topk == 1, else a top-k-per-depth tree."""

    needs_aux = True

    def __init__(self, draft: Eagle3Draft, embed_tokens, depth: int, topk: int = 1):
        if depth < 1 or topk < 1:
            raise ValueError("need depth >= 1 and topk >= 1")
        self.draft, self.embed, self.depth, self.topk = draft.eval(), embed_tokens, depth, topk
        self.name = f"eagle3-chain{depth}" if topk == 1 else f"eagle3-tree{topk}x{depth}"
        self.draft_ids = draft.draft_ids
        self.dtype = draft.fc.weight.dtype
        self.past, self.n_real, self.h_last = None, 0, None

    @property
    def batches(self) -> bool:  # chains only: core/batched_chain.py has no trees
        return self.topk == 1

    def rows(self) -> ChainRows:
        return ChainRows(self.draft, self.embed)

    def _emb(self, tokens: list[int]):
        w = self.embed.weight
        return self.embed(torch.tensor([tokens], device=w.device)).to(self.dtype)

    @torch.no_grad()
    def _catch_up(self, ids: list[int], aux):
        """Feed the committed positions n_real..N-2: draft position t gets fc(aux_t) and
        embed(ids[t+1]); aux holds the rows of exactly those positions."""
        N = len(ids)
        if self.past is not None:  # drop speculative entries
            self.past = tuple(x[:, :, : self.n_real] for x in self.past)
        pos = torch.arange(self.n_real, N - 1, device=aux.device)[None]
        hidden = self.draft.project(aux[None].to(self.dtype))
        out, self.past = self.draft.decode(self._emb(ids[self.n_real + 1 : N]), hidden, pos, self.past)
        self.n_real, self.h_last = N - 1, out[:, -1:]

    def prefill(self, ids, aux):
        self.past, self.n_real = None, 0
        self._catch_up(ids, aux)

    def commit(self, ids, aux):
        self._catch_up(ids, aux)

    @torch.no_grad()
    def propose(self, ids) -> Tree:
        N, k, d = len(ids), self.topk, self.draft
        tree = Tree()
        logp = d.logits(self.h_last[0, -1]).float().log_softmax(-1)  # [Vd]
        top = logp.topk(k)
        frontier = [(float(s), int(t), -1, self.h_last[:, -1:]) for s, t in zip(top.values, top.indices)]
        # (score, draft token, parent node, parent's output [1, 1, H]) -> nodes of depth 1
        past = self.past
        fed: list[int] = []  # draft-cache slot (after the real entries) of each fed tree node, by node index
        anc = []  # per node: list of ancestor node indices (incl. itself)
        for depth in range(1, self.depth + 1):
            nodes = []
            for score, tok, parent, h_parent in frontier:
                tree.tokens.append(int(self.draft_ids[tok]))
                tree.parents.append(parent)
                anc.append((anc[parent] if parent >= 0 else []) + [len(tree) - 1])
                nodes.append((len(tree) - 1, score, h_parent))
            if depth == self.depth:
                break
            # feed this depth's nodes at draft position N-2+depth
            T = len(nodes)
            L = past[0].shape[2]
            mask = torch.zeros(1, 1, T, L + T, dtype=torch.bool, device=self.h_last.device)
            mask[..., : self.n_real] = True
            for r, (i, _, _) in enumerate(nodes):
                for a in anc[i][:-1]:
                    mask[0, 0, r, self.n_real + fed[a]] = True
                mask[0, 0, r, L + r] = True
            emb = self._emb([tree.tokens[i] for i, _, _ in nodes])
            hid = d.carry(torch.cat([h for _, _, h in nodes], dim=1))  # EAGLE-3.1 norm_output carries norm(h)
            pos = torch.full((1, T), N - 2 + depth, device=emb.device)
            out, past = d.decode(emb, hid, pos, past, mask)
            fed.extend(range(L - self.n_real, L - self.n_real + T))
            lp = d.logits(out[0]).float().log_softmax(-1)  # [T, Vd]
            cand = (torch.tensor([s for _, s, _ in nodes], device=lp.device)[:, None] + lp).flatten()
            best = cand.topk(k)
            frontier = []
            for s, flat in zip(best.values.tolist(), best.indices.tolist()):
                r, tok = divmod(flat, lp.shape[1])
                frontier.append((s, tok, nodes[r][0], out[:, r : r + 1]))
        return tree


# ---------------------------------------------------------------- the family contract (models/family.py)
def _build(cfg, target, counts, tokenizer):
    moe = {k: getattr(cfg, k) for k in MOE_OPTIONS}  # MoE draft MLP
    c = Eagle3Config.from_target(
        target.config, cfg.draft_vocab_size, target.aux_layers, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output, **moe
    )
    return with_vocab(Eagle3Draft(c), counts, cfg.draft_vocab_size)


def _host(b, cfg, device, key, first=0):
    if device.type == "cuda":  # host-chosen TTT rows: no nonzero() sync per step on the GPU
        b["rows"] = select_rows(b["loss_mask"], cfg.ttt_length, doc_ids_BT=b.get("doc_ids"))
    return b


def _make_batch(feats, b, target, draft):
    return make_batch(
        feats,
        b["input_ids"],
        b["loss_mask"],
        target.embed_tokens,
        target.lm_head,
        draft.draft_ids,
        b.get("doc_ids"),
        b.get("position_ids"),
    )


def _step(module, batch, counts, cfg, b, schedule):
    if b.get("rows") is not None:
        # rows [K, R]: R (the trained rows, a multiple of 256) changes with every batch. Dynamic from the first
        # call, so the compiled unroll is traced once, not once static then again dynamic at the second batch
        # (~43 s of an H100's cold start, experiments/results/scale_h100/run_g_2000); no effect when eager
        torch._dynamo.maybe_mark_dynamic(b["rows"], 1)
    return module(
        batch,
        cfg.ttt_length,
        counts,
        attention=cfg.attention,
        loss=cfg.loss,
        rows=b.get("rows"),
        objective=cfg.objective,
    )


def _proposer(draft, model, depth, topk):
    return Eagle3Proposer(draft, model.get_input_embeddings(), depth=depth or 3, topk=topk)


@dataclass
class EagleOptions:
    """train.py's options of the EAGLE drafts (eagle3, peagle; core/train_config.py adds them to TrainConfig)."""

    draft_vocab_size: int = 8192
    """the draft's vocabulary: the target tokens most frequent in the training data (its d2t / t2d map)"""
    fc_norm: bool = False
    """EAGLE-3.1: one RMSNorm per aux source before fc"""
    norm_output: bool = False
    """EAGLE-3.1: carry the normed layer output to the next step"""


@dataclass
class Eagle3Options(EagleOptions):
    """eagle3's options: the EAGLE ones and the MoE draft MLP (models/moe.py)."""

    moe_experts: int = 0
    """the draft MLP as a mixture of this many experts, top-k routed (0 = dense; models/moe.py MoEMLP)"""
    moe_top_k: int = 1
    moe_shared: bool = False
    """add one always-on shared expert"""
    moe_mode: str = "flops"
    """flops: the experts a token runs add up to the dense intermediate size (same active FLOPs); params: all
    experts together do (same parameter count)"""
    moe_aux_coef: float = 0.01
    """weight of the Switch-Transformer load-balancing loss"""


MOE_OPTIONS = tuple(f.name for f in fields(Eagle3Options) if f.name.startswith("moe_"))
FAMILY = Family(
    name="eagle3",
    config_cls=Eagle3Config,
    draft_cls=Eagle3Draft,
    objectives=OBJECTIVES,
    options_cls=Eagle3Options,
    build=_build,
    host=_host,
    make_batch=_make_batch,
    counts=lambda batch, draft, cfg: local_counts(batch, draft.t2d, cfg.ttt_length),
    step=_step,
    proposer=_proposer,
    serving=EagleServing(("vllm", "sglang"), "eagle3", speculators=("eagle3", "Eagle3Speculator")),
    attentions=tuple(ATTENTION),
    losses=LOSSES,
    # flex and the in-place Triton CE on a GPU (the fastest step on the H200, BENCHMARKS.md); on the CPU
    # flex has no backward and Triton runs only interpreted
    auto=lambda kind: (
        {"attention": "flex", "loss": "triton"} if kind == "cuda" else {"attention": "lse", "loss": "torch"}
    ),
    packs=True,
    ttt_passes=True,
    decode_depth=True,
)
