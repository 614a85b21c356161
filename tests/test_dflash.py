"""DFlash: anchors, block batch and the batched block-mask forward against brute force (every block
run on its own, through the inference path, over exactly the context before its anchor), D-PACE
weights from their definition, flex == dense, and an overfit run on a tiny random target."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import export
from core.speculative import TargetRunner, speculative_generate
from data.packing import bucket
from models.dflash import (
    BlockProposer,
    DFlashConfig,
    DFlashDraft,
    block_counts,
    block_family_batch,
    block_host,
    dpace_weights,
    sample_anchors,
)
from models.domino import DominoConfig, DominoDraft
from models.dspark import DSparkConfig, DSparkDraft
from models.proposer import Proposer
from tests.tiny import tiny_llama, tiny_target_batch

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def setup(
    seed=0,
    K=3,
    n_anchors=4,
    cls=DFlashDraft,
    cfg_cls=DFlashConfig,
    hidden=32,
    heads=4,
    target_p=False,
    prev_embeds=False,
    n_examples=3,
    max_len=13,
    init=0.02,
    bucketed=False,
    **extra,
):
    hf, target, examples, b = tiny_target_batch(
        seed, n_examples, min_len=5, max_len=max_len, hidden=hidden, heads=heads, initializer_range=init
    )
    gens = [torch.Generator().manual_seed(seed * 100 + i) for i in range(len(examples))]
    b = block_host(b, n_anchors, lambda i: gens[i], bucketed, max_len=64)
    block_size = K + cls.prediction_offset  # DFlash: the anchor slot and K drafted; DSpark: K drafted
    c = cfg_cls.from_target(hf.config, target.aux_layers, block_size, mask_token_id=5, num_layers=2, **extra)
    draft = cls(c)
    for p in draft.parameters():  # non-trivial norms
        p.data += 0.1 * torch.randn_like(p)
    feats = target(b["input_ids"], b["attention_mask"])
    batch = block_family_batch(feats, b, target, draft, target_p=target_p, prev_embeds=prev_embeds)  # as train.py
    return draft, batch, b, target, examples


def test_anchor_sampling():
    mask = [0, 1, 1, 0, 1, 1, 1, 0]
    valid = [a for a in range(1, 7) if mask[a + 1]]
    assert valid == [1, 3, 4, 5]
    assert sample_anchors(mask, 10, torch.Generator()) == valid
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = sample_anchors(mask, 2, g1)
    assert a == sample_anchors(mask, 2, g2) and len(a) == 2 and a == sorted(a) and set(a) <= set(valid)
    assert sample_anchors([1, 0, 0], 4, torch.Generator()) == []


@pytest.mark.parametrize(  # dflash (slot 0 = anchor, predicts at 1..K), dspark (0..K-1)
    "cls,cfg_cls", [(DFlashDraft, DFlashConfig), (DSparkDraft, DSparkConfig)], ids=["dflash", "dspark"]
)
def test_block_batch_matches_loops(cls, cfg_cls):
    K = 3
    draft, batch, b, target, examples = setup(seed=1, K=K, cls=cls, cfg_cls=cfg_cls)
    bs = K + cls.prediction_offset
    E = target.embed_tokens.weight
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        for j, a in enumerate(b["anchors"][i].tolist()):
            keep = a > 0
            toks = [e.input_ids[a] if keep else 5] + [5] * (bs - 1)
            torch.testing.assert_close(batch.block_embeds[i, j * bs : (j + 1) * bs], E[toks])
            assert batch.block_pos[i, j * bs : (j + 1) * bs].tolist() == list(range(a, a + bs))
            for k in range(K):
                p = a + 1 + k
                trained = keep and p < n and bool(e.loss_mask[p])
                assert batch.weights[i, j, k] == float(trained)
                if trained:
                    assert batch.labels[i, j, k] == e.input_ids[p]
                    assert batch.prev_ids[i, j, k] == e.input_ids[p - 1]
    assert torch.equal(block_counts(batch)[:, 0], batch.weights.sum((0, 1)).long())


def reference_dpace(q, mask, beta=0.5):
    """Loops over blocks: w_k = Σ_{j>=k, trained} Π_{i<=j, trained} ((1-β) q_i + β)."""
    w = torch.zeros_like(q)
    for idx in range(q.shape[0]):
        for k in range(q.shape[1]):
            total = 0.0
            for j in range(k, q.shape[1]):
                if mask[idx, j]:
                    total += math.prod(((1 - beta) * q[idx, i] + beta).item() for i in range(j + 1) if mask[idx, i])
            w[idx, k] = total
    return w


def test_dpace_weights_match_definition():
    g = torch.Generator().manual_seed(0)
    q, mask = torch.rand(6, 5, generator=g), (torch.rand(6, 5, generator=g) > 0.3).float()
    torch.testing.assert_close(dpace_weights(q, mask), reference_dpace(q, mask), rtol=1e-5, atol=1e-6)


def brute_force_nll(draft, batch, b, target):
    """nll[i, j, k] of every trained slot, each block run alone through the inference path with
    the context of positions < anchor only."""
    out = {}
    for i in range(batch.anchors.shape[0]):
        for j, a in enumerate(batch.anchors[i].tolist()):
            if a == 0:
                continue
            ctx = draft.context(batch.aux_hidden[i : i + 1, :a])
            kv = draft.context_kv(ctx, torch.arange(a)[None])
            h = draft.block_hidden(int(b["input_ids"][i, a]), a, kv, target.embed_tokens)
            logits = (h @ batch.head.T).float()
            for k in range(draft.K):
                if batch.weights[i, j, k]:
                    lab = batch.labels[i, j, k]
                    out[i, j, k] = (torch.logsumexp(logits[k], -1) - logits[k, lab], int(logits[k].argmax() == lab))
    return out


# decay 0.01: exp(-k/γ) is subnormal in fp32 at slot 1 and 0 from slot 2; the floored weight keeps them trained,
# in "correct" and with their NLL in the logs (the kernel's rows are w · nll)
@pytest.mark.parametrize("objective,decay", [("ce", 0.0), ("ce", 2.0), ("ce", 0.01), ("dpace", 0.0)])
def test_forward_matches_per_block_brute_force(objective, decay):
    draft, batch, b, target, _ = setup(seed=2, K=3, n_anchors=4)
    counts = block_counts(batch)
    loss, stats = draft(batch, counts, objective=objective, loss_decay=decay)
    grads = torch.autograd.grad(loss, list(draft.parameters()))
    ref = brute_force_nll(draft, batch, b, target)
    K = draft.K
    assert counts[:, 1].sum() == len(ref) > 0
    if objective == "ce":
        w = [math.exp(-k / decay) if decay else 1.0 for k in range(K)]
        ref_loss = sum(w[k] * nll for (_, _, k), (nll, _) in ref.items()) / sum(w[k] * counts[k, 1] for k in range(K))
    else:
        q = torch.ones_like(batch.weights)
        for (i, j, k), (nll, _) in ref.items():
            q[i, j, k] = torch.exp(-nll.detach())
        wd = reference_dpace(q.view(-1, K), batch.weights.view(-1, K)).view_as(q)
        ref_loss = sum(wd[key] * nll for key, (nll, _) in ref.items()) / counts[0, 1]
    ref_grads = torch.autograd.grad(ref_loss, list(draft.parameters()))
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    for k in range(K):
        torch.testing.assert_close(
            stats["loss_sum"][k],
            sum((nll for (_, _, kk), (nll, _) in ref.items() if kk == k), torch.tensor(0.0)).detach(),
            rtol=1e-5,
            atol=1e-5,
        )
        assert stats["correct"][k] == sum(c for (_, _, kk), (_, c) in ref.items() if kk == k)


@pytest.mark.parametrize(
    "cls,cfg_cls,extra",
    [
        (DFlashDraft, DFlashConfig, {}),
        (DSparkDraft, DSparkConfig, {"target_p": True}),
        (DominoDraft, DominoConfig, {"prev_embeds": True, "gru_size": 12, "correction_rank": 10}),
    ],
    ids=["dflash", "dspark", "domino"],
)
def test_bucketed_block_count_changes_nothing(cls, cfg_cls, extra):
    """With flex (a GPU) the block count and the rows' length are bucketed (data/packing.py's bucket: one
    compiled shape for many): the added blocks are unused and the added columns padding, and the loss, its
    gradients and the stats are the unpadded batch's."""
    out = []
    for bucketed in (False, True):
        torch.manual_seed(0)
        draft, batch, b, *_ = setup(
            seed=5, n_anchors=9, max_len=24, cls=cls, cfg_cls=cfg_cls, bucketed=bucketed, **extra
        )
        if out:
            draft.load_state_dict(out[0][0].state_dict())
        loss, stats = draft(batch, block_counts(batch))
        out.append((draft, batch, loss, stats, torch.autograd.grad(loss, list(draft.parameters()))))
    (_, plain, l0, s0, g0), (_, padded, l1, s1, g1) = out
    n, T = plain.anchors.shape[1], plain.aux_hidden.shape[1]
    assert n == 9 and padded.anchors.shape[1] == bucket(n) == 10  # some row has 9 blocks: one unused block added
    assert T == 19 and padded.aux_hidden.shape[1] == bucket(T) == 20  # and a column of padding
    assert torch.equal(padded.anchors[:, :n], plain.anchors) and not padded.anchors[:, n:].any()
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert torch.equal(s1["correct"], s0["correct"])
    for a, c in zip(g0, g1):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-6)


def test_flex_forward_equals_dense():
    """The GPU path (FlexAttention with the dflash BlockMask) gives the dense path's hidden states
    (flex runs forward-only on CPU; its gradients are a GPU test)."""
    draft, batch, *_ = setup(seed=3, K=3, hidden=64, heads=4)  # flex needs head dim >= 16
    with torch.no_grad():
        torch.testing.assert_close(draft.backbone(batch, "flex"), draft.backbone(batch, "dense"), rtol=1e-4, atol=1e-5)


def overfit(draft, batch, steps=40, lr=3e-3, **kw):
    counts = block_counts(batch)
    opt = torch.optim.Adam(draft.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss, stats = draft(batch, counts, **kw)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        _, stats = draft(batch, counts, **kw)
    return losses, (stats["correct"].sum() / counts[:, 0].sum()).item()


@pytest.mark.parametrize("objective", ["ce", "dpace"])
def test_overfit_tiny_target(objective):
    # target weights at std 0.2: the frozen head can express peaked distributions (at HF's 0.02
    # the logits of a 64-wide tiny model stay within ~±0.2 and no draft can fit them quickly)
    draft, batch, *_ = setup(seed=4, K=3, n_anchors=6, hidden=64, heads=4, n_examples=2, max_len=20, init=0.2)
    losses, acc = overfit(draft, batch, objective=objective)
    assert losses[-1] < 0.05 * losses[0], losses[::5]
    assert acc >= 0.9, acc


def test_block_proposer_is_greedy_and_caches_context_exactly():
    """Speculative decoding with a DFlash draft returns the target's greedy tokens, and the
    draft's incrementally extended context k/v equals one computed from scratch."""
    draft, *_ = setup(seed=5, K=3)
    hf = tiny_llama(seed=5, hidden=32, heads=4)
    runner = TargetRunner(hf, draft.config.aux_layers)
    prop = BlockProposer(draft, hf.get_input_embeddings(), hf.get_output_embeddings().weight)
    prompt = [3, 17, 5, 60, 2, 9, 41]
    ref, _ = speculative_generate(runner, Proposer(), prompt, 30)
    out, st = speculative_generate(runner, prop, prompt, 30)
    assert out == ref and st.drafts > 0 and st.draft_tokens == 3 * st.drafts
    ids = prompt + out
    runner.reset()
    _, aux = runner.forward(ids[: prop.n_ctx], list(range(prop.n_ctx)))
    with torch.no_grad():
        fresh = draft.context_kv(draft.context(aux[None]), torch.arange(prop.n_ctx)[None])
    for (k0, v0), (k1, v1) in zip(prop.kv, fresh):
        torch.testing.assert_close(k0, k1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v0, v1, rtol=1e-5, atol=1e-5)


def save_run(root, draft, hf, strategy):
    """A run dir as train.py writes it (ckpt/step_N/{draft.safetensors, config.json}) next to the
    saved target."""
    tdir = root / "target"
    hf.save_pretrained(tdir)
    step = root / "run" / "ckpt" / "step_3"
    step.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, step / "draft.safetensors")
    (step / "config.json").write_text(
        json.dumps({"strategy": strategy, "draft": draft.config.to_dict(), "target": str(tdir)})
    )
    (root / "run" / "ckpt" / "latest").write_text("step_3")
    return root / "run"


def block_logits(draft, target, T=9, anchor_id=7):
    """Logits of one block at position T over a random context (the inference path vLLM runs)."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, T, len(draft.config.aux_layers) * draft.config.target_hidden_size, generator=g)
    with torch.no_grad():
        kv = draft.context_kv(draft.context(aux), torch.arange(T)[None])
        return draft.block_hidden(anchor_id, T, kv, target.embed_tokens) @ target.lm_head.weight.T


def test_export_vllm_format_and_load_back(tmp_path):
    """fp32 export -> load_exported gives the same tensors and logits; config.json carries the
    fields vLLM 0.32's qwen3_dflash.py reads (architecture, block_size, dflash_config with the
    mask token and target_layer_ids, which vLLM shifts by +1 into hidden_states indices)."""
    draft, _, _, target, _ = setup(seed=6, K=3)
    hf = tiny_llama(seed=6, hidden=32, heads=4)
    run = save_run(tmp_path, draft, hf, "dflash")
    out = export.export(run, tmp_path / "served", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2
    assert (
        cfg["dflash_config"]["mask_token_id"] == 5
        and cfg["dflash_config"]["target_layer_ids"] == draft.config.aux_layers
    )
    names = set(load_file(out / "model.safetensors"))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.k_norm.weight",
        "layers.0.mlp.down_proj.weight",
    } <= names
    assert not any(n.startswith(("lm_head", "embed_tokens")) for n in names)  # vLLM shares the target's
    back, _ = export.load_exported(out)
    assert back.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    assert torch.equal(block_logits(draft.eval(), target), block_logits(back, target))
    with pytest.raises(export.ExportError, match="only the vLLM format"):
        export.export(run, tmp_path / "sg", engine="sglang")
