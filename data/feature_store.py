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
- Bytes damaged in place (a bad disk, a stray write) keep the shape of a valid shard, so every
  shard also carries a checksum of each tensor's bytes (metadata key "nanospec_checksums":
  {algo, tensors: {name: hex}}, computed at put time). The algorithm is xxh3-128 (xxhash, which
  `datasets` requires; ~6 GB/s on one core, so it adds little to a put bound by a ~1.4 GB/s
  disk write; sha256 at ~1.3 GB/s would halve capture throughput), sha256 where xxhash is
  missing; it detects damage, it is no defence against deliberate tampering. A tensor is checked
  the first time this FeatureStore reads it from a given file (per file identity: device,
  inode, size, mtime), so a run pays one hashing pass over the bytes it reads, not one per
  sample; header-only calls (keys, refs, `in`, header) do not hash. A mismatch is a StoreError
  naming the file and tensor; the file is left as it is.
- Samples are packed along dim 0 (tokens): field[sum(lengths), *row_shape]. A SampleRef (id,
  key, offset, length) locates one sample and holds no tensors, so a producer/consumer control
  plane moves only refs; consumers read one sample's rows without loading the shard
  (safetensors slices are memory-mapped reads).

The feature layout written by `capture.py features` (fields input_ids, loss_mask, aux_hidden,
final_hidden) and its reader open_feature_store are at the bottom (core/features.py ties a store to a target for
train.py: open_for_training, host_features).
"""

import hashlib
import json
import os
import re
import socket
import struct
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from data.chat import DataError, Example

_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_ST_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class StoreError(DataError):
    """A store or shard that cannot be used as it is (names the file)."""


_CHECKSUMS = "nanospec_checksums"  # safetensors metadata key: JSON {algo, tensors: {name: hex digest}}
_CHUNK = 16 << 20
try:
    import xxhash

    _HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
    _ALGO = "xxh3_128"
except ImportError:  # pragma: no cover (datasets requires xxhash)
    _HASHES = {"sha256": hashlib.sha256}
    _ALGO = "sha256"


def _tensor_digest(t: torch.Tensor, algo: str) -> str:
    """Digest of a contiguous CPU tensor's bytes, as safetensors writes them (little-endian)."""
    return _HASHES[algo](t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _file_id(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


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
            raise StoreError(
                f"{path} was created with a different schema ({_diff(self.schema, schema)}); "
                "use another directory or the same settings"
            )
        self.fields = {n: (DTYPES[f["dtype"]], tuple(f["shape"])) for n, f in self.schema["fields"].items()}
        self._verified: set[tuple] = set()  # (file identity, tensor name) whose checksum matched
        self._unchecked: set[tuple] = set()  # file identities of shards without checksums

    def path(self, key: str) -> Path:
        if not _KEY.match(key):
            raise ValueError(f"bad store key {key!r} (letters, digits, '_', '.', '-'; not starting with '.')")
        return self.dir / f"{key}.safetensors"

    # ---- the contract: put / get / delete / keys ----
    def put(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        meta: dict | None = None,
        samples: list[tuple[int, int]] | None = None,
    ) -> Path:
        """Write a shard atomically (replacing one with the same key). samples: [(id, length)]
        whose lengths partition dim 0 of every field."""
        final = self.path(key)
        header = {
            "schema": self.schema,
            "writer": self.writer,
            "meta": meta or {},
            "samples": [[int(i), int(n)] for i, n in samples] if samples is not None else None,
        }
        self._check(final, header, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
        tmp = self.dir / f".{key}.{self.writer}.tmp"
        host = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        sums = {"algo": _ALGO, "tensors": {k: _tensor_digest(v, _ALGO) for k, v in host.items()}}
        try:
            save_file(host, tmp, metadata={"nanospec": json.dumps(header), _CHECKSUMS: json.dumps(sums)})
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
            self._verify(path, list(f.keys()))
            return {k: f.get_tensor(k) for k in f.keys()}, header

    def verify(self, key: str) -> bool:
        """Check every tensor of a shard against its checksum (StoreError if one differs).
        False for a shard written before checksums existed (nothing to check it against)."""
        path = self.path(key)
        with self._open(path) as (f, _):
            return self._verify(path, list(f.keys()))

    def delete(self, key: str):
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> list[str]:
        """Committed shards, sorted. (Temp files of writers in flight are hidden names.)"""
        if not self.dir.exists():
            return []
        return sorted(
            p.name[: -len(".safetensors")]
            for p in self.dir.iterdir()
            if p.name.endswith(".safetensors") and not p.name.startswith(".")
        )

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
        path = self.path(ref.key)
        names = list(names or self.fields)
        with self._open(path) as (f, _):
            self._verify(path, names)
            return {n: f.get_slice(n)[ref.offset : ref.offset + ref.length] for n in names}

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
                bad(
                    f"tensor '{name}' has shape {list(got_shape)}, expected [{rows if rows is not None else 'N'}, "
                    f"{', '.join(map(str, shape))}]"
                )

    def _verify(self, path: Path, names: list[str]) -> bool:
        """Hash the bytes of tensors `names` of a shard file (each at most once per file identity)
        and compare them with the checksums written at put time. A shard without checksums
        (written before they existed) is still readable, unchecked: returns False."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise KeyError(f"no shard {path}") from None
        if _file_id(st) in self._unchecked:
            return False
        todo = [n for n in names if (_file_id(st), n) not in self._verified]
        if not todo:
            return True
        try:
            with open(path, "rb") as fh:
                fid = _file_id(os.fstat(fh.fileno()))
                (n,) = struct.unpack("<Q", fh.read(8))
                meta = json.loads(fh.read(n))
                sums = (meta.get("__metadata__") or {}).get(_CHECKSUMS)
                if sums is None:  # written before shards had checksums: still readable, unchecked
                    self._unchecked.add(fid)
                    return False
                sums = json.loads(sums)
                algo, digests = sums["algo"], sums["tensors"]
                if algo not in _HASHES:
                    raise StoreError(
                        f"shard {path}: checksums of kind {algo!r} cannot be checked here "
                        f"(have {sorted(_HASHES)}; install xxhash)"
                    )
                for name in todo:
                    if name not in digests or name not in meta:
                        raise StoreError(
                            f"shard {path}: tensor '{name}' has no checksum (the shard's metadata was altered)"
                        )
                    begin, end = meta[name]["data_offsets"]
                    fh.seek(8 + n + begin)
                    h, left = _HASHES[algo](), end - begin
                    while left > 0:
                        chunk = fh.read(min(_CHUNK, left))
                        if not chunk:
                            break
                        h.update(chunk)
                        left -= len(chunk)
                    if left > 0 or h.hexdigest() != digests[name]:
                        raise StoreError(
                            f"shard {path}: the bytes of tensor '{name}' do not match the checksum written with them "
                            f"({algo} {h.hexdigest()[:16]}..., expected {digests[name][:16]}...): the file was damaged "
                            "after it was written. It is left as it is; delete it and rerun `capture.py features` with "
                            "the same arguments to rewrite it"
                        )
                    self._verified.add((fid, name))
        except StoreError:
            raise
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise StoreError(f"shard {path} is damaged or not a feature shard ({type(e).__name__}: {e})") from None
        return True

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
        raise StoreError(
            f"{store.root} holds {len(refs)} of {want} samples: rerun `capture.py features` "
            "with the same arguments to finish it"
        )
    examples = []
    for i in range(want):
        t = store.read(refs[i], ["input_ids", "loss_mask"])
        examples.append(StoredExample(t["input_ids"].tolist(), t["loss_mask"].tolist(), refs[i]))
    return store, examples
