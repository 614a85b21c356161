"""Speculative decoding emits exactly the target's greedy tokens (chain, tree, n-gram), its
target cache surgery matches a fresh forward, and a draft that copies the target is accepted.
Tiny random Llama targets here; the real SmolLM2 in the slow tests."""

import json
import time

import pytest
import torch

import evaluate
from core.speculative import NgramProposer, SpecStats, TargetRunner, speculative_generate
from data.benchmarks import load_prompts
from data.chat import render
from evaluate import split_halves
from models.dflash import BlockProposer, DFlashConfig, DFlashDraft
from models.eagle3 import Eagle3Config, Eagle3Draft, Eagle3Proposer
from models.peagle import PEagleConfig, PEagleDraft, PEagleProposer
from models.proposer import Proposer, Tree
from models.target import Target, eos_ids
from tests.test_export import make_checkpoint
from tests.tiny import tiny_llama


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest single-threaded (and do not stall on a busy 2-core box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hf_greedy(model, prompt, max_new, eos=None):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def random_draft(hf, seed=0, draft_vocab=48):
    torch.manual_seed(seed)
    target = Target(hf)
    cfg = Eagle3Config.from_target(hf.config, draft_vocab, target.aux_layers)
    d = Eagle3Draft(cfg)
    for p in d.parameters():  # larger random weights than the init, so drafts vary
        torch.nn.init.normal_(p, std=0.3)
    ids = torch.randperm(hf.config.vocab_size)[:draft_vocab].sort().values
    d.d2t.copy_(ids - torch.arange(draft_vocab))
    d.t2d.zero_()
    d.t2d[ids] = True
    return d.eval(), target.aux_layers


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mode", ["chain1", "chain3", "chain7", "tree3x4", "tree2x6", "ngram", "none"])
def test_output_equals_greedy(seed, mode):
    hf = tiny_llama(seed=seed)
    draft, aux = random_draft(hf, seed)
    g = torch.Generator().manual_seed(seed)
    # a repetitive prompt, so n-gram lookup and the draft get some acceptances
    base = torch.randint(0, 96, (5,), generator=g).tolist()
    prompt = base * 3 + torch.randint(0, 96, (4,), generator=g).tolist()
    if mode.startswith("chain"):
        prop = Eagle3Proposer(draft, hf.get_input_embeddings(), depth=int(mode[5:]))
    elif mode.startswith("tree"):
        k, d = mode[4:].split("x")
        prop = Eagle3Proposer(draft, hf.get_input_embeddings(), depth=int(d), topk=int(k))
    elif mode == "ngram":
        prop = NgramProposer(4)
    else:
        prop = Proposer()
    out, st = speculative_generate(TargetRunner(hf, aux), prop, prompt, 40, eos_ids=())
    assert out == hf_greedy(hf, prompt, 40)
    assert st.new_tokens == 40
    assert st.target_forwards == 1 + st.drafts
    if mode == "none":
        assert st.drafts == 39 and st.accepted == 0


def test_eos_stops_and_is_kept():
    hf = tiny_llama(seed=3)
    draft, aux = random_draft(hf, 3)
    prompt = [5, 6, 7, 8, 9]
    ref = hf_greedy(hf, prompt, 30)
    eos = ref[7]  # a token the target emits: generation must stop at its first occurrence
    out, _ = speculative_generate(
        TargetRunner(hf, aux), Eagle3Proposer(draft, hf.get_input_embeddings(), 4, 2), prompt, 30, eos_ids=[eos]
    )
    assert out == ref[: ref.index(eos) + 1]


def test_tree_verification_rows_equal_sequential_decoding():
    """The verification forward of a tree gives every node the logits and aux states it would
    get in a plain forward of its own root-to-node path; keep() leaves a cache equal to one
    built from the accepted path."""
    hf = tiny_llama(seed=4)
    aux_layers = [1, 2]
    prefix = [3, 1, 4, 1, 5, 9]
    tree = Tree([10, 11, 12, 13, 14, 15], [-1, -1, 0, 0, 1, 2])
    r = TargetRunner(hf, aux_layers)
    r.reset()
    r.forward(prefix[:-1], list(range(5)))
    depths = tree.depths()
    m = torch.ones(7, 7, dtype=torch.bool).tril()
    m[1:, 1:] = tree.ancestors_mask()
    logits, aux = r.forward([prefix[-1]] + tree.tokens, [5] + [5 + d for d in depths], m)
    for node in range(len(tree)):
        path = [node]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        seq = prefix + [tree.tokens[i] for i in reversed(path)]
        out = hf(torch.tensor([seq]), output_hidden_states=True)
        torch.testing.assert_close(logits[1 + node], out.logits[0, -1], rtol=1e-4, atol=1e-5)
        ref_aux = torch.cat([out.hidden_states[i + 1][0, -1] for i in aux_layers])
        torch.testing.assert_close(aux[1 + node], ref_aux, rtol=1e-4, atol=1e-5)
    # keep root + path 0 -> 2 -> 5, then one more token must match a fresh forward
    r.keep(5, [0, 1, 3, 6])
    assert r.length == 9
    logits2, _ = r.forward([42], [9])
    seq = prefix + [10, 12, 15, 42]
    torch.testing.assert_close(logits2[0], hf(torch.tensor([seq])).logits[0, -1], rtol=1e-4, atol=1e-5)


def test_aux_states_match_training_capture():
    """The aux states the proposer reads are the ones train.py's Target hooks capture."""
    hf = tiny_llama(seed=5)
    t = Target(hf)
    ids = [7, 8, 9, 10, 11, 12]
    r = TargetRunner(hf, t.aux_layers)
    r.reset()
    _, aux = r.forward(ids, list(range(len(ids))))
    torch.testing.assert_close(aux, t(torch.tensor([ids])).aux_hidden[0], rtol=1e-5, atol=1e-6)


def test_draft_tree_tokens_follow_the_draft():
    """Chain drafts are the draft's own autoregressive argmaxes; the top-1 path of a tree is
    the chain; the tree holds topk nodes per depth."""
    hf = tiny_llama(seed=6)
    draft, aux_layers = random_draft(hf, 6)
    emb = hf.get_input_embeddings()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    r = TargetRunner(hf, aux_layers)
    r.reset()
    logits, aux = r.forward(prompt, list(range(7)))
    ids = prompt + [int(logits[-1].argmax())]
    chain = Eagle3Proposer(draft, emb, depth=4)
    chain.prefill(ids, aux)
    t = chain.propose(ids)
    assert t.parents == [-1, 0, 1, 2]
    # brute force: no cache, the full sequence every step
    with torch.no_grad():
        E = emb(torch.tensor([ids]))
        h, past = draft.decode(E[:, 1:], draft.fc(aux[None]), torch.arange(7)[None])
        h = h[:, -1:]
        toks = []
        for k in range(4):
            tok = int(draft.draft_ids[draft.logits(h[0, 0]).argmax()])
            toks.append(tok)
            h, past = draft.decode(emb(torch.tensor([[tok]])), h, torch.tensor([[7 + k]]), past)
    assert t.tokens == toks
    tree = Eagle3Proposer(draft, emb, depth=4, topk=3)
    tree.prefill(ids, aux)
    tt = tree.propose(ids)
    assert tt.depths() == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    # the best-scoring node of each depth is the chain (greedy = best cumulative path here
    # only at depth 1; deeper, the chain's node must at least be present in the tree)
    assert tt.tokens[0] == toks[0]


def test_copy_draft_is_fully_accepted():
    """A draft whose head predicts the target's next token perfectly is accepted at every
    position: τ = K + 1. Built by hand: a target whose next token is always (token + 1) mod V."""
    V = 32
    hf = tiny_llama(vocab=V, seed=7)
    # make the target deterministic: logits depend only on the current token's embedding
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        E = torch.randn(V, hf.config.hidden_size)
        hf.model.embed_tokens.weight.copy_(E)
        hf.model.norm.weight.fill_(1.0)
        En = E / E.pow(2).mean(-1, keepdim=True).sqrt()
        hf.lm_head.weight.copy_(10 * En.roll(1, 0))  # logits(token t) peak at t+1
    prompt = [3, 4, 5]
    assert hf_greedy(hf, prompt, 5) == [6, 7, 8, 9, 10]

    class Oracle(Proposer):  # proposes the true continuation
        def propose(self, ids):
            return Tree([(ids[-1] + 1 + i) % V for i in range(3)], [-1, 0, 1])

    out, st = speculative_generate(TargetRunner(hf), Oracle(), prompt, 21)
    assert out == [(6 + i) % V for i in range(21)]
    assert st.summary()["tau"] == 4.0 and st.accepted_per_pos == [st.drafts] * 3


def test_counters_and_timings_add_up():
    """Per-position acceptance sums to the accepted total, τ = 1 + accepted / steps, and the draft cost
    c is the timed drafting over the timed verification. The proposer knows the greedy continuation and
    gets the first (step % 5) of its 4 tokens right, so every counter is known; sleeping 20 ms per
    proposal costs at least 20 ms x steps of drafting, and speed-up = τ / (1 + c)."""
    hf = tiny_llama(seed=3)
    prompt = list(range(3, 20))
    ref, V = hf_greedy(hf, prompt, 40), hf.config.vocab_size

    class Known(Proposer):
        def __init__(self, sleep):
            self.step, self.sleep = 0, sleep

        def propose(self, ids):
            time.sleep(self.sleep)
            n, good = len(ids) - len(prompt), self.step % 5
            self.step += 1
            true = ref[n : n + 4]
            return Tree([t if i < good else (t + 1) % V for i, t in enumerate(true)], [-1, 0, 1, 2])

    want_acc, n, i = [0] * 4, 1, 0  # the prefill makes token 1; step i accepts min(i % 5, 4) and adds one
    while n < 30:
        a = min(i % 5, 4)
        want_acc = [w + (j < a) for j, w in enumerate(want_acc)]
        n, i = n + a + 1, i + 1
    stats = {}
    for sleep in (0.0, 0.02):
        out, st = speculative_generate(TargetRunner(hf), Known(sleep), prompt, 30)
        assert out == ref[:30] and st.drafts == i and st.accepted_per_pos == want_acc
        stats[sleep] = st
    st, s = stats[0.02], stats[0.02].summary()
    assert sum(st.accepted_per_pos) == st.accepted == sum(min(j % 5, 4) for j in range(i))
    assert s["tau"] == pytest.approx(1 + st.accepted / st.drafts)
    assert s["acceptance_per_pos"] == pytest.approx([a / st.drafts for a in want_acc])
    assert st.draft_seconds >= 0.02 * st.drafts > stats[0.0].draft_seconds
    assert s["draft_cost"] == pytest.approx(st.draft_seconds / st.target_seconds, rel=1e-4)
    assert s["expected_speedup"] == pytest.approx(s["tau"] / (1 + s["draft_cost"]))
    plain = speculative_generate(TargetRunner(hf), Proposer(), prompt, 30)[1].summary()
    assert plain["tau"] == 1.0 and plain["draft_cost"] < 0.05 and plain["expected_speedup"] > 0.95
    total = SpecStats()
    total.add(stats[0.0])
    total.add(st)
    assert total.draft_seconds == pytest.approx(st.draft_seconds + stats[0.0].draft_seconds)
    assert total.accepted_per_pos == [2 * a for a in want_acc]


def test_fixed_k_proposers_verify_the_first_k():
    """A block / parallel draft trained for K = 4 verified at k = 2: every step proposes the first 2
    of the 4 tokens it drafts at k = 4, and the output stays greedy."""
    hf = tiny_llama(seed=4)
    aux = Target(hf).aux_layers
    torch.manual_seed(0)
    block = DFlashDraft(DFlashConfig.from_target(hf.config, aux, 5, 1, 1)).eval()
    peagle = PEagleDraft(PEagleConfig.from_target(hf.config, 48, aux, mask_token_id=1, depths=4)).eval()
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings().weight
    prompt = list(range(5, 21))
    _, h_aux = TargetRunner(hf, aux).forward(prompt, list(range(len(prompt))))
    for make in (lambda d: BlockProposer(block, emb, head, depth=d), lambda d: PEagleProposer(peagle, emb, d)):
        full, first2 = make(None), make(2)
        assert full.depth == 4 and first2.depth == 2 and first2.name.endswith("4-first2")
        ids = prompt + [7]
        full.prefill(ids, h_aux)
        first2.prefill(ids, h_aux)
        assert first2.propose(ids).tokens == full.propose(ids).tokens[:2]
        out, st = speculative_generate(TargetRunner(hf, aux), make(2), prompt, 12)
        assert out == hf_greedy(hf, prompt, 12) and st.draft_tokens == 2 * st.drafts
        with pytest.raises(ValueError, match="verify 1..4"):
            make(5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain3", "tree3x4"])
def test_smollm2_output_equals_greedy(smollm2_dir, smollm2_tokenizer, mode):
    """The real target: spec decoding with an (untrained) draft gives the greedy text."""
    from transformers import AutoModelForCausalLM  # heavy (transformers): not at module import

    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    draft, aux = random_draft(hf, 0, draft_vocab=512)
    # an untrained draft with the target's own head proposes plausible tokens
    with torch.no_grad():
        draft.lm_head.weight.copy_(hf.lm_head.weight[draft.draft_ids])
    eos = eos_ids(hf, smollm2_tokenizer)
    k, d = (1, 3) if mode == "chain3" else (3, 4)
    for text in ["What is 2+2?", "Write a haiku about the sea."]:
        prompt = render(smollm2_tokenizer, [{"role": "user", "content": text}])
        out, _ = speculative_generate(
            TargetRunner(hf, aux), Eagle3Proposer(draft, hf.get_input_embeddings(), d, k), prompt, 24, eos
        )
        assert out == hf_greedy(hf, prompt, 24, eos)


def test_packaged_prompt_sets():
    mt, he, gsm = load_prompts("mtbench", 0), load_prompts("humaneval", 0), load_prompts("gsm8k", 0)
    assert (len(mt), len(he), len(gsm)) == (80, 164, 1319)
    assert all(len(t) == 2 for t in mt) and all(len(t) == 1 for t in he + gsm)
    assert he[0][0].startswith("from typing import List") and len(load_prompts("gsm8k", 5)) == 5


def tiny_eval_args(tiny_run_inputs, tmp_path) -> dict:
    """evaluate.EvalArgs fields for the tiny target and a random EAGLE-3 checkpoint of its own."""
    from transformers import AutoModelForCausalLM  # heavy (transformers): not at module import

    target_dir, _ = tiny_run_inputs
    run, _, _ = make_checkpoint(tmp_path, hf=AutoModelForCausalLM.from_pretrained(target_dir), draft_vocab=64)
    return dict(draft=str(run), target=str(target_dir), num_prompts=0)


def test_evaluate_cli_on_tiny_target(tiny_run_inputs, tmp_path):
    """The CLI end to end on a tiny target with SmolLM2's chat template: every mode reproduces
    greedy decoding (--check-greedy) and the JSON line holds the counters."""
    on_tiny = tiny_eval_args(tiny_run_inputs, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"turns": ["Hi there", "And again"]}) + "\n" + json.dumps({"prompt": "Count to ten."}) + "\n"
    )
    res = evaluate.main(
        evaluate.EvalArgs(
            **on_tiny,
            data=(str(prompts),),
            max_new_tokens=12,
            k=(2, 3),
            tree_topk=2,
            tree_depth=3,
            ngram=True,
            check_greedy=True,
            out=str(tmp_path / "r.jsonl"),
        )
    )
    r = res["results"]["p"]
    assert set(r) == {"eagle3-chain2", "eagle3-chain3", "eagle3-tree2x3", "ngram"}
    for s in r.values():
        assert s["prompts"] == 3 and s["tau"] >= 1.0 and s["target_forwards"] == s["prompts"] + s["drafts"]
    assert len(r["eagle3-chain3"]["acceptance_per_pos"]) == 3
    assert json.loads((tmp_path / "r.jsonl").read_text())["results"] == res["results"]
    # the draft vocabulary's share of the output tokens bounds what a chain can have accepted
    cover = res["draft_vocab_coverage"]["p"]
    assert 0.0 <= cover <= 1.0
    assert set(res["draft_vocab_windows"]["p"]) == {"2", "3"}  # one share per chain length evaluated
    for name in ("eagle3-chain2", "eagle3-chain3"):
        assert r[name]["accepted"] <= cover * r[name]["new_tokens"] + 1e-9


def test_evaluate_batched_chains(tiny_run_inputs, tmp_path):
    """--batch 2: chains decode two conversations at once (turn by turn) and give the batch-1
    counters; the tree runs one at a time as before."""
    on_tiny = tiny_eval_args(tiny_run_inputs, tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps(x)
            for x in ({"turns": ["Hi there", "And again"]}, {"prompt": "Count to ten."}, {"turns": ["One", "Two"]})
        )
        + "\n"
    )
    res = {
        b: evaluate.main(
            evaluate.EvalArgs(
                **on_tiny,
                data=(str(prompts),),
                max_new_tokens=12,
                k=(3,),
                tree_topk=2,
                tree_depth=2,
                batch=b,
                check_greedy=True,
            )
        )["results"]["p"]
        for b in (1, 2)
    }
    assert res[2]["eagle3-chain3"]["prompts"] == 5
    clock = ("seconds", "draft_seconds", "target_seconds", "draft_cost", "expected_speedup")  # batched: not timed
    assert res[2]["eagle3-chain3"]["draft_cost"] is None and res[2]["eagle3-tree2x2"]["draft_cost"] > 0
    assert res[1] == {k: {**v, **{c: res[1][k][c] for c in clock}} for k, v in res[2].items()}


def test_evaluate_resume_file(tiny_run_inputs, tmp_path, monkeypatch):
    """--resume-file: a second run with the same draft and settings takes the saved datasets
    (it decodes nothing) and returns the same results; other weights or settings decode again."""
    on_tiny = tiny_eval_args(tiny_run_inputs, tmp_path)
    data = []
    for name, conv in (("a", {"prompt": "Count to ten."}), ("b", {"turns": ["Hi there", "And again"]})):
        (tmp_path / f"{name}.jsonl").write_text(json.dumps(conv) + "\n")
        data.append(str(tmp_path / f"{name}.jsonl"))
    resume = tmp_path / "partial.json"
    args = dict(on_tiny, max_new_tokens=8, k=(2,), resume_file=str(resume))
    first = evaluate.main(evaluate.EvalArgs(data=(data[0],), **args))
    assert set(json.loads(resume.read_text())["results"]) == {"a"}

    decoded = []
    real = evaluate.run_dataset
    monkeypatch.setattr(
        evaluate, "run_dataset", lambda t, p, tok, convs, *r: decoded.append(len(convs)) or real(t, p, tok, convs, *r)
    )
    both = evaluate.main(evaluate.EvalArgs(data=tuple(data), **args))  # "a" from the file, "b" decoded
    assert decoded == [1] and both["results"]["a"] == first["results"]["a"]
    assert set(json.loads(resume.read_text())["results"]) == {"a", "b"}
    again = evaluate.main(evaluate.EvalArgs(data=tuple(data), **args))
    assert decoded == [1] and again["results"] == both["results"]

    evaluate.main(evaluate.EvalArgs(data=tuple(data), **{**args, "max_new_tokens": 6}))  # other settings: decode both
    assert decoded == [1, 1, 1]
    # a file it did not write (not JSON, or JSON without key and results: e.g. the chats file given by mistake)
    # is refused, not replaced by the results (issue 35: it was lost); evaluate writes its file whole, so a
    # damaged one is not one of its own either
    for text in ("{not json", json.dumps({"messages": []}) + "\n"):
        resume.write_text(text)
        with pytest.raises(SystemExit, match=f"error: --resume-file {resume} is not a results file evaluate.py wrote"):
            evaluate.main(evaluate.EvalArgs(data=(data[0],), **args))
        assert resume.read_text() == text and decoded == [1, 1, 1]


def test_split_halves_by_conversation():
    """evaluate.split_halves: τ of even and odd conversations, every turn of a conversation on its side
    (MT-Bench's two turns must not become the two halves)."""

    def st(drafts, accepted):
        return SpecStats(drafts=drafts, accepted=accepted, target_forwards=drafts + 1, accepted_per_pos=[accepted])

    convs = [["a", "b"], ["c", "d"], ["e"]]  # turns in order: a b | c d | e
    turns = [(None, None, st(10, 10)), (None, None, st(10, 0)), (None, None, st(5, 5)), (None, None, st(5, 5))]
    turns.append((None, None, st(10, 20)))
    # even conversations 0 and 2: 30 accepted over 30 drafts -> 2.0; odd conversation 1: 10 over 10 -> 2.0
    assert split_halves(turns, convs) == [2.0, 2.0]
    assert split_halves(turns[:2], convs[:1]) == [1.5]  # one conversation: one half
    with pytest.raises(ValueError):
        split_halves(turns[:3], convs)
