"""FeatureStore: named tensors by key, as safetensors shards in a directory (local or shared).

    root/store.json                 the schema every shard must match (target fingerprint, aux
                                    layers, dtype, fields [name -> dtype, row shape], data settings)
    root/shards/<key>.safetensors   one shard: tensors + its own metadata in the safetensors header
                                    (samples [[id, length], ...], a copy of the schema, writer, meta)

Why this shape:
- A shard is committed by one rename: written under a hidden temp name in the same directory,
  fsynced, renamed to <key>.safetensors, the directory fsynced. A crash leaves the old state or
  a complete shard, never a half-written file under a shard name. Temp names start with '.'
  and never count as shards.
- Every shard carries its own metadata, so there is no shared manifest to clobber: any number
  of writers (ranks, nodes on NFS) can put different keys at once. store.json is created once,
  atomically (link() fails if it exists); later writers check that their schema equals it.
- Reads validate: safetensors refuses a truncated file (its header must cover the file), and
  the shard's schema copy, tensor names, dtypes, row shapes and row counts are checked against
  store.json. Any mismatch is a StoreError naming the shard file.
- Samples are packed along dim 0 (tokens): field[sum(lengths), *row_shape]. A SampleRef (id,
  key, offset, length) locates one sample and holds no tensors, so a producer/consumer control
  plane moves only refs; consumers read one sample's rows without loading the shard
  (safetensors slices are memory-mapped reads).

The feature layout written by `capture.py features` (fields input_ids, loss_mask, aux_hidden,
final_hidden) and its readers for train.py (load_examples, batch_features) are at the bottom.
"""
import hashlib
import json
import os
import re
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from data.chat import DataError, Example

_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
_ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
              "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}


class StoreError(DataError):
    """A store or shard that cannot be used as it is (names the file)."""


@dataclass(frozen=True)
class SampleRef:
    """Where one sample lives: rows [offset, offset + length) of every field of shard `key`."""

    id: int
    key: str
    offset: int
    length: int


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _canon(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _diff(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if _canon(a.get(k)) != _canon(b.get(k)))
    return "; ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in keys)


class FeatureStore:
    def __init__(self, root, schema: dict | None = None, writer: str | None = None):
        """Open an existing store (schema=None) or create/join one with `schema` (a JSON-able
        dict with at least `fields: {name: {"dtype": "bfloat16", "shape": [3 * H]}}`)."""
        self.root, self.dir = Path(root), Path(root) / "shards"
        self.writer = writer or f"{socket.gethostname()}-{os.getpid()}"
        path = self.root / "store.json"
        if schema is None:
            if not path.exists():
                raise StoreError(f"{self.root} is not a feature store (no store.json)")
        else:
            if "fields" not in schema:
                raise ValueError("schema needs 'fields'")
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".store.json.{self.writer}.tmp"
            tmp.write_text(json.dumps(schema, indent=1, sort_keys=True))
            try:
                os.link(tmp, path)  # atomic create-if-absent, also on NFS
                _fsync_dir(self.root)
            except FileExistsError:
                pass
            finally:
                tmp.unlink(missing_ok=True)
        try:
            self.schema = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise StoreError(f"{path} is not valid JSON: {e}") from e
        if schema is not None and _canon(schema) != _canon(self.schema):
            raise StoreError(f"{path} was created with a different schema ({_diff(self.schema, schema)}); "
                             "use another directory or the same settings")
        self.fields = {n: (DTYPES[f["dtype"]], tuple(f["shape"])) for n, f in self.schema["fields"].items()}

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"bad store key {key!r} (letters, digits, '_', '.', '-'; not starting with '.')")
        return self.dir / f"{key}.safetensors"

    # ---- the contract: put / get / delete / keys ----
    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict | None = None,
            samples: list[tuple[int, int]] | None = None) -> Path:
        """Write a shard atomically (replacing one with the same key). samples: [(id, length)]
        whose lengths partition dim 0 of every field."""
        final = self.path(key)
        header = {"schema": self.schema, "writer": self.writer, "meta": meta or {},
                  "samples": [[int(i), int(n)] for i, n in samples] if samples is not None else None}
        self._check(final, header, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
        tmp = self.dir / f".{key}.{self.writer}.tmp"
        try:
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
                      metadata={"nanospec": json.dumps(header)})
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _fsync_dir(self.dir)
        return final

    def get(self, key: str) -> tuple[dict[str, torch.Tensor], dict]:
        """All tensors of a shard and its header {meta, samples, writer, schema}."""
        path = self.path(key)
        with self._open(path) as (f, header):
            return {k: f.get_tensor(k) for k in f.keys()}, header

    def delete(self, key: str):
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Committed shards, sorted. (Temp files of writers in flight are hidden names.)"""
        if not self.dir.exists():
            return []
        return sorted(p.name[: -len(".safetensors")] for p in self.dir.iterdir()
                      if p.name.endswith(".safetensors") and not p.name.startswith("."))

    def __contains__(self, key: str) -> bool:
        """True iff a valid shard exists under key (a damaged one raises)."""
        if not self.path(key).exists():
            return False
        self.header(key)
        return True

    def header(self, key: str) -> dict:
        with self._open(self.path(key)) as (_, header):
            return header

    def clean_temps(self) -> int:
        """Remove this writer's leftover temp files (from a crash); other writers' are kept."""
        n = 0
        for p in self.dir.glob(f".*.{self.writer}.tmp"):
            p.unlink(missing_ok=True)
            n += 1
        return n

    # ---- samples ----
    def refs(self) -> dict[int, SampleRef]:
        """sample id -> SampleRef over all shards (reads every header, not the tensors)."""
        out = {}
        for key in self.keys():
            offset = 0
            for i, n in self.header(key)["samples"] or []:
                if i in out:
                    raise StoreError(f"sample {i} is in both {self.path(out[i].key)} and {self.path(key)}")
                out[i] = SampleRef(i, key, offset, n)
                offset += n
        return out

    def read(self, ref: SampleRef, names=None) -> dict[str, torch.Tensor]:
        """One sample's rows of the given fields (default: all)."""
        with self._open(self.path(ref.key)) as (f, _):
            return {n: f.get_slice(n)[ref.offset : ref.offset + ref.length] for n in (names or self.fields)}

    # ---- validation ----
    def _check(self, path: Path, header: dict, shapes: dict[str, tuple]):
        def bad(msg):
            raise StoreError(f"shard {path}: {msg}")

        if _canon(header.get("schema")) != _canon(self.schema):
            bad(f"written for a different store schema ({_diff(header.get('schema') or {}, self.schema)})")
        rows = sum(n for _, n in header["samples"]) if header.get("samples") is not None else None
        for name, (dtype, shape) in self.fields.items():
            if name not in shapes:
                bad(f"missing tensor '{name}' (has {sorted(shapes)})")
            got_dtype, got_shape = shapes[name]
            if got_dtype != dtype:
                bad(f"tensor '{name}' is {got_dtype}, the store holds {dtype}")
            if tuple(got_shape[1:]) != shape or (rows is not None and got_shape[0] != rows):
                bad(f"tensor '{name}' has shape {list(got_shape)}, expected [{rows if rows is not None else 'N'}, "
                    f"{', '.join(map(str, shape))}]")

    @contextmanager
    def _open(self, path: Path):
        """safe_open + validation: yields (handle, header)."""
        try:
            with safe_open(str(path), "pt") as f:
                header = json.loads((f.metadata() or {})["nanospec"])
                shapes = {}
                for k in f.keys():
                    s = f.get_slice(k)
                    shapes[k] = (_ST_DTYPES.get(s.get_dtype()), tuple(s.get_shape()))
                self._check(path, header, shapes)
                yield f, header
        except FileNotFoundError:
            raise KeyError(f"no shard {path}") from None
        except (SafetensorError, KeyError, json.JSONDecodeError, OSError) as e:
            raise StoreError(f"shard {path} is damaged or not a feature shard ({type(e).__name__}: {e})") from None


# ---- the feature layout of capture.py and its readers for train.py ----
FEATURE_FIELDS = ("input_ids", "loss_mask", "aux_hidden", "final_hidden")


def feature_schema(target: dict, aux_layers: list[int], hidden: int, dtype: torch.dtype, data: dict) -> dict:
    """Store schema for captured target features. target: {path, fingerprint, ...}; data: the
    tokenization settings and a hash of the tokens, so a resumed or offline run provably sees
    the same samples."""
    dt = str(dtype).removeprefix("torch.")
    return {
        "kind": "target_features",
        "target": target,
        "aux_layers": list(aux_layers),
        "dtype": dt,
        "data": data,
        "fields": {
            "input_ids": {"dtype": "int32", "shape": []},
            "loss_mask": {"dtype": "uint8", "shape": []},
            "aux_hidden": {"dtype": dt, "shape": [len(aux_layers) * hidden]},
            "final_hidden": {"dtype": dt, "shape": [hidden]},
        },
    }


def tokens_digest(examples) -> str:
    """sha256 over every example's ids and loss mask: equal iff tokenization is equal."""
    h = hashlib.sha256()
    for e in examples:
        h.update(torch.tensor(e.input_ids, dtype=torch.int32).numpy().tobytes())
        h.update(torch.tensor(e.loss_mask, dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[str, int, int]]:
    """Consecutive samples packed into shards of about shard_tokens tokens: [(key, first, count)].
    Depends only on the lengths, so every rank and every rerun agrees on it."""
    plan, first, tok = [], 0, 0
    for i, n in enumerate(lengths):
        tok += n
        if tok >= shard_tokens or i == len(lengths) - 1:
            plan.append((f"{first:09d}-{i:09d}", first, i - first + 1))
            first, tok = i + 1, 0
    return plan


@dataclass
class StoredExample(Example):
    """An Example whose target features are in a FeatureStore."""

    ref: SampleRef | None = None


def open_feature_store(root) -> tuple[FeatureStore, list[StoredExample]]:
    """Open a store written by `capture.py features` and list its examples in id order (reads
    only input_ids and loss_mask). A store with missing samples is an error, not a subset."""
    store = FeatureStore(root)
    if store.schema.get("kind") != "target_features":
        raise StoreError(f"{store.root} does not hold target features (kind {store.schema.get('kind')!r})")
    refs = store.refs()
    want = store.schema["data"]["num_examples"]
    if sorted(refs) != list(range(want)):
        raise StoreError(f"{store.root} holds {len(refs)} of {want} samples: rerun `capture.py features` "
                         "with the same arguments to finish it")
    examples = []
    for i in range(want):
        t = store.read(refs[i], ["input_ids", "loss_mask"])
        examples.append(StoredExample(t["input_ids"].tolist(), t["loss_mask"].tolist(), refs[i]))
    return store, examples


def open_for_training(root, target_dir, aux_layers, dtype, device):
    """(store, examples, TargetHeads) for train.py --features: checks that the store was captured
    from this target (weights fingerprint) with these aux layers, and loads only the target's
    embeddings and lm_head."""
    from models.target import fingerprint, load_heads

    store, examples = open_feature_store(root)
    want = store.schema["target"]["fingerprint"]
    if fingerprint(target_dir) != want:
        raise StoreError(f"{store.root} was captured from another target (fingerprint {want}); "
                         f"--target {target_dir} has {fingerprint(target_dir)}")
    if aux_layers and list(aux_layers) != store.schema["aux_layers"]:
        raise StoreError(f"{store.root} holds aux layers {store.schema['aux_layers']}, not {list(aux_layers)}")
    return store, examples, load_heads(target_dir, store.schema["aux_layers"], dtype, device)


def batch_features(store: FeatureStore, examples: list[StoredExample], T: int, device, dtype):
    """Right-padded (zeros) Features [B, T, ...] of the examples, as the target would give them
    for a collate()d batch (pad positions are never trained or attended to by valid ones)."""
    from models.target import Features

    rows = [store.read(e.ref, ["aux_hidden", "final_hidden"]) for e in examples]
    aux = torch.zeros(len(rows), T, rows[0]["aux_hidden"].shape[-1], dtype=dtype)
    fin = torch.zeros(len(rows), T, rows[0]["final_hidden"].shape[-1], dtype=dtype)
    for b, r in enumerate(rows):
        n = r["aux_hidden"].shape[0]
        aux[b, :n], fin[b, :n] = r["aux_hidden"], r["final_hidden"]
    return Features(aux_hidden=aux.to(device, non_blocking=True), final_hidden=fin.to(device, non_blocking=True))
