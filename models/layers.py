"""Layers shared by the drafts (models/eagle3.py, dflash.py and the families built on them) and
the compiled target (models/fast_target.py): one definition of each, so a draft and the target
it trains against normalise and rotate with the same ops in the same order.

Shapes: B batch, T tokens, H hidden, Hq / Hkv query / key-value heads, D head_dim.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn


def _fields(cfg):
    """(need, get) over an HF config object or a config.json dict: `need` raises for a missing key."""
    if isinstance(cfg, dict):
        return cfg.__getitem__, cfg.get
    return (lambda k: getattr(cfg, k)), (lambda k, default=None: getattr(cfg, k, default))


def rope_parameters(cfg) -> dict:
    """A config's rope as our configs hold it (`rope_parameters`), from an HF config or a config.json dict;
    older ones (transformers 4.x and the files it wrote) have rope_theta + rope_scaling instead."""
    _, get = _fields(cfg)
    rope = get("rope_parameters")
    return dict(
        rope or {"rope_type": "default", "rope_theta": get("rope_theta", 10000.0), **(get("rope_scaling") or {})}
    )


def layer_shape(cfg) -> dict:
    """One decoder layer shaped like the target's (the EAGLE-3 and DFlash drafts, the compiled target), from its
    HF config or config.json dict: sizes, heads (kv heads and head_dim derived where a config omits them), norm
    eps, rope, context, vocabulary and activation. The one place these are read from a target's config."""
    need, get = _fields(cfg)
    heads = need("num_attention_heads")
    return {
        "hidden_size": need("hidden_size"),
        "intermediate_size": need("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("num_key_value_heads") or heads,
        "head_dim": get("head_dim") or need("hidden_size") // heads,
        "rms_norm_eps": need("rms_norm_eps"),
        "rope_parameters": rope_parameters(cfg),
        "max_position_embeddings": need("max_position_embeddings"),
        "vocab_size": need("vocab_size"),
        "hidden_act": get("hidden_act") or "silu",
    }


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, in transformers' order of casts: the statistics in fp32, the
    normed x cast back to x's dtype, *then* scaled by the weight (so bf16 outputs match HF's
    bit for bit; the eps inside the rsqrt)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Projections(nn.Module):
    """The q / k / v / o projections of a grouped-query attention, named as in HF's layers (checkpoints load by
    the names): q [d_in -> Hq*D], k and v [d_in -> Hkv*D], o [Hq*D -> H]. EAGLE-3's layer reads d_in = 2H
    (embeddings and fused hidden states side by side); the block drafts and the compiled target read H."""

    def __init__(self, d_in: int, hidden: int, n_heads: int, n_kv: int, head_dim: int, qkv_bias=False, o_bias=False):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(d_in, n_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_in, n_kv * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_in, n_kv * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)


class MLP(nn.Module):
    """SwiGLU MLP [.., hidden] -> [.., hidden]: down(silu(gate(x)) * up(x)), no biases (Llama /
    Qwen; also one expert of models/moe.py's MoEMLP)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------- rope
LOCAL_ROPE = ("default", "linear", "llama3")  # computed here; other rope types through transformers


def rope_inv_freq(c) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, cos/sin scale) of a config with rope_parameters and head_dim (a
    draft's or the target's), exactly as transformers computes them. default, linear and llama3
    are written out (the same ops as transformers' ROPE_INIT_FUNCTIONS, checked bitwise in
    tests/test_fast_target.py); any other rope type HF knows goes through it (needs hidden_size,
    num_attention_heads, max_position_embeddings too)."""
    rope, D = c.rope_parameters, c.head_dim
    kind = rope.get("rope_type", "default")
    if kind not in LOCAL_ROPE:
        from transformers import LlamaConfig  # lazy: transformers (~1.5 s), only for a rope type not written out
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # lazy: as above

        hf = LlamaConfig(
            hidden_size=c.hidden_size,
            num_attention_heads=c.num_attention_heads,
            head_dim=D,
            max_position_embeddings=c.max_position_embeddings,
            rope_parameters=dict(rope),
        )
        return ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D)
    if kind == "linear":
        inv = inv / rope["factor"]
    elif kind == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, a smooth ramp between
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv, 1.0


def rope_cos_sin(positions_BT: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype):
    """cos, sin [B, T, D] in `dtype` for integer positions [B, T]: angles in fp32 (as
    transformers), the two halves repeated (the rotate-half convention of apply_rope), times
    the rope type's scale (1.0 but for e.g. yarn) before the cast."""
    freqs = positions_BT[..., None].float() * inv_freq  # [B, T, D/2] fp32
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x_BHTD, cos_BTD, sin_BTD):
    """Rotate q or k [B, H, T, D] (rotate-half: dims i and i + D/2 form a pair)."""
    half = x_BHTD.shape[-1] // 2
    rotated = torch.cat([-x_BHTD[..., half:], x_BHTD[..., :half]], dim=-1)
    return x_BHTD * cos_BTD[:, None] + rotated * sin_BTD[:, None]


# ------------------------------------------------------------------------------------ attention
def split_heads(x_BTX, n_heads: int, head_dim: int):
    """A q/k/v projection [B, T, n*D] -> heads [B, n, T, D] (a view)."""
    B, T, _ = x_BTX.shape
    return x_BTX.view(B, T, n_heads, head_dim).transpose(1, 2)


def merge_heads(o_BHTD):
    """Attention output [B, H, T, D] -> [B, T, H*D], the o_proj input."""
    B, _, T, _ = o_BHTD.shape
    return o_BHTD.transpose(1, 2).reshape(B, T, -1)


def param_count(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())
