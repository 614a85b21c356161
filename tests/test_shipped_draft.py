"""The shipped draft (drafts/smollm2-135m-eagle3): it fits the default target and nothing else,
our evaluator decodes with it at a useful τ, and vLLM's CPU build serves it with the same τ
(within 3%) and the same greedy text."""

import json
from pathlib import Path

import pytest

from evaluate import EvalArgs
from evaluate import main as evaluate
from export import open_draft, target_mismatch

DRAFT = Path(__file__).resolve().parents[1] / "drafts" / "smollm2-135m-eagle3"


def test_shipped_draft_fits_the_default_target_only(smollm2_dir, smollm2_tokenizer, tiny_run_inputs):
    draft, meta = open_draft(DRAFT)
    tc = json.loads((smollm2_dir / "config.json").read_text())
    assert meta["target"] == "smollm2" and target_mismatch(draft.config, tc, smollm2_tokenizer, meta) == []
    prov = json.loads((DRAFT / "provenance.json").read_text())
    assert prov["heldout"]["acc_0"] >= 0.70 and prov["data"] == "smollm2-mix"
    # a target of the same vocabulary but another width and depth is refused, naming both
    with pytest.raises(SystemExit, match=r"does not fit target .*hidden size.*576.*64.*aux layers"):
        evaluate(EvalArgs(draft=str(DRAFT), target=str(tiny_run_inputs[0]), num_prompts=1, max_new_tokens=4))


@pytest.mark.slow
def test_vllm_serves_the_shipped_draft_at_our_tau(tmp_path):
    """Served by vLLM 0.32 (CPU build, its own venv) on GSM8K prompts at K = 3: τ within 3% of
    our evaluator's on the same prompts, and above a draft-free lookup's ~1.6 (1.81 measured here on
    these 3 prompts; 1.93 over 8 GSM8K prompts at 128 tokens, README)."""
    r = evaluate(
        EvalArgs(draft=str(DRAFT), data=("gsm8k",), num_prompts=3, max_new_tokens=64, k=(3,), vllm=True, threads=2)
    )
    ours = r["results"]["gsm8k"]["eagle3-chain3"]["tau"]
    agree = r["vllm"]["chain3"]["gsm8k"]
    assert ours > 1.7, ours
    assert agree["rel_diff"] <= 0.03, agree
    assert agree["identical_outputs"].split("/")[0] == agree["identical_outputs"].split("/")[1], agree
