"""Target features for the draft: the frozen target run over tokenized examples, packed as one
FeatureStore shard (data/feature_store.py). Written offline by `capture.py features` and online by
the disaggregated producers (disagg/roles.py)."""

import torch

from data.datasets import collate
from models.target import Target, fingerprint


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first into batches of at most batch_tokens padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + [cur] if cur else out


@torch.no_grad()
def capture_examples(target: Target, examples, batch_tokens: int, device) -> dict[str, torch.Tensor]:
    """Run the target over examples; returns the shard tensors with samples packed along dim 0
    in the given order: input_ids/loss_mask [N], aux_hidden [N, n_aux*H], final_hidden [N, H]."""
    lengths = [len(e.input_ids) for e in examples]
    aux, fin = [None] * len(examples), [None] * len(examples)
    for batch in length_batches(lengths, batch_tokens):
        b = collate([examples[i] for i in batch])
        f = target(b["input_ids"].to(device), b["attention_mask"].to(device))
        a, h = f.aux_hidden.cpu(), f.final_hidden.cpu()  # one copy per batch
        for j, i in enumerate(batch):
            aux[i], fin[i] = a[j, : lengths[i]], h[j, : lengths[i]]
    return {
        "input_ids": torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for e in examples for m in e.loss_mask], dtype=torch.uint8),
        "aux_hidden": torch.cat(aux),
        "final_hidden": torch.cat(fin),
    }


def target_identity(target) -> dict:
    """What makes features comparable: the weights (fingerprint) and the shape, not the path."""
    c = target.config
    fp = fingerprint(target.path) if target.path is not None else "unsaved"
    return {
        "fingerprint": fp,
        "model_type": c.model_type,
        "num_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
    }
