"""Target features for the draft: the frozen target run over tokenized examples, packed as one
FeatureStore shard (data/feature_store.py). Written offline by `capture.py features` and online by
the disaggregated producers (core/disagg/roles.py).

The target forward is ours (models/target.Target over transformers; --backend hf, the reference)
or vLLM's (VllmTarget: --backend vllm, a vLLM engine in its own venv, core/vllm_features.py):
both return the same Features, so the store, the producers and the trainer do not tell them apart."""

import fcntl
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from data.datasets import collate
from data.feature_store import FeatureStore, StoredExample, StoreError, open_feature_store
from models.target import Features, Target, TargetHeads, fingerprint, load_heads, seed_drawn_at_load

BACKENDS = ("hf", "compiled", "vllm")  # train.py / capture.py / producers --backend: who runs the target forward
# (train.py's default "auto" is resolved by pick_backend)


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


def pick_backend(target_dir: Path, kind: str) -> tuple[str, str | None]:
    """--backend auto -> (backend, why the compiled one is not taken on this GPU, or None)."""
    if kind != "cuda":
        return "hf", None
    from models.fast_target import TargetConfig  # lazy: fast_target imports flex attention and dynamo (seconds)

    try:
        TargetConfig.from_dict(json.loads((Path(target_dir) / "config.json").read_text()))
    except (NotImplementedError, KeyError) as e:
        return "hf", f"the compiled target does not build this one ({e})"
    if not any(Path(target_dir).glob("*.safetensors")) and seed_drawn_at_load(target_dir) is None:
        return "hf", f"{target_dir} has no .safetensors files (the compiled target reads only those)"
    return "compiled", None


def load_target(
    backend: str,
    spec,
    aux_layers=None,
    dtype=torch.float32,
    device="cpu",
    max_len: int = 2048,
    vllm_target=None,
    tp_mesh=None,
):
    """The target for --backend (max_len: the longest sample, which vLLM must accept). vllm_target:
    core/vllm_features.vllm_target, passed in by the entry scripts (vLLM's venv and layer ids belong
    to tools/ and export.py, which library code does not import). tp_mesh: the compiled target split
    over it by tensor parallelism (train.py --tp)."""
    if backend == "auto":
        backend, why = pick_backend(spec, torch.device(device).type)
        if why:
            print(f"[target] --backend hf: {why}", flush=True)
    if backend == "hf":
        return Target.load(spec, aux_layers, dtype, device)
    if backend == "compiled":
        from models.fast_target import FastTarget  # imports flex attention and dynamo (seconds)

        target = FastTarget.from_pretrained(spec, aux_layers, dtype, device)
        if tp_mesh is not None:
            target.parallelize(tp_mesh)
        if torch.device(device).type == "cuda":
            target.compile_layers(dynamic=None)  # batch shapes vary unless --compile pads them
        return target
    if backend == "vllm":
        if vllm_target is None:
            raise ValueError("--backend vllm: the caller passes core/vllm_features.vllm_target")
        return vllm_target(spec, aux_layers, dtype, device, max_len)
    raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


class VllmTarget(TargetHeads):
    """The target run by vLLM: Target's Features from vLLM's own forward (a long-lived engine,
    core/vllm_features.FeatureWorker; built by core/vllm_features.vllm_target). It asks vLLM for
    the aux layers' outputs and the last layer's output, which vLLM gives before the final norm:
    the norm is applied here (loaded with the embeddings and lm_head, which the trainer needs
    anyway), so final_hidden means what it means for Target and logits = lm_head(final_hidden)
    are the target's. vLLM runs every document as its own request, so packed rows (doc_ids) need
    no attention mask here."""

    def __init__(self, heads: TargetHeads, worker):
        super().__init__(heads.config, heads.embed_tokens, heads.lm_head, heads.aux_layers, heads.path, heads.norm)
        self.worker = worker

    def close(self):
        self.worker.close()

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, doc_ids=None, position_ids=None) -> Features:
        """As Target.forward: [B, T] rows (right padding, or packed documents) -> Features [B, T, ...];
        padding positions are zeros."""
        B, T = input_ids.shape
        if doc_ids is not None:  # (row, start, length) of every document
            segs = [(b, s, n) for b in range(B) for s, n in _runs(doc_ids[b].tolist())]
        else:
            lengths = attention_mask.sum(1).tolist() if attention_mask is not None else [T] * B
            segs = [(b, 0, int(n)) for b, n in enumerate(lengths)]
        ids = input_ids.cpu()
        prompts = [ids[b, s : s + n].tolist() for b, s, n in segs]
        hidden = read_hidden(self.worker.hidden_files(prompts), prompts)
        H = self.config.hidden_size
        dtype, dev = self.embed_tokens.weight.dtype, self.embed_tokens.weight.device
        aux = torch.zeros(B, T, len(self.aux_layers) * H, dtype=dtype, device=dev)
        fin = torch.zeros(B, T, H, dtype=dtype, device=dev)
        for (b, s, n), h in zip(segs, hidden):
            h = h.to(dev, dtype)
            aux[b, s : s + n] = h[:, :-1].flatten(1)
            fin[b, s : s + n] = self.norm(h[:, -1])
        return Features(aux_hidden=aux, final_hidden=fin)


def _runs(doc: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each document of a packed row (doc ids never decrease; -1 = padding)."""
    out, start = [], 0
    for t in range(1, len(doc) + 1):
        if t == len(doc) or doc[t] != doc[start]:
            if doc[start] >= 0:
                out.append((start, t - start))
            start = t
    return out


def read_hidden(files: list[Path], prompts: list[list[int]]) -> list[torch.Tensor]:
    """The connector's files (core/vllm_features.py), one per prompt: hidden states
    [n, len(layer ids), H] each; the files and their lock files are deleted. A file whose
    token ids are not its prompt's is an error (a mix-up must not become training data)."""
    out = []
    for f, p in zip(files, prompts, strict=True):
        lock = Path(f"{f}.lock")
        if lock.exists():  # vLLM's writer thread holds it (LOCK_EX) until the file is complete
            with open(lock) as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
        t = load_file(f)
        if t["token_ids"].tolist() != list(p) or t["hidden_states"].shape[0] != len(p):
            raise RuntimeError(
                f"{f}: vLLM's hidden states are for other tokens ({t['hidden_states'].shape[0]} rows, "
                f"{len(p)} prompt tokens)"
            )
        out.append(t["hidden_states"])
        os.remove(f)
        lock.unlink(missing_ok=True)
    return out


# ---- train.py --features: the store read back as the trainer's Features (data/ holds the store itself,
# which knows no target; these two tie it to one)
def open_for_training(root, target_dir, aux_layers, dtype, device):
    """(store, examples, TargetHeads) for train.py --features: checks that the store was captured
    from this target (weights fingerprint) with these aux layers, and loads only the target's
    embeddings and lm_head."""
    store, examples = open_feature_store(root)
    want = store.schema["target"]["fingerprint"]
    if fingerprint(target_dir) != want:
        raise StoreError(
            f"{store.root} was captured from another target (fingerprint {want}); "
            f"--target {target_dir} has {fingerprint(target_dir)}"
        )
    if aux_layers and list(aux_layers) != store.schema["aux_layers"]:
        raise StoreError(f"{store.root} holds aux layers {store.schema['aux_layers']}, not {list(aux_layers)}")
    return store, examples, load_heads(target_dir, store.schema["aux_layers"], dtype, device)


def host_features(
    store: FeatureStore,
    examples: list[StoredExample],
    T: int,
    dtype,
    where: torch.Tensor | None = None,
    n_rows: int | None = None,
    pin: bool = False,
) -> dict[str, torch.Tensor]:
    """Right-padded (zeros) aux_hidden [B, T, n_aux * H] and final_hidden [B, T, H] of the examples on the host, as
    the target would give them for a collate()d batch (pad positions are never trained or attended to by valid ones).
    where [N, 2] (packed rows, data/packing.py): example i's features go to row where[i, 0] from column where[i, 1];
    each was captured alone, so nothing in them crosses a document. n_rows: the batch's rows, padding rows
    included. pin: in page-locked memory, for a non-blocking copy to the GPU. Runs on the trainer's prefetch thread
    (core/trainer.py), so reading and checking the store overlaps the previous step."""
    rows = [store.read(e.ref, ["aux_hidden", "final_hidden"]) for e in examples]
    place = [(i, 0) for i in range(len(rows))] if where is None else [tuple(w) for w in where.tolist()]
    R = n_rows or 1 + max(r for r, _ in place)
    # empty, then zeros only where no example lands: a fresh buffer is written once, not twice (at 8B width a
    # 4,096-token batch is 128 MiB)
    aux = torch.empty(R, T, rows[0]["aux_hidden"].shape[-1], dtype=dtype, pin_memory=pin)
    fin = torch.empty(R, T, rows[0]["final_hidden"].shape[-1], dtype=dtype, pin_memory=pin)
    filled = torch.zeros(R, T, dtype=torch.bool)
    for r, (b, s) in zip(rows, place):
        n = r["aux_hidden"].shape[0]
        aux[b, s : s + n], fin[b, s : s + n] = r["aux_hidden"], r["final_hidden"]
        filled[b, s : s + n] = True
    aux[~filled], fin[~filled] = 0, 0
    return {"aux_hidden": aux, "final_hidden": fin}
