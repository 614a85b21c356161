"""Tiny random Llama targets, for tests, golden numbers (tools/golden.py) and smoke runs of experiments: built
in-process, no download. train.py flags for a run on one that takes seconds: TINY_TRAIN."""

import torch

# train.py flags for a run on the tiny target (tests/conftest.py tiny_run_inputs) that takes seconds, for every
# family (so no family's own option). The EAGLE drafts keep the default --draft-vocab-size 8192: a random
# target's argmax is spread over all 49k tokens, a small draft vocab would leave whole batches with no trained
# position (loss 0), and comparisons of such runs would be vacuous.
TINY_TRAIN = (
    "--num-records 60 --holdout 4 --max-len 64 --batch-size 4 --ttt-length 3 --lr 1e-3 --warmup 2 --no-progress".split()
)


def tiny_llama(vocab=96, hidden=32, layers=5, heads=4, kv_heads=2, seed=0, **kw):
    """A transformers LlamaForCausalLM with random weights (seeded), in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: TINY_TRAIN's readers need no transformers (~1.5 s)

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        **kw,
    )
    return LlamaForCausalLM(cfg).eval()
