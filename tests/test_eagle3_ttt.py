"""The TTT forward equals a brute-force reference that drafts autoregressively, step by step,
for every position, through a real KV cache (what inference does)."""

import pytest
import torch

from data.vocab import build_vocab_mapping, count_tokens
from models.eagle3 import Eagle3Config, Eagle3Draft, local_counts, make_batch
from tests.tiny import tiny_target_batch, to_device


def setup(seed=0, draft_vocab=40, ttt=4, **model_kw):
    hf, target, examples, batch_t = tiny_target_batch(seed, **model_kw)
    d2t, t2d = build_vocab_mapping(count_tokens(examples, hf.config.vocab_size), draft_vocab)
    cfg = Eagle3Config.from_target(hf.config, draft_vocab, target.aux_layers)
    draft = Eagle3Draft(cfg)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    feats = target(batch_t["input_ids"], batch_t["attention_mask"])
    batch = make_batch(
        feats, batch_t["input_ids"], batch_t["loss_mask"], target.embed_tokens, target.lm_head, draft.draft_ids
    )
    return draft, batch, batch_t["attention_mask"].sum(1).tolist(), ttt


def brute_force(draft, batch, lengths, ttt):
    """Loop over sequences b, positions t and steps k; each chain is drafted token by token."""
    loss_sum = torch.zeros(ttt)
    n_loss = torch.zeros(ttt)
    correct = torch.zeros(ttt)
    n_acc = torch.zeros(ttt)
    for b, n in enumerate(lengths):
        E, aux = batch.embeds[b : b + 1], batch.aux_hidden[b : b + 1]
        for t in range(n - 2):
            # step 0: the prefix 0..t, each position i fed (fc(aux_i), embed of token i+1)
            pos = torch.arange(t + 1)[None]
            h, past = draft.decode(E[:, 1 : t + 2], draft.fc(aux[:, : t + 1]), pos)
            h = h[:, -1:]
            for k in range(ttt):
                if k > 0:  # one more drafted token at position t + k, attending the cache
                    if t + 1 + k >= n:
                        break
                    h, past = draft.decode(E[:, t + 1 + k : t + 2 + k], h, torch.tensor([[t + k]]), past)
                if t + 2 + k >= n or not batch.loss_mask[b, t + 2 + k]:
                    continue
                logits = draft.logits(h[0, 0]).float()
                p = batch.target_p[b, t + 1 + k]
                top = batch.target_top[b, t + 1 + k]
                n_acc[k] += 1
                correct[k] += float(draft.draft_ids[logits.argmax()] == top)
                if draft.t2d[top]:
                    loss_sum[k] = loss_sum[k] + -(p * logits.log_softmax(-1)).sum()
                    n_loss[k] += 1
    total = sum(0.8**k * loss_sum[k] / n_loss[k].clamp(min=1) for k in range(ttt))
    return total, loss_sum, n_loss, correct, n_acc


@pytest.mark.parametrize("seed", [0, 1])
def test_ttt_matches_brute_force(seed):
    draft, batch, lengths, ttt = setup(seed)
    counts = local_counts(batch, draft.t2d, ttt)
    loss, stats = draft(batch, ttt, counts)
    grads = torch.autograd.grad(loss, list(draft.parameters()))

    ref, ref_sums, ref_n, ref_correct, ref_nacc = brute_force(draft, batch, lengths, ttt)
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()))
    assert torch.equal(counts[:, 0].float(), ref_nacc) and torch.equal(counts[:, 1].float(), ref_n)
    assert ref_n[-1] > 0, "test data must train the last TTT step"
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["loss_sum"], ref_sums.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(stats["correct"].float(), ref_correct)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)


def _loss_and_grads(draft, batch, ttt, attention, loss):
    counts = local_counts(batch, draft.t2d, ttt)
    total, stats = draft(batch, ttt, counts, attention=attention, loss=loss)
    return total, stats, torch.autograd.grad(total, list(draft.parameters()))


@pytest.mark.parametrize(
    "attention,loss", [("lse", "torch"), ("eager", "triton"), ("eager", "fused"), ("lse", "fused")]
)
def test_every_path_matches_reference(attention, loss):
    draft, batch, _, ttt = setup(seed=2)
    ref_total, ref_stats, ref_grads = _loss_and_grads(draft, batch, ttt, "eager", "torch")
    total, stats, grads = _loss_and_grads(draft, batch, ttt, attention, loss)
    torch.testing.assert_close(total, ref_total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["loss_sum"], ref_stats["loss_sum"], rtol=1e-5, atol=1e-5)
    assert torch.equal(stats["correct"], ref_stats["correct"])
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward and Triton need a GPU")
@pytest.mark.parametrize(
    "attention,loss",
    [("flex", "torch"), ("flex", "triton"), ("flex", "fused"), ("flex_buf", "triton"), ("lse", "fused")],
)
def test_every_path_matches_reference_cuda(attention, loss):
    draft, batch, _, ttt = setup(seed=2, hidden=64, heads=4)  # flex needs head dim >= 16
    draft = draft.cuda()
    batch = to_device(batch)  # its doc_ids / position_ids are None (unpacked)
    ref_total, ref_stats, ref_grads = _loss_and_grads(draft, batch, ttt, "eager", "torch")
    total, stats, grads = _loss_and_grads(draft, batch, ttt, attention, loss)
    torch.testing.assert_close(total, ref_total, rtol=1e-4, atol=1e-5)
    assert torch.equal(stats["correct"], ref_stats["correct"])
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-5, msg=name)
