"""Muon for the draft's hidden matrices, AdamW for everything else, as one torch Optimizer (so the LR
schedule, the distributed checkpoint state dict and exact resume treat it like AdamW).

Muon (Jordan et al. 2024; the scaled form of Liu et al. 2025, "Muon is scalable for LLM training"):
for a weight W [out, in] with gradient G,
    B <- mu B + G;  U = G + mu B (Nesterov);  O = NS5(U) (the nearest semi-orthogonal matrix, 5
    Newton-Schulz steps on U / ||U||_F);  W <- W (1 - lr wd) - lr * 0.2 sqrt(max(out, in)) * O.
The 0.2 sqrt(max(out, in)) factor gives the update the RMS of an AdamW update, so --lr and
--weight-decay mean the same with either optimizer. speculators trains its drafts with Muon by
default; here it is `train.py --optimizer muon`.

Which matrices: the 2-D weights inside the draft (attention, MLP, the fc that projects the
target's concatenated hidden states); the output head (`lm_head`) and embeddings stay on AdamW, as
in Muon's own recipe. FSDP2 (DTensor) parameters: each rank orthogonalises the full matrix (the
draft's matrices are small) and keeps its own shard of the result, so every rank applies the same
update as one rank would.
"""

import math

import torch

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic iteration of Muon's reference implementation


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """g [m, n] -> approximately U V^T of g's SVD (singular values pushed into ~[0.5, 1.5], not onto 1:
    the quintic trades exactness for speed), in fp32."""
    a, b, c = NS_COEFFS
    x = g.float() / (g.float().norm() + eps)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide orientation: the Gram matrix is the smaller one
        x = x.T
    for _ in range(steps):
        s = x @ x.T
        x = a * x + (b * s + c * s @ s) @ x
    return x.T if tall else x


def muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether parameter `name` is trained by Muon: 2-D and not the output head or an embedding."""
    return p.ndim == 2 and "lm_head" not in name and "embed" not in name


class MuonAdamW(torch.optim.Optimizer):
    """Groups with muon=True take the Muon update above, the others AdamW's (decoupled decay)."""

    def __init__(self, groups, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, momentum: float = 0.95):
        super().__init__(groups, dict(lr=lr, betas=betas, eps=eps, momentum=momentum, weight_decay=0.0, muon=False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if group["muon"]:
                    self._muon(p, state, lr, wd, group["momentum"])
                else:
                    self._adamw(p, state, lr, wd, group["betas"], group["eps"])
        return loss

    @staticmethod
    def _muon(p, state, lr, wd, mu):
        g = p.grad
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        buf = state["momentum_buffer"]
        buf.mul_(mu).add_(g)
        u = g.add(buf, alpha=mu)
        if hasattr(u, "full_tensor"):  # DTensor (FSDP2): orthogonalise the whole matrix, keep this shard
            from torch.distributed.tensor import distribute_tensor  # torchrun only: DTensors exist under FSDP2

            o = distribute_tensor(newton_schulz(u.full_tensor()), u.device_mesh, u.placements)
        else:
            o = newton_schulz(u)
        scale = 0.2 * math.sqrt(max(p.shape[0], p.shape[1]))
        p.mul_(1 - lr * wd).add_(o.to(p.dtype), alpha=-lr * scale)

    @staticmethod
    def _adamw(p, state, lr, wd, betas, eps):
        g = p.grad
        if "step" not in state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(g)
            state["exp_avg_sq"] = torch.zeros_like(g)
        state["step"] += 1
        t = state["step"].item()
        b1, b2 = betas
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v / (1 - b2**t)).sqrt_().add_(eps)
        p.mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - b1**t))


def muon_groups(named_params, weight_decay: float) -> list[dict]:
    """Muon on the hidden matrices (with weight decay), AdamW on the head/embeddings (with weight decay)
    and on vectors (without), the same decay split train.py uses for AdamW."""
    named = [(n, p) for n, p in named_params if p.requires_grad]
    muon = [p for n, p in named if muon_matrix(n, p)]
    mats = [p for n, p in named if p.ndim >= 2 and not muon_matrix(n, p)]
    vecs = [p for n, p in named if p.ndim < 2]
    return [
        {"params": muon, "weight_decay": weight_decay, "muon": True},
        {"params": mats, "weight_decay": weight_decay, "muon": False},
        {"params": vecs, "weight_decay": 0.0, "muon": False},
    ]


def lr_at(step: int, cfg, total: int) -> float:
    """The factor on --lr at `step` of `total`: linear warmup over cfg.warmup steps, then cosine down to
    cfg.min_lr_ratio (cfg: train.py's TrainConfig)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, total - cfg.warmup)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
