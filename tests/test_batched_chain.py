"""Batched EAGLE-3 chain drafting gives, per prompt, the batch-1 path's outputs and counters
(float64, so batched and unbatched matmuls cannot round a near-tie differently): ragged prompt
lengths, rows that finish early (EOS, max_new_tokens) and rows that keep going."""

import pytest
import torch

from core.batched_chain import batched_chain_generate, batched_generate
from core.speculative import NgramProposer, TargetRunner, speculative_generate
from models.eagle3 import Eagle3Proposer
from models.peagle import ParallelRows, PEagleConfig, PEagleDraft, PEagleProposer
from models.proposer import Proposer
from tests.test_speculative import hf_greedy, one_thread, random_draft  # noqa: F401 (one_thread: autouse fixture)
from tests.tiny import tiny_llama


def prompts_for(seed, n):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(0, 96, (3 + i % 4,), generator=g).tolist()
        out.append(base * (1 + i % 3) + torch.randint(0, 96, (1 + (i * 5) % 7,), generator=g).tolist())
    return out


@pytest.mark.parametrize("seed,depth", [(0, 1), (0, 3), (1, 7), (2, 4)])
def test_batched_equals_batch_one(seed, depth):
    hf = tiny_llama(seed=seed).double()
    draft, aux = random_draft(hf, seed)
    draft = draft.double()
    prompts = prompts_for(seed, 6)
    ref = [
        speculative_generate(
            TargetRunner(hf, aux), Eagle3Proposer(draft, hf.get_input_embeddings(), depth=depth), p, 30
        )
        for p in prompts
    ]
    eos = [ref[2][0][5]]  # a token prompt 2 emits: some rows stop early, at different steps
    ref = [
        speculative_generate(
            TargetRunner(hf, aux), Eagle3Proposer(draft, hf.get_input_embeddings(), depth=depth), p, 30, eos
        )
        for p in prompts
    ]
    got = batched_chain_generate(hf, draft, prompts, depth, 30, eos)
    assert len({len(o) for o, _ in ref}) > 1  # rows really finish at different lengths
    for (o_ref, s_ref), (o, s) in zip(ref, got):
        assert o == o_ref
        assert s == s_ref
    for p, (o, _) in zip(prompts, got):  # and so: the target's greedy tokens (plain decoding, batch 1)
        assert o == speculative_generate(TargetRunner(hf, aux), Proposer(), p, 30, eos)[0]


class OracleDraft(torch.nn.Module):
    """A stand-in EAGLE-3 draft (the methods the proposers call) that always predicts token + 1
    for the token it is fed; its 'hidden state' is that token's embedding."""

    def __init__(self, embed_weight):
        super().__init__()
        self.fc = torch.nn.Linear(1, 1).to(embed_weight.dtype)
        self.config = type("C", (), {"aux_layers": [0]})()
        En = embed_weight / embed_weight.pow(2).mean(-1, keepdim=True).sqrt()
        self.register_buffer("head", 10 * En.roll(1, 0))  # logits(E[t]) peak at t + 1
        self.draft_ids = torch.arange(embed_weight.shape[0])

    def project(self, aux):
        return torch.zeros(*aux.shape[:-1], 1, dtype=aux.dtype)

    def carry(self, h):
        return h

    def logits(self, h):
        return (h / h.pow(2).mean(-1, keepdim=True).sqrt()) @ self.head.T

    def decode(self, embeds, hidden, positions, past=None, attn_mask=None):
        kv = torch.zeros(embeds.shape[0], 1, embeds.shape[1], 1, dtype=embeds.dtype)
        past = (kv, kv) if past is None else tuple(torch.cat([p, kv], 2) for p in past)
        return embeds, past


def test_ragged_acceptance_in_batch():
    """Rows accept different numbers of drafts at each step: a target whose next token is
    t + 1 except at a few tokens (a permutation with jumps), a draft that always says t + 1."""
    V = 64
    hf = tiny_llama(vocab=V, seed=7).double()
    succ = [(t + 1) % V for t in range(V)]
    for a, b in ((5, 20), (11, 40), (30, 50), (44, 60)):  # swap successors: still a permutation
        succ[a], succ[b] = succ[b], succ[a]
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        E = torch.randn(V, hf.config.hidden_size, dtype=torch.float64)
        hf.model.embed_tokens.weight.copy_(E)
        hf.model.norm.weight.fill_(1.0)
        En = E / E.pow(2).mean(-1, keepdim=True).sqrt()
        for t in range(V):
            hf.lm_head.weight[succ[t]] = 10 * En[t]
    draft = OracleDraft(E)
    prompts = [[3, 4], [17, 18, 19], [9], [28, 29, 30, 31], [42, 43]]
    ref = [
        speculative_generate(TargetRunner(hf, [0]), Eagle3Proposer(draft, hf.get_input_embeddings(), depth=4), p, 40)
        for p in prompts
    ]
    got = batched_chain_generate(hf, draft, prompts, 4, 40)
    assert [o for o, _ in got] == [o for o, _ in ref] and [s for _, s in got] == [s for _, s in ref]
    for (o, _), p in zip(got, prompts):
        t = p[-1]
        expect = []
        for _ in range(40):
            t = succ[t]
            expect.append(t)
        assert o == expect
    st = [s for _, s in got]
    assert all(0 < s.accepted < 4 * s.drafts for s in st)  # some drafts accepted, some rejected, in every row
    assert len({round(s.accepted / s.drafts, 3) for s in st}) > 1  # and at different rates


def test_max_new_tokens_one_and_single_prompt():
    hf = tiny_llama(seed=4).double()
    draft, _ = random_draft(hf, 4)
    draft = draft.double()
    got = batched_chain_generate(hf, draft, [[1, 2, 3]], 3, 1)
    assert got[0][0] == hf_greedy(hf, [1, 2, 3], 1) and got[0][1].drafts == 0


def test_which_proposers_batch():
    """evaluate.py --batch hands a proposer to core/batched_chain.py by its `batches` (it names no family): EAGLE-3
    chains and P-EAGLE (tests/test_batched_blocks.py: the block families); not EAGLE-3 trees, not n-grams."""
    hf = tiny_llama(seed=0)
    draft, aux = random_draft(hf, 0)
    emb = hf.get_input_embeddings()
    peagle = PEagleDraft(PEagleConfig.from_target(hf.config, 48, aux, mask_token_id=1, depths=4))
    assert Eagle3Proposer(draft, emb, depth=3).batches
    assert not Eagle3Proposer(draft, emb, depth=3, topk=2).batches
    assert PEagleProposer(peagle, emb).batches and isinstance(PEagleProposer(peagle, emb).rows(), ParallelRows)
    assert not NgramProposer(3).batches and not Proposer().batches


@pytest.mark.parametrize("seed,K,depth", [(4, 4, 4), (1, 5, 2), (2, 3, 1)])
def test_batched_peagle_equals_batch_one(seed, K, depth):
    """P-EAGLE's rows (one parallel forward per step over the EAGLE-3 rows' cache) give the batch-1 outputs and
    counters per prompt, float64."""
    hf = tiny_llama(vocab=24, seed=seed).double()
    torch.manual_seed(seed)
    aux = [0, 2, 4]
    d = PEagleDraft(PEagleConfig.from_target(hf.config, 16, aux, mask_token_id=1, depths=K))
    for p in d.parameters():  # larger random weights than the init, so drafts vary
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randperm(24)[:16].sort().values
    d.d2t.copy_(ids - torch.arange(16))
    d.t2d.zero_()
    d.t2d[ids] = True
    d = d.double().eval()
    prompts = [[t % 24 for t in p] for p in prompts_for(seed, 6)]
    emb = hf.get_input_embeddings()

    def batch_one(eos=()):
        return [speculative_generate(TargetRunner(hf, aux), PEagleProposer(d, emb, depth), p, 30, eos) for p in prompts]

    eos = [batch_one()[2][0][5]]
    ref = batch_one(eos)
    got = batched_generate(hf, PEagleProposer(d, emb, depth).rows(), aux, prompts, depth, 30, eos)
    assert len({len(o) for o, _ in ref}) > 1 and len({s.accepted for _, s in ref}) > 1
    assert [o for o, _ in got] == [o for o, _ in ref] and [s for _, s in got] == [s for _, s in ref]
    # the slots' drafts are seldom accepted from a random draft: their tokens themselves, first step, every row
    first = [first_proposal(hf, PEagleProposer(d, emb, depth), aux, p) for p in prompts]
    assert first_proposals_batched(hf, PEagleProposer(d, emb, depth).rows(), aux, prompts, depth) == first


def first_proposal(hf, proposer, aux, prompt) -> list[int]:
    """The tokens a batch-1 proposer drafts at its first step (after the prompt and the first token)."""
    seen, propose = [], proposer.propose
    proposer.propose = lambda ids: seen.append(propose(ids)) or seen[-1]
    speculative_generate(TargetRunner(hf, aux), proposer, prompt, 2)
    return seen[0].tokens


def first_proposals_batched(hf, rows, aux, prompts, depth) -> list[list[int]]:
    """The tokens a rows drafter drafts for every prompt at the first batched step."""
    seen, propose = [], rows.propose
    rows.propose = lambda N, k: seen.append(propose(N, k)) or seen[-1]
    batched_generate(hf, rows, aux, prompts, depth, 2)
    return seen[0].tolist()
