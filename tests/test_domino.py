"""Domino: batch (prev_embeds), the batched forward / loss / grads against a per-block reference
that runs the GRU from its equations, the curriculum, overfit on a tiny random target, greedy-exact
speculation, checkpoint load and the export refusal."""

import pytest
import torch

import export
from core.speculative import TargetRunner, proposer_for, speculative_generate
from models.dflash import block_counts
from models.domino import DominoConfig, DominoDraft, curriculum
from models.families import load_draft
from models.proposer import Proposer
from tests.test_dflash import overfit, save_run, setup
from tests.tiny import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def domino_setup(seed=0, **kw):
    kw = {"gru_size": 12, "correction_rank": 10, **kw}
    return setup(seed=seed, cls=DominoDraft, cfg_cls=DominoConfig, prev_embeds=True, **kw)


def gru_reference(gru, x_TE):
    """Hidden states [T, G] of a one-layer GRU, from the equations (PyTorch's gate order r, z, n)."""
    G = gru.hidden_size
    h, out = torch.zeros(G), []
    for x in x_TE:
        gi, gh = gru.weight_ih_l0 @ x + gru.bias_ih_l0, gru.weight_hh_l0 @ h + gru.bias_hh_l0
        r = torch.sigmoid(gi[:G] + gh[:G])
        z = torch.sigmoid(gi[G : 2 * G] + gh[G : 2 * G])
        n = torch.tanh(gi[2 * G :] + r * gh[2 * G :])
        h = (1 - z) * n + z * h
        out.append(h)
    return torch.stack(out)


def reference_logits(draft, aux_TX, anchor, anchor_id, tokens, target):
    """(base, final) [K, V] of one block alone: the inference backbone over the context before
    the anchor, the GRU over [anchor, tokens[:-1]] by hand, the correction from k = 1."""
    ctx = draft.context(aux_TX[None, :anchor])
    kv = draft.context_kv(ctx, torch.arange(anchor)[None])
    z = draft.block_hidden(anchor_id, anchor, kv, target.embed_tokens)
    base = z @ target.lm_head.weight.T
    s = gru_reference(draft.prefix_gru, target.embed_tokens(torch.tensor([anchor_id] + tokens[:-1])))
    corr = draft.embed_proj(torch.cat([z, s], -1))
    corr = torch.cat([torch.zeros_like(corr[:1]), corr[1:]])
    return base, base + corr


def test_batch_prev_embeds():
    draft, batch, b, target, _ = domino_setup(seed=1)
    E = target.embed_tokens.weight
    torch.testing.assert_close(batch.prev_embeds, E[batch.prev_ids])
    assert torch.equal(batch.prev_ids[:, :, 1:], batch.labels[:, :, :-1])
    assert torch.equal(batch.prev_ids[:, :, 0], b["input_ids"].gather(1, batch.anchors))


def test_curriculum():
    assert [curriculum(p) for p in (0.0, 0.25, 0.5, 0.9)] == [0.0, 0.5, 1.0, 1.0]


@pytest.mark.parametrize("progress,decay", [(0.0, 0.0), (0.2, 2.0), (1.0, 0.0)])
def test_forward_matches_per_block_reference(progress, decay):
    draft, batch, b, target, _ = domino_setup(seed=2, n_anchors=4)
    counts = block_counts(batch)
    loss, stats = draft(batch, counts, progress=progress, loss_decay=decay)
    params = list(draft.parameters())
    grads = torch.autograd.grad(loss, params)
    K, lam = draft.K, curriculum(progress)
    w = [torch.exp(torch.tensor(-k / decay)) if decay else torch.tensor(1.0) for k in range(K)]
    denom = sum(w[k] * counts[k, 1] for k in range(K))
    ref_loss, nll_k, correct_k, n = 0.0, torch.zeros(K), torch.zeros(K, dtype=torch.long), 0
    for i in range(batch.anchors.shape[0]):
        for j, a in enumerate(batch.anchors[i].tolist()):
            if a == 0:
                continue
            tokens = batch.labels[i, j].tolist()
            base, final = reference_logits(draft, batch.aux_hidden[i], a, int(b["input_ids"][i, a]), tokens, target)
            _, served = draft.block_logits(
                int(b["input_ids"][i, a]),
                a,
                draft.context_kv(draft.context(batch.aux_hidden[i : i + 1, :a]), torch.arange(a)[None]),
                target.embed_tokens,
                target.lm_head.weight,
                tokens=tokens,
            )
            torch.testing.assert_close(
                served, final.detach(), rtol=1e-5, atol=1e-5
            )  # the teacher-forced inference path
            for k in range(K):
                if batch.weights[i, j, k]:
                    nb = torch.logsumexp(base[k], -1) - base[k, tokens[k]]
                    nf = torch.logsumexp(final[k], -1) - final[k, tokens[k]]
                    ref_loss = ref_loss + w[k] * ((1 - lam) * nb + lam * nf) / denom
                    nll_k[k] += nf.detach()
                    correct_k[k] += int(final[k].argmax() == tokens[k])
                    n += 1
    assert n == counts[:, 1].sum() > 0
    ref_grads = torch.autograd.grad(ref_loss, params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(stats["loss_sum"], nll_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(stats["correct"], correct_k)
    if lam == 0:  # before the ramp the head gets no gradient
        assert all(
            g.abs().max() == 0
            for (name, _), g in zip(draft.named_parameters(), grads)
            if name.startswith(("prefix_gru", "embed_proj"))
        )


def test_overfit_tiny_target():
    draft, batch, *_ = domino_setup(seed=4, K=3, n_anchors=6, hidden=64, heads=4, n_examples=2, max_len=20, init=0.2)
    losses, acc = overfit(draft, batch, progress=1.0)
    assert losses[-1] < 0.05 * losses[0], losses[::5]
    assert acc >= 0.9, acc


def test_speculation_is_greedy_exact_and_checkpoint_loads(tmp_path):
    draft, *_ = domino_setup(seed=5, K=3)
    hf = tiny_llama(seed=5, hidden=32, heads=4)
    runner = TargetRunner(hf, draft.config.aux_layers)
    prop = proposer_for(draft, hf)
    assert prop.name == "domino-block3"
    prompt = [3, 17, 5, 60, 2, 9, 41]
    ref, _ = speculative_generate(runner, Proposer(), prompt, 30)
    out, st = speculative_generate(runner, prop, prompt, 30)
    assert out == ref and st.drafts > 0 and st.draft_tokens == 3 * st.drafts
    # greedy drafts are self-consistent: conditioning the head on them reproduces them
    aux = torch.randn(1, 9, len(draft.config.aux_layers) * draft.config.target_hidden_size)
    kv = draft.context_kv(draft.context(aux), torch.arange(9)[None])
    E, W = hf.get_input_embeddings(), hf.get_output_embeddings().weight
    toks = draft.propose(7, 9, kv, E, W)
    assert draft.block_logits(7, 9, kv, E, W, tokens=toks)[1].argmax(-1).tolist() == toks
    run = save_run(tmp_path, draft, hf, "domino")
    back, _ = export.load_checkpoint(run)
    assert isinstance(back, DominoDraft) and back.config == draft.config
    assert all(torch.equal(back.state_dict()[k], v) for k, v in draft.state_dict().items())
    with pytest.raises(export.ExportError, match="no serving engine"):
        export.export(run, tmp_path / "served")
    assert type(load_draft({"strategy": "domino", "draft": draft.config.to_dict()}, draft.state_dict())) is DominoDraft
