"""P-EAGLE: nested depth-wise rollout sampling and the flattened batch against loops; the one-pass
flattened forward with the P-EAGLE mask against brute force (every element recomputed through the
KV-cached inference path: the committed prefix, then the rollout's mask slots); the parallel
proposer is greedy; an overfit run on a tiny random target."""

import json

import pytest
import torch
from safetensors.torch import load_file

import export
from core.speculative import TargetRunner, speculative_generate
from data.packing import bucket
from data.vocab import build_vocab_mapping, count_tokens
from models.peagle import (
    DOWN_SAMPLE_MIN,
    DOWN_SAMPLE_RATIO,
    FAMILY,
    PEagleConfig,
    PEagleDraft,
    PEagleProposer,
    peagle_counts,
    peagle_host,
    sample_rollouts,
)
from models.proposer import Proposer
from tests.test_dflash import save_run
from tests.tiny import tiny_llama, tiny_target_batch

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def setup(
    seed=0,
    K=3,
    draft_vocab=60,
    hidden=32,
    heads=4,
    init=0.02,
    n_examples=3,
    max_len=14,
    fc_norm=False,
    norm_output=False,
    bucketed=False,
):
    hf, target, examples, b = tiny_target_batch(
        seed, n_examples, min_len=6, max_len=max_len, hidden=hidden, heads=heads, initializer_range=init
    )
    gens = [torch.Generator().manual_seed(seed * 10 + i) for i in range(len(examples))]
    b = peagle_host(b, K, lambda i: gens[i], bucketed)
    d2t, t2d = build_vocab_mapping(count_tokens(examples, hf.config.vocab_size), draft_vocab)
    c = PEagleConfig.from_target(
        hf.config, draft_vocab, target.aux_layers, mask_token_id=7, depths=K, fc_norm=fc_norm, norm_output=norm_output
    )
    draft = PEagleDraft(c)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    for n, p in draft.named_parameters():
        if "norm" in n:
            p.data += 0.2 * torch.randn_like(p)
    feats = target(b["input_ids"], b["attention_mask"])
    batch = FAMILY.make_batch(feats, b, target, draft)  # as train.py makes it
    return draft, batch, b, target, examples, feats


def test_rollouts_are_nested_and_subsampled():
    g = torch.Generator().manual_seed(0)
    mask = [0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1]
    n, K = len(mask), 5
    pos, depth = sample_rollouts(mask, K, g)
    assert pos[: n - 1] == list(range(n - 1)) and depth[: n - 1] == [0] * (n - 1)
    prev = set(range(n - 1))
    for d in range(1, K):
        at_d = [p for p, dd in zip(pos, depth) if dd == d]
        trained = [p for p in range(n - 1) if p + 2 + d < n and mask[p + 2 + d]]
        assert at_d == sorted(at_d) and set(at_d) <= prev, d  # nested: rollout p has every depth below d
        assert all(p + 2 + d < n and mask[p + 2 + d] for p in at_d)
        assert len(at_d) == min(
            len([p for p in prev if p in trained]), int(len(trained) * max(DOWN_SAMPLE_RATIO**d, DOWN_SAMPLE_MIN))
        )
        prev = set(at_d)


def test_batch_matches_loops():
    draft, batch, b, target, examples, feats = setup(seed=1)
    E = target.embed_tokens.weight
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        L = int((b["pe_doc"][i] >= 0).sum())
        assert (b["pe_doc"][i, L:] < 0).all()
        for a in range(L):
            p, d = int(batch.pos[i, a]), int(batch.depth[i, a])
            tok = e.input_ids[p + 1] if d == 0 else 7
            torch.testing.assert_close(batch.embeds[i, a], E[tok])
            if d == 0:
                torch.testing.assert_close(batch.aux_hidden[i, a], feats.aux_hidden[i, p])
            trained = p + 2 + d < n and bool(e.loss_mask[p + 2 + d])
            assert bool(batch.acc_mask[i, a]) == trained
            if trained:
                logits = target.lm_head(feats.final_hidden[i, p + 1 + d])
                torch.testing.assert_close(batch.target_p[i, a], logits[draft.draft_ids].softmax(-1))
                assert batch.target_top[i, a] == logits.argmax()
                assert batch.loss_mask[i, a] == float(draft.t2d[logits.argmax()])


def element_output(draft, batch, i, a, input_ids, aux):
    """Output of element a of example i, recomputed through the KV-cached inference path."""
    p, d = int(batch.pos[i, a]), int(batch.depth[i, a])
    E = batch.embeds  # depth-0 embeds are embed(token t+1) at element t
    emb0 = torch.stack([E[i, t] for t in range(p + 1)])[None]
    h, past = draft.decode(emb0, draft.project(aux[i : i + 1, : p + 1]), torch.arange(p + 1)[None])
    if d == 0:
        return h[0, -1]
    mask_emb = E[i, a][None, None].expand(1, d, -1)
    hid = draft.project(draft.mask_hidden).expand(1, d, -1)
    out, _ = draft.decode(mask_emb, hid, torch.arange(p + 1, p + 1 + d)[None], past)
    return out[0, -1]


@pytest.mark.parametrize("options", [(False, False), (True, True)])
def test_forward_matches_brute_force(options):
    draft, batch, b, target, examples, feats = setup(seed=2, fc_norm=options[0], norm_output=options[1])
    counts = peagle_counts(batch, draft.K)
    loss, stats = draft(batch, counts)
    grads = torch.autograd.grad(loss, list(draft.parameters()))
    K = draft.K
    ref_sum, ref_correct, total = torch.zeros(K), torch.zeros(K, dtype=torch.long), 0.0
    for i in range(batch.pos.shape[0]):
        for a in range(batch.pos.shape[1]):
            if not batch.acc_mask[i, a]:
                continue
            d = int(batch.depth[i, a])
            logits = draft.logits(element_output(draft, batch, i, a, b["input_ids"], feats.aux_hidden)).float()
            ce = -(batch.target_p[i, a] * logits.log_softmax(-1)).sum() * batch.loss_mask[i, a]
            total = total + ce
            ref_sum[d] += ce.detach()
            ref_correct[d] += int(draft.draft_ids[logits.argmax()] == batch.target_top[i, a])
    assert (counts[1:, 0] > 0).all(), "test data must reach every depth"
    ref = total / counts[:, 1].sum()
    ref_grads = torch.autograd.grad(ref, list(draft.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats["loss_sum"], ref_sum, rtol=1e-5, atol=1e-5)
    assert torch.equal(stats["correct"], ref_correct)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)


def test_bucketed_element_count_changes_nothing():
    """With flex (a GPU) the element count L is bucketed (data/packing.py's bucket: one compiled shape for many
    counts): the added elements are padding, and the loss, its gradients and the stats are the unpadded batch's."""
    out = []
    for bucketed in (False, True):
        torch.manual_seed(0)
        draft, batch, *_ = setup(seed=2, bucketed=bucketed)
        if out:
            draft.load_state_dict(out[0][0].state_dict())
        loss, stats = draft(batch, peagle_counts(batch, draft.K))
        out.append((draft, batch, loss, stats, torch.autograd.grad(loss, list(draft.parameters()))))
    (_, plain, l0, s0, g0), (_, padded, l1, s1, g1) = out
    L = plain.pos.shape[1]
    assert padded.pos.shape[1] == bucket(L) > L, L  # the test data need padding
    assert torch.equal(padded.pos[:, :L], plain.pos) and (padded.doc[:, L:] == -1).all()
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert torch.equal(s1["correct"], s0["correct"])
    for a, c in zip(g0, g1):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-6)


def test_flex_forward_equals_dense():
    draft, batch, *_ = setup(seed=3, hidden=64, heads=4)
    counts = peagle_counts(batch, draft.K)
    with torch.no_grad():
        (l0, s0), (l1, s1) = draft(batch, counts, attention="dense"), draft(batch, counts, attention="flex")
    torch.testing.assert_close(l0, l1, rtol=1e-4, atol=1e-5)
    assert torch.equal(s0["correct"], s1["correct"])


def test_parallel_proposer_is_greedy():
    draft, *_ = setup(seed=4, K=4)
    hf = tiny_llama(seed=4, hidden=32, heads=4)
    runner = TargetRunner(hf, draft.config.aux_layers)
    prompt = [3, 17, 5, 60, 2, 9, 41, 8]
    ref, _ = speculative_generate(runner, Proposer(), prompt, 30)
    out, st = speculative_generate(runner, PEagleProposer(draft, hf.get_input_embeddings()), prompt, 30)
    assert out == ref and st.draft_tokens == 4 * st.drafts


def test_overfit_tiny_target():
    draft, batch, *_ = setup(seed=5, K=3, init=0.2, hidden=64, n_examples=2, max_len=20, draft_vocab=96)
    counts = peagle_counts(batch, draft.K)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss, _ = draft(batch, counts)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        _, stats = draft(batch, counts)
    acc = stats["correct"].float() / counts[:, 0].clamp(min=1)
    # soft CE is floored by the target's own entropy on the trained elements: the KL above it must vanish
    p = batch.target_p[batch.loss_mask > 0]
    floor = float(-(p * p.clamp(min=1e-30).log()).sum(-1).sum() / counts[:, 1].sum())
    assert losses[-1] - floor < 0.1 * (losses[0] - floor), (floor, losses[::10])
    assert (acc >= 0.9).all(), acc


def test_export_vllm_format_and_load_back(tmp_path):
    """fp32 export -> load_exported: same tensors and the same parallel proposals; the serving dir
    is vLLM's EAGLE-3 format plus what its parallel drafting reads (mask_hidden [n_aux*H_t],
    config mask_token_id; llm_base_proposer.py / llama_eagle3.py in vLLM 0.32)."""
    draft, *_ = setup(seed=6, K=3)
    hf = tiny_llama(seed=6, hidden=32, heads=4)
    run = save_run(tmp_path, draft, hf, "peagle")
    out = export.export(run, tmp_path / "served", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["mask_token_id"] == 7
    sd = load_file(out / "model.safetensors")
    assert sd["mask_hidden"].shape == (len(draft.config.aux_layers) * draft.config.target_hidden_size,) and "d2t" in sd
    back, _ = export.load_exported(out)
    assert isinstance(back, PEagleDraft) and back.config == draft.config
    for k, v in draft.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k

    runner = TargetRunner(hf, draft.config.aux_layers)
    prompt = [3, 17, 5, 60, 2, 9, 41, 8]
    a = speculative_generate(runner, PEagleProposer(draft.eval(), hf.get_input_embeddings()), prompt, 12)
    b = speculative_generate(runner, PEagleProposer(back, hf.get_input_embeddings()), prompt, 12)
    assert a[0] == b[0] and a[1] == b[1]  # the same tokens and counters (SpecStats == ignores timings)
    with pytest.raises(export.ExportError, match="only the vLLM format"):
        export.export(run, tmp_path / "sg", engine="sglang")
