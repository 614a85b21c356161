"""The MoE draft MLP (SpecForge's draft-architecture ablation): an EAGLE-3 draft's dense SwiGLU
MLP replaced by routed experts (Eagle3Config's moe_* fields; train.py --moe-*). Sizes per mode
in moe_expert_size, FLOPs in mlp_flops_per_token. State-dict keys under the MLP:
router.weight [E, H], experts.<e>.{gate,up,down}_proj.weight, shared_expert.* (moe_shared).
"""

from typing import Protocol

import torch
from torch import nn

from models.layers import MLP

MOE_MODES = ("flops", "params")


class MoESizes(Protocol):
    """The config fields the MoE MLP reads (Eagle3Config has them; named here so that this module does not
    import the family that uses it)."""

    hidden_size: int
    intermediate_size: int
    moe_experts: int
    moe_top_k: int
    moe_shared: bool
    moe_mode: str


class MoESizeError(ValueError):
    """Expert counts the dense MLP cannot be split into (train.py: one `error:` line)."""


def moe_expert_size(c: MoESizes) -> int:
    """Intermediate size of one expert (the shared one included), from the dense size I:
      flops   I // (top_k + shared): the experts a token runs (top_k routed + the shared one)
              add up to I, so a token costs the dense MLP's FLOPs (+ the router); parameters
              grow with the expert count (E=2..4 top-1: 2..4x the dense MLP's)
      params  I // (E + shared): all experts together hold the dense MLP's parameters; a token
              runs top_k of them (E=2 top-1: half the dense FLOPs)
    Exact when the division is (SmolLM2: I = 1536 divides by 2, 3 and 4)."""
    if c.moe_mode not in MOE_MODES:
        raise ValueError(f"moe_mode must be one of {MOE_MODES}, got {c.moe_mode!r}")
    if not 1 <= c.moe_top_k <= c.moe_experts:
        raise ValueError(f"moe_top_k must be in [1, moe_experts={c.moe_experts}], got {c.moe_top_k}")
    n = (c.moe_top_k if c.moe_mode == "flops" else c.moe_experts) + int(c.moe_shared)
    if c.intermediate_size < n:  # experts 0 wide: a draft with no MLP at all, trained without a word
        raise MoESizeError(
            f"moe_experts {c.moe_experts} ({c.moe_mode} mode{', + shared' if c.moe_shared else ''}): the dense "
            f"intermediate size {c.intermediate_size} split {n} ways leaves experts 0 wide"
        )
    return c.intermediate_size // n


def mlp_flops_per_token(c: MoESizes) -> int:
    """Forward multiply-adds x2 of the draft MLP for one token (router included)."""
    if not c.moe_experts:
        return 2 * 3 * c.hidden_size * c.intermediate_size
    active = (c.moe_top_k + int(c.moe_shared)) * moe_expert_size(c)
    return 2 * 3 * c.hidden_size * active + 2 * c.hidden_size * c.moe_experts


class MoEMLP(nn.Module):
    """The draft MLP as a mixture of experts (SpecForge's MoE-draft ablation; sizes: moe_expert_size).

    router: linear H -> E, softmax in fp32; each token keeps its top_k experts, weighted by their
    softmax probabilities (not renormalised, as in Switch / DeepSeek-MoE, so top-1 routing still
    trains the router); the shared expert (moe_shared) runs on every token with weight 1.
    Load balance: the Switch Transformer loss E * sum_e f_e * P_e (f_e: share of the token-slot
    assignments routed to e, P_e: mean router probability of e; 1 when balanced), left in
    `aux_loss` after each call for the training loss to pick up (weight moe_aux_coef).

    Every expert runs on every token and the unselected outputs get weight 0: no data-dependent
    shapes, so no host syncs and nothing for torch.compile to break on. Training cost therefore
    grows with E whatever the mode; the FLOPs of the *model* are mlp_flops_per_token."""

    def __init__(self, c: MoESizes):
        super().__init__()
        size = moe_expert_size(c)
        self.top_k = c.moe_top_k
        self.router = nn.Linear(c.hidden_size, c.moe_experts, bias=False)
        self.experts = nn.ModuleList(MLP(c.hidden_size, size) for _ in range(c.moe_experts))
        self.shared_expert = MLP(c.hidden_size, size) if c.moe_shared else None
        self.aux_loss = None

    def route(self, x_NH):
        """(gates [N, E] fp32: top-k softmax probabilities, 0 elsewhere; probs [N, E])."""
        probs = self.router(x_NH).float().softmax(-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        return torch.zeros_like(probs).scatter(-1, top_i, top_p), probs

    def forward(self, x):
        x_NH = x.reshape(-1, x.shape[-1])
        gates, probs = self.route(x_NH)
        E = len(self.experts)
        f = (gates > 0).float().mean(0) / self.top_k  # [E] share of assignments
        self.aux_loss = E * (f * probs.mean(0)).sum()
        out = self.shared_expert(x_NH) if self.shared_expert is not None else torch.zeros_like(x_NH)
        for e, expert in enumerate(self.experts):
            out = out + gates[:, e : e + 1].to(x.dtype) * expert(x_NH)
        return out.reshape(x.shape)
