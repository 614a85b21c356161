"""Batched block drafting (DFlash, DSpark, Domino through core/batched_chain.py, evaluate.py --batch) gives, per
prompt, the batch-1 BlockProposer's outputs and counters (float64, so batched and unbatched matmuls cannot round
a near-tie differently): ragged prompt lengths, rows that finish early (EOS) and rows that keep going, blocks
verified whole and in part (depth < K)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from core.batched_chain import batched_generate
from core.speculative import TargetRunner, proposer_for, speculative_generate
from models.dflash import BlockRows, DFlashConfig, DFlashDraft
from models.domino import DominoConfig, DominoDraft
from models.dspark import DSparkConfig, DSparkDraft, DSparkProposer
from models.proposer import Proposer
from models.tiny import tiny_llama
from tests.test_batched_chain import first_proposal, first_proposals_batched, prompts_for
from tests.test_speculative import one_thread  # noqa: F401 (autouse fixture)

FAMILIES = {
    "dflash": (DFlashConfig, DFlashDraft),
    "dspark": (DSparkConfig, DSparkDraft),
    "domino": (DominoConfig, DominoDraft),
}


def block_draft(hf, family: str, K: int, seed: int):
    """A random draft of `family` drafting K tokens per block on hf (two layers, non-trivial norms), float64."""
    cfg_cls, cls = FAMILIES[family]
    aux = [0, 2, 4]
    c = cfg_cls.from_target(hf.config, aux, K + cls.prediction_offset, mask_token_id=5, num_layers=2)
    torch.manual_seed(seed)
    d = cls(c)
    for p in d.parameters():
        p.data += 0.1 * torch.randn_like(p)
    return d.double().eval()


def batch_one(hf, draft, prompts, depth, max_new, eos=()):
    runner = TargetRunner(hf, draft.config.aux_layers)
    return [speculative_generate(runner, proposer_for(draft, hf, depth=depth), p, max_new, eos) for p in prompts]


@pytest.mark.parametrize(
    "family,K,depth,seed",
    [("dflash", 3, 3, 3), ("dflash", 5, 2, 1), ("dspark", 3, 3, 3), ("dspark", 4, 2, 1), ("domino", 3, 3, 2)],
)
def test_batched_blocks_equal_batch_one(family, K, depth, seed):
    # a small vocabulary, so random drafts are accepted now and then: rows accept different numbers per step
    hf = tiny_llama(vocab=12, seed=seed).double()
    draft = block_draft(hf, family, K, seed)
    prompts = [[t % 12 for t in p] for p in prompts_for(seed, 6)]
    ref = batch_one(hf, draft, prompts, depth, 30)
    eos = [ref[2][0][5]]  # a token prompt 2 emits: some rows stop early, at different steps
    ref = batch_one(hf, draft, prompts, depth, 30, eos)
    prop = proposer_for(draft, hf, depth=depth)
    assert prop.batches and isinstance(prop.rows(), BlockRows)
    got = batched_generate(hf, prop.rows(), draft.config.aux_layers, prompts, depth, 30, eos)
    assert len({len(o) for o, _ in ref}) > 1  # rows really finish at different lengths
    assert len({s.accepted for _, s in ref}) > 1  # and rows accept different numbers of drafts
    for (o_ref, s_ref), (o, s) in zip(ref, got):
        assert o == o_ref
        assert s == s_ref
    # the later slots' drafts are seldom accepted from a random draft: their tokens themselves, first step, every row
    aux = draft.config.aux_layers
    first = [first_proposal(hf, proposer_for(draft, hf, depth=depth), aux, p) for p in prompts]
    assert first_proposals_batched(hf, proposer_for(draft, hf, depth=depth).rows(), aux, prompts, depth) == first
    runner = TargetRunner(hf, draft.config.aux_layers)
    for p, (o, _) in zip(prompts, got):  # and so: the target's greedy tokens (plain decoding, batch 1)
        assert o == speculative_generate(runner, Proposer(), p, 30, eos)[0]


def test_which_block_proposers_batch():
    """A DSpark confidence cut verifies a different number of drafts per row: it decodes one prompt at a time."""
    hf = tiny_llama(vocab=12, seed=0).double()
    draft = block_draft(hf, "dspark", 3, 0)
    emb, head = hf.get_input_embeddings(), hf.get_output_embeddings().weight
    assert DSparkProposer(draft, emb, head).batches
    assert not DSparkProposer(draft, emb, head, min_survival=0.5).batches


def block_checkpoint(target_dir, tmp_path, family: str) -> dict:
    """A random `family` draft (K = 4) for the tiny target saved as a training checkpoint, and 3 conversations (5
    turns) of prompts: evaluate.EvalArgs' draft, target, num_prompts and data."""
    from transformers import AutoModelForCausalLM  # heavy (transformers): not at module import

    hf = AutoModelForCausalLM.from_pretrained(target_dir)
    config_cls, draft_cls = FAMILIES[family]
    c = config_cls.from_target(hf.config, [0, 1, 3], 4, mask_token_id=5, num_layers=1)
    torch.manual_seed(0)
    draft = draft_cls(c)
    step = tmp_path / "run" / "ckpt" / "step_1"
    step.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in draft.state_dict().items()}, step / "draft.safetensors")
    meta = {"strategy": family, "draft": c.to_dict(), "target": str(target_dir)}
    (step / "config.json").write_text(json.dumps(meta))
    (tmp_path / "run" / "ckpt" / "latest").write_text("step_1")
    prompts = tmp_path / "p.jsonl"
    convs = ({"turns": ["Hi there", "And again"]}, {"prompt": "Count to ten."}, {"turns": ["One", "Two"]})
    prompts.write_text("\n".join(json.dumps(x) for x in convs) + "\n")
    return dict(draft=str(tmp_path / "run"), target=str(target_dir), num_prompts=0, data=(str(prompts),))


def test_evaluate_batched_blocks(tiny_run_inputs, tmp_path):
    """evaluate.py --batch 2 with a DFlash checkpoint: blocks decode two conversations at once (turn by turn) with
    the batch-1 counters, greedy-exact (--check-greedy); the batched rows are not timed."""
    import evaluate  # an entry script (torch, transformers): only this test needs it

    args = block_checkpoint(tiny_run_inputs[0], tmp_path, "dflash")
    res = {
        b: evaluate.main(evaluate.EvalArgs(**args, max_new_tokens=12, k=(2, 3), batch=b, check_greedy=True))["results"][
            "p"
        ]
        for b in (1, 2)
    }
    assert set(res[2]) == {"dflash-block3-first2", "dflash-block3"} and res[2]["dflash-block3"]["prompts"] == 5
    clock = ("seconds", "draft_seconds", "target_seconds", "draft_cost", "expected_speedup")  # batched: not timed
    assert res[2]["dflash-block3"]["draft_cost"] is None
    assert res[1] == {k: {**v, **{c: res[1][k][c] for c in clock}} for k, v in res[2].items()}


def test_evaluate_dspark_confidence_cut(tiny_run_inputs, tmp_path):
    """evaluate.py --min-survival: a DSpark draft's blocks cut by its confidence head, one run per threshold and -k,
    greedy-exact (--check-greedy); a cut verifies fewer than K tokens at some steps; 1.0 cuts every block (a
    confidence is a sigmoid, below 1): plain decoding. Other families and thresholds outside (0, 1] are refused."""
    import evaluate  # an entry script (torch, transformers): only this test needs it

    args = block_checkpoint(tiny_run_inputs[0], tmp_path / "dspark", "dspark")
    res = evaluate.main(
        evaluate.EvalArgs(**args, max_new_tokens=12, k=(4,), min_survival=(0.3, 1.0), check_greedy=True)
    )
    rows = res["results"]["p"]
    assert set(rows) == {"dspark-block4", "dspark-block4-cut0.3", "dspark-block4-cut1"}
    full, cut, none = rows["dspark-block4"], rows["dspark-block4-cut0.3"], rows["dspark-block4-cut1"]
    assert full["draft_tokens"] == 4 * full["drafts"]
    assert 0 < cut["draft_tokens"] < 4 * cut["drafts"]  # the random head cuts some blocks, not all
    assert none["draft_tokens"] == 0 and none["tau"] == 1.0
    dflash = block_checkpoint(tiny_run_inputs[0], tmp_path / "dflash", "dflash")
    with pytest.raises(SystemExit, match="--min-survival applies to dspark drafts"):
        evaluate.main(evaluate.EvalArgs(**dflash, max_new_tokens=4, min_survival=(0.5,)))
    with pytest.raises(SystemExit, match=r"--min-survival takes thresholds in \(0, 1\], got 0.0"):
        evaluate.main(evaluate.EvalArgs(**args, min_survival=(0.0,)))
