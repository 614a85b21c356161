"""Tiny random models and data for tests (no downloads)."""

import dataclasses

import torch

from data.chat import Example
from data.datasets import collate
from models.target import Target
from models.tiny import TINY_TRAIN, tiny_llama  # noqa: F401 (the tests import both from here too)

# The target-backend tests' shape (test_fast_target, test_tensor_parallel): GQA 4 / 2, head dim 16; each
# adds its layer count and model type
TINY_TARGET_SHAPE = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)
# llama3 rope scaling with a short original context, so positions up to 256 reach all three bands
LLAMA3_SHORT_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)


def tiny_target_batch(seed, n_examples=3, min_len=4, max_len=11, **llama_kw):
    """(hf model, its models/target.Target, random examples, their collated batch): a draft test's
    tiny target and data, all seeded by `seed`."""
    torch.manual_seed(seed)
    hf = tiny_llama(seed=seed, **llama_kw)
    target = Target(hf)
    examples = random_examples(n_examples, hf.config.vocab_size, min_len=min_len, max_len=max_len, seed=seed)
    return hf, target, examples, collate(examples)


def to_device(batch, device="cuda"):
    """A batch dataclass (Eagle3Batch, PEagleBatch, ...) with its tensors on `device`; fields that are
    None (doc_ids / position_ids of unpacked rows) stay None."""
    return dataclasses.replace(
        batch,
        **{
            f.name: getattr(batch, f.name).to(device)
            for f in dataclasses.fields(batch)
            if torch.is_tensor(getattr(batch, f.name))
        },
    )


def random_examples(n, vocab, min_len=5, max_len=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        T = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(0, vocab, (T,), generator=g).tolist()
        mask = (torch.rand(T, generator=g) < 0.7).long().tolist()
        out.append(Example(ids, mask))
    return out
