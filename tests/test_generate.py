"""models/generate.SlotGenerator (continuous batching on the compiled target's layers) against
HF's own greedy decoding, one prompt at a time: same tokens, whatever the slot count, the sync
interval and the order requests arrive in; capture.py regenerate --engine slots == --engine hf."""

import pytest
import torch

from models.fast_target import FastTarget
from models.generate import Sampling, SlotGenerator, sample
from tests.test_fast_target import hf_model


def hf_greedy(model, prompt, max_new, eos):
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=0
    )[0, len(prompt) :].tolist()
    cut = next((j for j, t in enumerate(out) if t in eos), None)
    return out[:cut] if cut is not None else out, cut is None and len(out) >= max_new


def run_all(gen, prompts):
    for i, p in enumerate(prompts):
        gen.add(i, p)
    got = {}
    while gen.busy():
        for key, toks, hit in gen.step():
            assert key not in got
            got[key] = (toks, hit)
    return got


@pytest.mark.parametrize("kind,slots,sync", [("llama", 3, 4), ("llama", 16, 1), ("qwen3", 2, 5), ("qwen3_moe", 4, 3)])
def test_greedy_equals_hf_generate(kind, slots, sync):
    hf = hf_model(kind, seed=2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 1, 30, 9, 12, 3)]
    free_run = hf_greedy(hf, prompts[0], 20, [-1])[0]
    eos = [free_run[6], 1000]  # so that some rows stop early (the second id never occurs)
    want = {i: hf_greedy(hf, p, 20, eos) for i, p in enumerate(prompts)}
    assert any(not hit for _, hit in want.values())
    gen = SlotGenerator(
        FastTarget.from_hf_model(hf),
        slots=slots,
        max_prompt_len=32,
        max_new_tokens=20,
        stop_ids=eos,
        sync_every=sync,
        prefill_tokens=40,
    )
    assert run_all(gen, prompts) == want


@pytest.mark.parametrize("kind,slots,sync", [("llama", 3, 4), ("qwen3", 5, 2)])
def test_flex_decode_equals_hf_generate(kind, slots, sync):
    """The flex path (compiled FlexAttention, each slot masked to its own length, one cache length
    for all) gives HF's greedy tokens too; prompts long enough that slots sit in different blocks."""
    hf = hf_model(kind, seed=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (130, 5, 250, 1, 127, 40)]
    want = {i: hf_greedy(hf, p, 12, [-1]) for i, p in enumerate(prompts)}
    gen = SlotGenerator(
        FastTarget.from_hf_model(hf), slots=slots, max_prompt_len=250, max_new_tokens=12, stop_ids=[-1],
        sync_every=sync, flex=True,
    )  # fmt: skip
    assert gen.flex and gen.L % 128 == 0
    assert run_all(gen, prompts) == want
    assert gen.kv_positions_read > 0


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    assert sample(logits, Sampling(), g).eq(3).all()
    top2 = sample(logits, Sampling(temperature=1.0, top_k=2), g)
    assert set(top2.tolist()) == {2, 3}
    p = logits[0].softmax(-1)  # [.03, .09, .24, .64]: top-p 0.8 keeps {3, 2}, 0.5 keeps {3}
    assert set(sample(logits, Sampling(temperature=1.0, top_p=0.8), g).tolist()) == {2, 3}
    assert set(sample(logits, Sampling(temperature=1.0, top_p=0.5), g).tolist()) == {3}
    free = sample(logits, Sampling(temperature=1.0), g)
    torch.testing.assert_close(torch.bincount(free, minlength=4).float() / 2000, p, atol=0.03, rtol=0)


def test_prompt_limits():
    gen = SlotGenerator(
        FastTarget.from_hf_model(hf_model("llama")), slots=2, max_prompt_len=8, max_new_tokens=4, stop_ids=[0]
    )
    with pytest.raises(ValueError, match="1..8"):
        gen.add("x", list(range(9)))
    with pytest.raises(ValueError):
        gen.add("x", [])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind,sampling", [("llama", Sampling()), ("qwen3", Sampling(temperature=0.8, top_p=0.9))])
def test_cuda_graph_steps_equal_eager(kind, sampling):
    """The decode step replayed from CUDA graphs (plain attention: one per cache bucket, lengths
    cross a bucket here; flex attention: one graph) gives the eager plain step's tokens exactly,
    greedy and sampled (same generator seed), in fp32."""
    hf = hf_model(kind, seed=3).cuda()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, hf.config.vocab_size, (n,), generator=g).tolist() for n in (5, 120, 1, 64, 9, 200, 3)]
    got = []
    for graphs, flex in ((False, False), (True, False), (True, True)):
        gen = SlotGenerator(
            FastTarget.from_hf_model(hf), slots=4, max_prompt_len=200, max_new_tokens=60, stop_ids=[7],
            sampling=sampling, seed=5, sync_every=4, cuda_graphs=graphs, flex=flex,
        )  # fmt: skip
        got.append(run_all(gen, prompts))
        assert (gen.graphs is not None) == graphs
        assert not graphs or (len(gen.graphs) == 1 if flex else len(gen.graphs) >= 2)
    assert got[0] == got[1] == got[2]
