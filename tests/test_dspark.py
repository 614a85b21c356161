"""DSpark: prefix rows and target distribution of the batch, the batched forward / loss / grads
against a per-block plain reference (Markov head and confidence by hand), overfit on data the
tiny target generated itself, greedy-exact speculation (with and without confidence cuts), and
the vLLM Qwen3DSparkModel export round trip."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import export
from core.speculative import TargetRunner, proposer_for, speculative_generate
from data.datasets import Example, collate
from models.dflash import block_counts, block_family_batch, block_host
from models.dspark import (
    CE_ALPHA,
    CONF_ALPHA,
    FAMILY,
    GAMMA,
    L1_ALPHA,
    DSparkConfig,
    DSparkDraft,
    DSparkProposer,
    prefix_rows,
)
from models.proposer import Proposer
from models.target import Target
from tests.test_dflash import block_logits as dflash_block_logits  # noqa: F401  (same inference path)
from tests.test_dflash import overfit, save_run, setup
from tests.tiny import tiny_llama

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def dspark_setup(seed=0, K=3, **kw):
    draft, batch, b, target, ex = setup(
        seed=seed,
        K=K,
        cls=DSparkDraft,
        cfg_cls=DSparkConfig,
        target_p=True,
        markov_rank=kw.pop("markov_rank", 6),
        **kw,
    )
    batch.weights = prefix_rows(batch.weights)
    return draft, batch, b, target, ex


def test_batch_prefix_rows_and_target_p():
    draft, batch, b, target, _ = dspark_setup(seed=1)
    raw = block_family_batch(target(b["input_ids"], b["attention_mask"]), b, target, draft)  # before prefix_rows
    for i, j in zip(*torch.nonzero(batch.anchors > 0, as_tuple=True)):
        expect, alive = [], 1.0
        for k in range(draft.K):
            alive *= float(raw.weights[i, j, k])
            expect.append(alive)
        assert batch.weights[i, j].tolist() == expect
    with torch.no_grad():  # target distribution of drafted token k = softmax(target logits at position a + k)
        logits = target.model(b["input_ids"], attention_mask=b["attention_mask"]).logits.softmax(-1)
    for i, j in zip(*torch.nonzero(batch.weights[:, :, 0] > 0, as_tuple=True)):
        a = int(batch.anchors[i, j])
        for k in range(draft.K):
            if batch.weights[i, j, k]:
                torch.testing.assert_close(batch.target_p[i, j, k], logits[i, a + k], rtol=1e-4, atol=1e-6)


def reference_block(draft, aux_TX, a, anchor_id, tokens, target):
    """(logits [K, V], confidence logits [K]) of one block alone, the heads by hand."""
    kv = draft.context_kv(draft.context(aux_TX[None, :a]), torch.arange(a)[None])
    z = draft.block_hidden(anchor_id, a, kv, target.embed_tokens)  # [K, H]
    w1, w2 = draft.markov_head.markov_w1.weight, draft.markov_head.markov_w2.weight
    e = w1[torch.tensor([anchor_id] + tokens[:-1])]  # [K, r]
    logits = z @ target.lm_head.weight.T + e @ w2.T
    proj = draft.confidence_head.proj
    return logits, torch.cat([z, e], -1) @ proj.weight[0] + proj.bias[0]


def test_forward_matches_per_block_reference():
    draft, batch, b, target, _ = dspark_setup(seed=2, n_anchors=4)
    counts = block_counts(batch)
    loss, stats = draft(batch, counts)
    params = list(draft.parameters())
    grads = torch.autograd.grad(loss, params)
    K = draft.K
    w = [torch.exp(torch.tensor(-k / GAMMA)) for k in range(K)]
    denom = sum(w[k] * counts[k, 1] for k in range(K))
    ref, nll_k, correct_k = 0.0, torch.zeros(K), torch.zeros(K, dtype=torch.long)
    for i, j in zip(*torch.nonzero(batch.anchors > 0, as_tuple=True)):
        a, tokens = int(batch.anchors[i, j]), batch.labels[i, j].tolist()
        logits, conf = reference_block(draft, batch.aux_hidden[i], a, int(b["input_ids"][i, a]), tokens, target)
        kv = draft.context_kv(draft.context(batch.aux_hidden[i : i + 1, :a]), torch.arange(a)[None])
        served, c = draft.block_logits(
            int(b["input_ids"][i, a]), a, kv, target.embed_tokens, target.lm_head.weight, tokens=tokens
        )
        torch.testing.assert_close(served, logits.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, conf.detach().sigmoid(), rtol=1e-5, atol=1e-6)
        for k in range(K):
            if batch.weights[i, j, k]:
                p, q = batch.target_p[i, j, k], logits[k].softmax(-1)
                nll = torch.logsumexp(logits[k], -1) - logits[k, tokens[k]]
                acc = (1 - 0.5 * (q - p).abs().sum()).detach().clamp(0, 1)
                bce = -(acc * F.logsigmoid(conf[k]) + (1 - acc) * F.logsigmoid(-conf[k]))
                ref = ref + w[k] * (CE_ALPHA * nll + L1_ALPHA * (q - p).abs().sum() + CONF_ALPHA * bce) / denom
                nll_k[k] += nll.detach()
                correct_k[k] += int(logits[k].argmax() == tokens[k])
    ref_grads = torch.autograd.grad(ref, params)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(draft.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(stats["loss_sum"], nll_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(stats["correct"], correct_k) and counts[:, 1].sum() > 0


def test_overfit_target_generated_data():
    """Labels = the tiny target's own greedy tokens (DSpark trains on target-regenerated data): the
    hard labels and the target distribution agree on the argmax. The loss keeps a floor (0.1·H(p)
    in the CE, the entropy of a non-0/1 acceptance in the BCE), so it must fall 3x, not to ~0."""
    torch.manual_seed(4)
    hf = tiny_llama(seed=4, hidden=64, heads=4, initializer_range=0.2)
    target = Target(hf)
    g = torch.Generator().manual_seed(4)
    examples = []
    for _ in range(2):
        ids = torch.randint(0, hf.config.vocab_size, (4,), generator=g)[None]
        with torch.no_grad():
            ids = hf.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0].tolist()
        examples.append(Example(ids, [0] * 4 + [1] * (len(ids) - 4)))
    b = block_host(collate(examples), 6, lambda i: torch.Generator().manual_seed(i))
    c = DSparkConfig.from_target(hf.config, target.aux_layers, 3, mask_token_id=5, num_layers=2, markov_rank=8)
    draft = DSparkDraft(c)
    batch = FAMILY.make_batch(target(b["input_ids"], b["attention_mask"]), b, target, draft)
    losses, acc = overfit(draft, batch, steps=60, lr=5e-3)
    assert losses[-1] < losses[0] / 3, losses[::5]
    assert acc >= 0.9, acc


@pytest.mark.parametrize("min_survival", [0.0, 0.5])
def test_speculation_is_greedy_exact(min_survival):
    draft, *_ = dspark_setup(seed=5, K=3)
    hf = tiny_llama(seed=5, hidden=32, heads=4)
    runner = TargetRunner(hf, draft.config.aux_layers)
    assert isinstance(proposer_for(draft, hf), DSparkProposer)
    prop = DSparkProposer(
        draft, hf.get_input_embeddings(), hf.get_output_embeddings().weight, min_survival=min_survival
    )
    prompt = [3, 17, 5, 60, 2, 9, 41]
    ref, _ = speculative_generate(runner, Proposer(), prompt, 30)
    out, st = speculative_generate(runner, prop, prompt, 30)
    assert out == ref and st.drafts > 0 and len(prop.confidence) == st.drafts
    assert all(0 <= x <= 1 for c in prop.confidence for x in c)
    survive = [sum(1 for s in torch.tensor(c).cumprod(0) if s >= min_survival) for c in prop.confidence]
    assert st.draft_tokens == (3 * st.drafts if min_survival == 0 else sum(survive))
    with pytest.raises(ValueError, match="min_survival"):
        DSparkProposer(draft, hf.get_input_embeddings(), hf.get_output_embeddings().weight, min_survival=2.0)


def test_export_vllm_format_and_load_back(tmp_path):
    """fp32 export -> load_exported gives the same tensors, logits and confidence; config.json
    and tensor names are those vLLM 0.32's qwen3_dspark.py reads."""
    draft, _, _, target, _ = dspark_setup(seed=6, K=3)
    hf = tiny_llama(seed=6, hidden=32, heads=4)
    out = export.export(save_run(tmp_path, draft, hf, "dspark"), tmp_path / "served", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 3 and cfg["markov_rank"] == 6
    assert (
        cfg["sample_from_anchor"] is True
        and cfg["enable_confidence_head"] is True
        and cfg["confidence_head_with_markov"] is True
    )
    assert cfg["draft_vocab_size"] == cfg["vocab_size"] == hf.config.vocab_size
    assert (
        cfg["dflash_config"]["mask_token_id"] == 5
        and cfg["dflash_config"]["target_layer_ids"] == draft.config.aux_layers
    )
    sd = load_file(out / "model.safetensors")
    r, H, V = 6, draft.config.hidden_size, hf.config.vocab_size
    shapes = {
        "markov_head.markov_w1.weight": (V, r),
        "markov_head.markov_w2.weight": (V, r),
        "confidence_head.proj.weight": (1, H + r),
        "confidence_head.proj.bias": (1,),
        "fc.weight": (H, 3 * H),
        "layers.1.self_attn.q_norm.weight": (draft.config.head_dim,),
    }
    assert {k: tuple(sd[k].shape) for k in shapes} == shapes
    assert not any(n.startswith(("lm_head", "embed_tokens", "d2t", "t2d")) for n in sd)
    back, _ = export.load_exported(out)
    assert isinstance(back, DSparkDraft) and back.config == draft.config
    aux = torch.randn(1, 9, 3 * H)
    for d in (draft.eval(), back):
        kv = d.context_kv(d.context(aux), torch.arange(9)[None])
        d.result = d.block_logits(7, 9, kv, target.embed_tokens, target.lm_head.weight)
    assert all(torch.equal(x, y) for x, y in zip(draft.result, back.result))
    cfg["sample_from_anchor"] = False
    with pytest.raises(export.ExportError, match="anchor-sampling"):
        export.config_from_serving(cfg)
