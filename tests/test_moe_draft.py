"""MoE draft MLP (models/moe.py MoEMLP): forward and every gradient against a per-token loop,
the parameter / FLOPs equalities that define the ablation's settings, the load-balancing loss,
the TTT forward against the brute-force drafter, an overfit run, and export's refusal."""

import json

import pytest
import torch
from safetensors.torch import save_file

from data.vocab import build_vocab_mapping, count_tokens
from export import ExportError, export, load_checkpoint
from models.eagle3 import Eagle3Config, Eagle3Draft, local_counts, make_batch, step_masks
from models.layers import param_count
from models.moe import MoEMLP, mlp_flops_per_token, moe_expert_size
from tests.test_eagle3_ttt import brute_force
from tests.tiny import tiny_target_batch

H, I = 24, 48  # I divides by 2, 3, 4 and 5


def config(**kw) -> Eagle3Config:
    return Eagle3Config(
        hidden_size=H,
        intermediate_size=I,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=128,
        vocab_size=50,
        draft_vocab_size=20,
        target_hidden_size=H,
        aux_layers=[0, 1, 2],
        **kw,
    )


def reference(mlp: MoEMLP, x_NH):
    """Token by token: softmax router, top-k experts by a sort, weighted sum + shared expert."""
    out = []
    for x in x_NH:
        probs = torch.softmax(mlp.router(x).float(), -1)
        order = sorted(range(len(probs)), key=lambda e: -probs[e].item())[: mlp.top_k]
        y = mlp.shared_expert(x) if mlp.shared_expert is not None else torch.zeros_like(x)
        for e in order:
            ex = mlp.experts[e]
            y = y + probs[e] * ex.down_proj(torch.nn.functional.silu(ex.gate_proj(x)) * ex.up_proj(x))
        out.append(y)
    return torch.stack(out)


SETTINGS = [
    (2, 1, False, "params"),
    (3, 1, False, "flops"),
    (4, 2, True, "flops"),
    (3, 1, True, "params"),
    (4, 1, True, "flops"),
]


@pytest.mark.parametrize("E,k,shared,mode", SETTINGS)
def test_moe_matches_per_token_loop(E, k, shared, mode):
    torch.manual_seed(E * 10 + k)
    mlp = MoEMLP(config(moe_experts=E, moe_top_k=k, moe_shared=shared, moe_mode=mode))
    x = torch.randn(3, 7, H, requires_grad=True)  # odd shapes
    w = torch.randn(3, 7, H)
    y = mlp(x)
    ref = reference(mlp, x.reshape(-1, H)).reshape(x.shape)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    params = [x, *mlp.parameters()]
    g = torch.autograd.grad((y * w).sum(), params)
    r = torch.autograd.grad((ref * w).sum(), params)
    names = ["x"] + [n for n, _ in mlp.named_parameters()]
    for name, a, b in zip(names, g, r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert g[names.index("router.weight")].abs().sum() > 0  # top-1 still trains the router


def test_parameter_and_flops_equalities():
    dense = config()
    dense_mlp = Eagle3Draft(dense).midlayer.mlp
    dense_params, dense_flops = param_count(dense_mlp), mlp_flops_per_token(dense)
    assert dense_params == 3 * H * I and dense_flops == 6 * H * I

    def experts_only(c):  # parameters and FLOPs without the router
        mlp = MoEMLP(c)
        return param_count(mlp) - param_count(mlp.router), mlp_flops_per_token(c) - 2 * H * c.moe_experts

    # same parameters: 2 experts of I/2, top-1 (half the dense FLOPs)
    p, f = experts_only(config(moe_experts=2, moe_mode="params"))
    assert p == dense_params and f == dense_flops // 2
    for E in (2, 3, 4):
        # same FLOPs: E experts of size I, top-1 (E x the parameters)
        p, f = experts_only(config(moe_experts=E, moe_mode="flops"))
        assert f == dense_flops and p == E * dense_params
        # shared expert: shared I/2 + top-1 of E routed I/2 -> same FLOPs, (E + 1)/2 x the parameters
        c = config(moe_experts=E, moe_shared=True, moe_mode="flops")
        p, f = experts_only(c)
        assert moe_expert_size(c) == I // 2 and f == dense_flops and 2 * p == (E + 1) * dense_params
    with pytest.raises(ValueError):
        moe_expert_size(config(moe_experts=2, moe_top_k=3))
    with pytest.raises(ValueError):
        moe_expert_size(config(moe_experts=2, moe_mode="tokens"))


def test_load_balancing_loss():
    mlp = MoEMLP(config(moe_experts=4, moe_top_k=1))
    with torch.no_grad():
        mlp.router.weight.zero_()  # uniform probabilities; top-1 ties all pick expert 0
    mlp(torch.randn(10, H))
    torch.testing.assert_close(mlp.aux_loss, torch.tensor(1.0))  # E * (1 * 1/4)
    mlp = MoEMLP(config(moe_experts=4, moe_top_k=2))
    x = torch.randn(64, H)
    mlp(x)
    assert mlp.aux_loss >= 0.99  # minimum 1 at perfect balance
    (g,) = torch.autograd.grad(mlp.aux_loss, mlp.router.weight)
    assert g.abs().sum() > 0


def _tiny_setup(seed, **moe):
    hf, target, examples, b = tiny_target_batch(seed)
    d2t, t2d = build_vocab_mapping(count_tokens(examples, hf.config.vocab_size), 40)
    draft = Eagle3Draft(Eagle3Config.from_target(hf.config, 40, target.aux_layers, **moe))
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    feats = target(b["input_ids"], b["attention_mask"])
    batch = make_batch(feats, b["input_ids"], b["loss_mask"], target.embed_tokens, target.lm_head, draft.draft_ids)
    return draft, batch, b["attention_mask"].sum(1).tolist()


def test_moe_ttt_matches_brute_force():
    """The MoE MLP is per token, so the TTT contract holds: equal to drafting step by step
    through the KV cache (without the aux loss, which the brute force does not add)."""
    draft, batch, lengths = _tiny_setup(0, moe_experts=3, moe_shared=True, moe_aux_coef=0.0)
    ttt = 3
    loss, _ = draft(batch, ttt, local_counts(batch, draft.t2d, ttt))
    ref = brute_force(draft, batch, lengths, ttt)[0]
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    params = [p for p in draft.parameters() if p.requires_grad]
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # with the aux loss on, the difference is exactly coef * mean over steps of the aux losses
    draft.config.moe_aux_coef = 0.5
    loss_aux, _ = draft(batch, ttt, local_counts(batch, draft.t2d, ttt))
    assert loss_aux > loss


def test_moe_draft_overfits():
    draft, batch, _ = _tiny_setup(1, moe_experts=2, moe_mode="flops")
    ttt = 2
    counts = local_counts(batch, draft.t2d, ttt)
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    first = None
    for _ in range(80):
        loss, _ = draft(batch, ttt, counts)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # soft CE floor: the target's own entropy on the trained rows (KL = 0)
    floor = sum(0.8**k * brute_force_entropy(batch, draft.t2d, k) / counts[k, 1] for k in range(ttt))
    assert loss.item() - floor < 0.2 * (first - floor)


def brute_force_entropy(batch, t2d, k):
    _, loss_mask = step_masks(batch, t2d, k + 1)[k]
    B, T, _ = batch.target_p.shape
    p = torch.zeros_like(batch.target_p)
    p[:, : T - 1 - k] = batch.target_p[:, 1 + k :]
    ent = -(p * p.clamp(min=1e-30).log()).sum(-1)
    return (ent * loss_mask).sum()


def test_export_refuses_moe_but_loads_it(tmp_path):
    c = config(moe_experts=2, moe_mode="params")
    draft = Eagle3Draft(c)
    draft.d2t.copy_(torch.arange(20) * 2 - torch.arange(20))  # draft id i -> target id 2i
    draft.t2d[torch.arange(20) * 2] = True
    ck = tmp_path / "ckpt" / "step_1"
    ck.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, ck / "draft.safetensors")
    (ck / "config.json").write_text(json.dumps({"strategy": "eagle3", "draft": c.to_dict(), "target": None}))
    loaded, _ = load_checkpoint(ck)  # evaluate.py measures MoE drafts from the checkpoint
    assert loaded.config.moe_experts == 2
    for k, v in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(ExportError, match="MoE drafts"):
        export(ck, tmp_path / "served")
    assert not (tmp_path / "served").exists()
