"""FeatureStore: round trip, atomic commits (a crash leaves no shard), damaged or mismatched
shards fail naming the file, delete, concurrent writers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import data.feature_store as fs
from data.feature_store import FEATURE_FIELDS, FeatureStore, StoreError, feature_schema, plan_shards

ROOT = Path(__file__).resolve().parents[1]


def schema(aux_layers=(1, 2, 3), hidden=8, dtype=torch.float32):
    return feature_schema(
        {"fingerprint": "abc", "model_type": "llama", "num_layers": 5, "hidden_size": hidden, "vocab_size": 100},
        list(aux_layers),
        hidden,
        dtype,
        {"num_examples": 3},
    )


def samples(lengths, hidden=8, n_aux=3, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
            "loss_mask": (torch.rand(n, generator=g) < 0.5).to(torch.uint8),
            "aux_hidden": torch.randn(n, n_aux * hidden, generator=g).to(dtype),
            "final_hidden": torch.randn(n, hidden, generator=g).to(dtype),
        }
        for n in lengths
    ]


def pack(ss):
    return {k: torch.cat([s[k] for s in ss]) for k in ss[0]}


def test_round_trip_several_samples_per_shard(tmp_path):
    store = FeatureStore(tmp_path, schema())
    a, b = samples([5, 3]), samples([7], seed=1)
    store.put("s0", pack(a), meta={"note": "x"}, samples=[(0, 5), (1, 3)])
    store.put("s1", pack(b), samples=[(2, 7)])
    assert store.keys() == ["s0", "s1"] and "s0" in store and "nope" not in store
    tensors, header = store.get("s0")
    for k, v in pack(a).items():
        assert torch.equal(tensors[k], v), k
    assert header["meta"] == {"note": "x"} and header["samples"] == [[0, 5], [1, 3]]
    # a second handle (another process, another node) sees the same store
    again = FeatureStore(tmp_path)
    refs = again.refs()
    assert sorted(refs) == [0, 1, 2] and (refs[1].key, refs[1].offset, refs[1].length) == ("s0", 5, 3)
    for i, s in enumerate(a + b):
        got = again.read(refs[i])
        for k in s:
            assert torch.equal(got[k], s[k]), (i, k)
    # bf16 stores keep bf16
    bf = FeatureStore(tmp_path / "bf", schema(dtype=torch.bfloat16))
    s = samples([4], dtype=torch.bfloat16)[0]
    bf.put("k", s, samples=[(0, 4)])
    assert torch.equal(bf.read(bf.refs()[0])["aux_hidden"], s["aux_hidden"])


def test_delete(tmp_path):
    store = FeatureStore(tmp_path, schema())
    for i in range(3):
        store.put(f"k{i}", samples([2], seed=i)[0], samples=[(i, 2)])
    store.delete("k1")
    assert store.keys() == ["k0", "k2"] and "k1" not in store and sorted(store.refs()) == [0, 2]
    with pytest.raises(KeyError):
        store.get("k1")
    store.delete("k1")  # deleting twice is fine (consumers may race)


def test_crash_mid_write_leaves_no_shard(tmp_path):
    """A writer killed between writing its temp file and the rename (os._exit: no cleanup runs)
    leaves only a hidden temp file: no key, nothing readable; its next start removes the temp."""
    FeatureStore(tmp_path, schema())
    child = f"""
import os, sys, torch
sys.path.insert(0, {str(ROOT)!r})
from data.feature_store import FeatureStore
from tests.test_feature_store import schema, samples
store = FeatureStore({str(tmp_path)!r}, schema(), writer="w0")
store.put("good", samples([4])[0], samples=[(0, 4)])
os.replace = lambda *a: os._exit(3)  # die after the temp is written and fsynced
store.put("crashed", samples([6])[0], samples=[(1, 6)])
"""
    p = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True)
    assert p.returncode == 3, p.stderr
    store = FeatureStore(tmp_path, writer="w0")
    leftovers = [f.name for f in (tmp_path / "shards").iterdir()]
    assert any(n.startswith(".crashed.") for n in leftovers)  # the half-done write exists...
    assert store.keys() == ["good"] and "crashed" not in store and sorted(store.refs()) == [0]  # ...but is no shard
    assert store.clean_temps() == 1
    assert sorted(f.name for f in (tmp_path / "shards").iterdir()) == ["good.safetensors"]


def test_failed_write_in_process_cleans_up(tmp_path, monkeypatch):
    store = FeatureStore(tmp_path, schema())

    def half_write(tensors, path, metadata=None):
        Path(path).write_bytes(b"\x00" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(fs, "save_file", half_write)
    with pytest.raises(OSError, match="disk full"):
        store.put("k", samples([3])[0], samples=[(0, 3)])
    assert store.keys() == [] and list((tmp_path / "shards").iterdir()) == []


def _shard(store, key):
    return store.dir / f"{key}.safetensors"


def test_truncated_or_garbage_shard_is_named(tmp_path):
    store = FeatureStore(tmp_path, schema())
    store.put("k", samples([9])[0], samples=[(0, 9)])
    path = _shard(store, "k")
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 17])
    for op in (lambda: store.get("k"), lambda: "k" in store, store.refs):
        with pytest.raises(StoreError, match=str(path)):
            op()
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(StoreError, match=f"shard {path} is damaged"):
        store.get("k")


def test_mismatched_shard_is_named(tmp_path):
    """A shard from another target/layers/dtype, or with a missing or reshaped tensor, is refused."""
    store = FeatureStore(tmp_path / "a", schema(aux_layers=(1, 2, 3)))
    other = FeatureStore(tmp_path / "b", schema(aux_layers=(0, 2, 3)))
    other.put("k", samples([4])[0], samples=[(0, 4)])
    (store.dir / "k.safetensors").write_bytes(_shard(other, "k").read_bytes())  # a copy in the wrong store
    with pytest.raises(
        StoreError, match=r"shard .*a/shards/k.safetensors: written for a different store schema \(aux_layers"
    ):
        store.get("k")

    s = samples([4])[0]
    header = {"schema": store.schema, "writer": "x", "meta": {}, "samples": [[0, 4]]}
    save_file(
        {k: v for k, v in s.items() if k != "final_hidden"},
        store.dir / "m.safetensors",
        metadata={"nanospec": json.dumps(header)},
    )
    with pytest.raises(StoreError, match=r"m.safetensors: missing tensor 'final_hidden'"):
        store.get("m")
    header["samples"] = [[0, 5]]  # rows do not add up
    save_file(s, store.dir / "r.safetensors", metadata={"nanospec": json.dumps(header)})
    with pytest.raises(StoreError, match=r"r.safetensors: tensor 'aux_hidden' has shape \[4, 24\], expected \[5, 24\]"):
        store.get("r")
    # writers are checked before anything is written
    with pytest.raises(StoreError, match="is torch.bfloat16, the store holds torch.float32"):
        store.put("w", samples([4], dtype=torch.bfloat16)[0], samples=[(0, 4)])
    assert not _shard(store, "w").exists()
    # joining a store with another schema fails; opening a non-store fails
    with pytest.raises(StoreError, match="different schema"):
        FeatureStore(tmp_path / "a", schema(dtype=torch.bfloat16))
    with pytest.raises(StoreError, match="not a feature store"):
        FeatureStore(tmp_path / "nothing")


def test_concurrent_writers_share_a_store(tmp_path):
    """Two processes create/join one store at once and write interleaved keys: no clobbering."""
    child = f"""
import sys, torch
sys.path.insert(0, {str(ROOT)!r})
from data.feature_store import FeatureStore
from tests.test_feature_store import schema, samples
w = int(sys.argv[1])
store = FeatureStore({str(tmp_path)!r}, schema(), writer=f"w{{w}}")
for i in range(w, 12, 2):
    store.put(f"k{{i:02d}}", samples([3], seed=i)[0], samples=[(i, 3)])
"""
    procs = [subprocess.Popen([sys.executable, "-c", child, str(w)], stderr=subprocess.PIPE, text=True) for w in (0, 1)]
    for p in procs:
        assert p.wait() == 0, p.stderr.read()
    store = FeatureStore(tmp_path)
    assert store.keys() == [f"k{i:02d}" for i in range(12)]
    refs = store.refs()
    for i in range(12):
        assert torch.equal(store.read(refs[i])["aux_hidden"], samples([3], seed=i)[0]["aux_hidden"])
    assert {store.header(k)["writer"] for k in store.keys()} == {"w0", "w1"}


def test_plan_shards_packs_consecutive_samples(tmp_path):
    plan = plan_shards([5, 5, 5, 1, 20, 3], shard_tokens=10)
    assert plan == [("000000000-000000001", 0, 2), ("000000002-000000004", 2, 3), ("000000005-000000005", 5, 1)]
    assert sum(c for _, _, c in plan) == 6
    with pytest.raises(ValueError, match="bad store key"):
        FeatureStore(tmp_path, schema()).put("../escape", samples([1])[0])


def _meta(path):
    """The safetensors metadata of a file, JSON values decoded."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return {k: json.loads(v) for k, v in json.loads(raw[8 : 8 + n]).get("__metadata__", {}).items()}


def _data_range(path, name):
    """(first, end) byte offsets of tensor `name`'s data in a safetensors file."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, 8 + n + end


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_bytes_damaged_in_place_fail_the_checksum(tmp_path, monkeypatch, algo):
    """Overwriting data bytes keeps a well-formed shard (same header, shapes, size): only the
    per-tensor checksum written at put time catches it. The error names the file and tensor, the
    file is left as it is, and the undamaged tensors of the shard still read."""
    monkeypatch.setattr(fs, "_ALGO", algo)  # sha256: the fallback without xxhash
    store = FeatureStore(tmp_path, schema(hidden=256))
    s = samples([30], hidden=256)[0]
    store.put("k", s, samples=[(0, 30)])
    path = _shard(store, "k")
    assert _meta(path)["nanospec_checksums"]["algo"] == algo
    first, end = _data_range(path, "aux_hidden")
    assert end - first > 60_000
    raw = bytearray(path.read_bytes())
    raw[first + 1000 : first + 1000 + 40_000] = os.urandom(40_000)  # 40 KB of one tensor's bytes
    path.write_bytes(bytes(raw))
    store = FeatureStore(tmp_path)
    ref = store.refs()[0]  # header-only calls do not hash
    assert "k" in store
    ids = store.read(ref, ["input_ids", "loss_mask"])  # undamaged tensors read
    assert torch.equal(ids["input_ids"], s["input_ids"])
    for op in (
        lambda: store.read(ref),
        lambda: store.read(ref, ["aux_hidden"]),
        lambda: store.get("k"),
        lambda: store.verify("k"),
    ):
        with pytest.raises(
            StoreError, match=rf"shard {path}: the bytes of tensor 'aux_hidden' do not match the checksum"
        ):
            op()
    assert path.read_bytes() == bytes(raw)  # nothing deleted or rewritten
    # a rewritten shard (another file under the same key) is checked afresh, and reads again
    store.put("k", s, samples=[(0, 30)])
    assert store.verify("k") and torch.equal(store.read(ref)["aux_hidden"], s["aux_hidden"])


def test_checksum_is_checked_once_per_file(tmp_path, monkeypatch):
    store = FeatureStore(tmp_path, schema())
    store.put("k", samples([9])[0], samples=[(0, 4), (1, 5)])
    calls = []
    real = fs._HASHES[fs._ALGO]
    monkeypatch.setitem(fs._HASHES, fs._ALGO, lambda *a: calls.append(1) or real(*a))
    refs = store.refs()
    for _ in range(3):
        for r in refs.values():
            store.read(r)
    assert len(calls) == len(FEATURE_FIELDS)  # one hash per tensor, not per sample read


def test_shards_without_checksums_still_read(tmp_path):
    """Shards written before checksums existed have no 'nanospec_checksums' metadata: readable, unchecked."""
    store = FeatureStore(tmp_path, schema())
    s = samples([4])[0]
    header = {"schema": store.schema, "writer": "old", "meta": {}, "samples": [[0, 4]]}
    save_file(s, _shard(store, "old"), metadata={"nanospec": json.dumps(header)})
    assert store.verify("old") is False
    got = store.read(store.refs()[0])
    assert all(torch.equal(got[k], s[k]) for k in s)


def test_host_features_places_examples_and_zeros_the_rest(tmp_path, monkeypatch):
    """train.py --features' batch: each example's rows where `where` puts it, zeros everywhere else (a gap before an
    example, the tail of a row, a padding row), even where the buffer starts as NaN garbage: a NaN at a padded
    position would reach valid ones through masked attention (0 * NaN)."""
    from core.features import host_features  # core imports data/; this file tests data/ alone otherwise

    store = FeatureStore(tmp_path, schema())
    ss = samples([4, 3, 5], seed=2)
    store.put("s0", pack(ss), samples=[(0, 4), (1, 3), (2, 5)])
    refs = store.refs()
    examples = [fs.StoredExample(s["input_ids"].tolist(), s["loss_mask"].tolist(), refs[i]) for i, s in enumerate(ss)]
    where = torch.tensor([[0, 0], [0, 4], [1, 2]])  # row 1 starts with a gap; row 2 is padding only
    want_aux, want_fin = torch.zeros(3, 10, 24), torch.zeros(3, 10, 8)
    for s, (b, c) in zip(ss, where.tolist()):
        n = len(s["input_ids"])
        want_aux[b, c : c + n], want_fin[b, c : c + n] = s["aux_hidden"], s["final_hidden"]
    real_full = torch.full
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: real_full(shape, float("nan"), **kw))
    got = host_features(store, examples, 10, torch.float32, where=where, n_rows=3)
    assert torch.equal(got["aux_hidden"], want_aux) and torch.equal(got["final_hidden"], want_fin)
    one = host_features(store, examples[:1], 6, torch.float32)  # unpacked: one example a row, right-padded
    assert torch.equal(one["aux_hidden"], torch.cat([ss[0]["aux_hidden"], torch.zeros(2, 24)])[None])
