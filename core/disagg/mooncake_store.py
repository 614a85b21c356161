"""The FeatureStore contract (put / get / read / delete) over Mooncake's distributed store
(`pip install mooncake-transfer-engine-non-cuda`, which needs libibverbs1 from the OS even for
TCP; the CUDA wheel `mooncake-transfer-engine` moves GPU memory over RDMA).

    --store mooncake://HOST:PORT    the master's RPC address (segments found by P2P handshake)
    --store mooncake://local        the launcher starts a master on loopback and holds the memory

One shard = one Mooncake object: the safetensors bytes of the shard with the same header as a
directory store's (so the same validation applies), under the shard's key. Producers and
consumers mount no memory of their own: objects live in the holder's segment (the launcher's,
or whatever members of a multi-node deployment mount), so a dead producer loses nothing it
published. Mooncake has no key listing: keys() is empty and orphans of producers that died
between put and publish stay until the master stops.
"""

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load, save

from data.feature_store import DTYPES, FeatureStore, SampleRef, StoreError, _canon, _diff

SCHEMA_KEY = "nanospec.store.json"
HOLDER_BYTES = 1 << 30  # the launcher's segment: features in flight live here (≥ high watermark x bytes/sample)


def _client(master: str, segment_bytes: int = 0):
    from mooncake.store import MooncakeDistributedStore  # optional: mooncake only for --store mooncake://

    host = master.split(":")[0]
    local = "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostbyname(socket.gethostname())
    c = MooncakeDistributedStore()
    rc = c.setup(local, "P2PHANDSHAKE", segment_bytes, 64 << 20, "tcp", "", master)
    if rc != 0:
        raise StoreError(f"mooncake: cannot join the store at {master} (setup returned {rc})")
    return c


class MooncakeFeatureStore:
    def __init__(self, spec: str, schema: dict | None = None, segment_bytes: int = 0):
        self.root = spec
        self.client = _client(spec.removeprefix("mooncake://"), segment_bytes)
        if schema is not None and not self.client.is_exist(SCHEMA_KEY):
            self.client.put(SCHEMA_KEY, json.dumps(schema, sort_keys=True).encode())
        raw = self.client.get(SCHEMA_KEY)
        if not raw:
            raise StoreError(f"{spec} holds no feature store yet (no {SCHEMA_KEY})")
        self.schema = json.loads(raw)
        if schema is not None and _canon(schema) != _canon(self.schema):
            raise StoreError(f"{spec} was created with a different schema ({_diff(self.schema, schema)})")
        self.fields = {n: (DTYPES[f["dtype"]], tuple(f["shape"])) for n, f in self.schema["fields"].items()}
        self._cache, self._lock = (
            (None, None),
            threading.Lock(),
        )  # the last shard read: a step reads several of its samples

    def put(self, key: str, tensors: dict, meta: dict | None = None, samples=None):
        header = {
            "schema": self.schema,
            "writer": f"{socket.gethostname()}-{os.getpid()}",
            "meta": meta or {},
            "samples": [[int(i), int(n)] for i, n in samples] if samples is not None else None,
        }
        FeatureStore._check(self, key, header, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
        blob = save(
            {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata={"nanospec": json.dumps(header)}
        )
        rc = self.client.put(key, blob)
        if rc != 0:
            raise StoreError(f"mooncake put {key} ({len(blob)} bytes) failed with {rc} (is the holder's segment full?)")

    def get(self, key: str) -> tuple[dict, dict]:
        with self._lock:
            if self._cache[0] == key:
                return self._cache[1]
        blob = self.client.get(key)
        if not blob:
            raise KeyError(f"no shard {key} in {self.root}")
        tensors = load(blob)
        n = int.from_bytes(blob[:8], "little")  # safetensors: u64 header length, then the JSON header
        header = json.loads(json.loads(blob[8 : 8 + n])["__metadata__"]["nanospec"])
        FeatureStore._check(self, key, header, {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()})
        with self._lock:
            self._cache = (key, (tensors, header))
        return tensors, header

    def read(self, ref: SampleRef, names=None) -> dict[str, torch.Tensor]:
        tensors, _ = self.get(ref.key)
        return {n: tensors[n][ref.offset : ref.offset + ref.length] for n in (names or self.fields)}

    def delete(self, key: str):
        with self._lock:
            if self._cache[0] == key:
                self._cache = (None, None)
        self.client.remove(key, True)  # force: a recent get holds a short read lease

    def keys(self) -> list[str]:
        return []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(root: Path):
    """A master on a free loopback port and a segment held by this (the launcher's) process.
    Returns (the master process, the store spec)."""
    import mooncake  # optional: mooncake only for --store mooncake://

    exe = shutil.which("mooncake_master") or str(Path(mooncake.__file__).parent / "mooncake_master")
    port, metrics = _free_port(), _free_port()
    log = open(Path(root) / "mooncake_master.log", "w")
    proc = subprocess.Popen(
        [exe, f"--rpc_port={port}", "--rpc_address=127.0.0.1", f"--metrics_port={metrics}", "--metrics_host=127.0.0.1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    spec = f"mooncake://127.0.0.1:{port}"
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                break
        except OSError:
            if proc.poll() is not None:
                raise StoreError(f"mooncake_master exited ({proc.returncode}); see {log.name}") from None
            time.sleep(0.1)
    global _HOLDER
    _HOLDER = _client(spec.removeprefix("mooncake://"), HOLDER_BYTES)  # kept alive with the launcher
    return proc, spec


_HOLDER = None
