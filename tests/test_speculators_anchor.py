"""experiments/speculators_anchor.py: our FeatureStore converted to speculators' offline layout holds the
same tokens, loss mask and hidden states (read back by their own ArrowDataset where the package is
installed; it is not a project dependency), and the windowed throughput arithmetic."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import speculators_anchor as anchor  # noqa: E402

from data.chat import Example  # noqa: E402
from data.feature_store import FeatureStore, feature_schema, tokens_digest  # noqa: E402

H, N_AUX = 8, 3


def tiny_store(root: Path) -> tuple[list[Example], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    lengths = [5, 9, 2, 7]
    examples = [
        Example(torch.randint(0, 100, (n,), generator=g).tolist(), torch.randint(0, 2, (n,), generator=g).tolist())
        for n in lengths
    ]
    data = {"data": "x", "num_records": 4, "records": 4, "max_len": 16, "num_examples": 4}
    data["tokens_sha"], data["stats"] = tokens_digest(examples), {}
    target = {"fingerprint": "f", "model_type": "llama", "num_layers": 8, "hidden_size": H, "vocab_size": 100}
    store = FeatureStore(root, feature_schema(target, [1, 3, 4], H, torch.float32, data))
    T = sum(lengths)
    tensors = {
        "input_ids": torch.tensor([t for e in examples for t in e.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for e in examples for m in e.loss_mask], dtype=torch.uint8),
        "aux_hidden": torch.randn(T, N_AUX * H, generator=g),
        "final_hidden": torch.randn(T, H, generator=g),
    }
    store.put("000000000-000000001", {k: v[:14] for k, v in tensors.items()}, samples=[(0, 5), (1, 9)])
    store.put("000000002-000000003", {k: v[14:] for k, v in tensors.items()}, samples=[(2, 2), (3, 7)])
    return examples, tensors


def test_convert_keeps_tokens_mask_and_hidden_states(tmp_path):
    examples, t = tiny_store(tmp_path / "store")
    info = anchor.convert(tmp_path / "store", tmp_path / "spec")
    assert info["samples"] == 4
    assert anchor.convert(tmp_path / "store", tmp_path / "spec") == info  # second call: reused
    off = 0
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        f = load_file(tmp_path / "spec" / "hidden_states" / f"hs_{i}.safetensors")
        assert f["token_ids"].dtype == torch.int64 and f["token_ids"].tolist() == e.input_ids
        assert f["hidden_states"].shape == (n, N_AUX + 1, H)
        assert torch.equal(f["hidden_states"][:, :-1].flatten(1), t["aux_hidden"][off : off + n])
        assert torch.equal(f["hidden_states"][:, -1], t["final_hidden"][off : off + n])
        off += n
    freq = torch.load(tmp_path / "spec" / "token_freq.pt")
    assert sum(freq.values()) == sum(sum(e.loss_mask) for e in examples)


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None, reason="speculators is not installed")
def test_their_dataset_reads_the_converted_dir(tmp_path):
    from speculators.train.data import ArrowDataset  # optional: speculators (skipped where missing)

    examples, t = tiny_store(tmp_path / "store")
    anchor.convert(tmp_path / "store", tmp_path / "spec")
    ds = ArrowDataset(16, tmp_path / "spec", on_missing="raise", train_ratio=1.0, hidden_states_dtype=torch.float32)
    assert ds.approx_lengths == [len(e.input_ids) for e in examples]
    off = 0
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        s = ds[i]
        assert s["input_ids"].tolist() == e.input_ids and s["loss_mask"].tolist() == e.loss_mask
        assert torch.equal(s["hidden_states"], t["aux_hidden"][off : off + n])
        assert torch.equal(s["verifier_last_hidden_states"], t["final_hidden"][off : off + n])
        off += n


def test_windows():
    steps = [(100.0, 1.0)] * 2 + [(300.0, 1.0), (100.0, 1.0)] * 3
    # windows of 2 steps: the first one (warm-up) left out, then (300 + 100) / 2 s each
    assert anchor.windows(steps, 2, 1) == [200.0, 200.0, 200.0]
    assert anchor.windows(steps[:3], 2, 0) == [100.0]  # an incomplete last window is dropped


def test_their_fused_loss_failure_reruns_eager(tmp_path, monkeypatch):
    """Their trainer failing with torch 2.11's dynamo assertion in their fused loss runs once more with
    --loss-implementation eager, the row saying so and the failed log kept; any other failure stops the anchor."""
    calls = []

    def fake_run(cmd, log, env=None):
        calls.append(cmd)
        if "--loss-implementation" not in cmd:
            log.write_text(f"AssertionError: ListVariable(length=21) {anchor.FUSED_LOSS_FAILURE}.\n")
            raise SystemExit("failed")
        Path(cmd[3]).write_text("".join('{"profile": {"tokens_per_s": 1000.0, "step_ms": 100.0}}\n' for _ in range(10)))
        log.write_text('SPECULATORS_PEAK {"max_allocated_bytes": 1073741824}\n')

    monkeypatch.setattr(anchor, "run", fake_run)
    a = anchor.Args(work=tmp_path, log_every=2, skip_windows=1)
    env = {"SPECULATORS_VERSION": "0.9.0"}
    row = anchor.their_row(a, tmp_path / "v", tmp_path / "d", env, [2, 16, 29])
    assert len(calls) == 2 and calls[1][-2:] == ["--loss-implementation", "eager"]
    assert row["loss_implementation"].startswith("eager") and row["real_tokens_per_s"] == 1000.0
    assert anchor.FUSED_LOSS_FAILURE in (tmp_path / "speculators_fused_failed.log").read_text()
    assert "--loss-implementation eager" in row["command"] and row["peak_gib"] == 1.0

    def other_failure(cmd, log, env=None):
        log.write_text("CUDA out of memory\n")
        raise SystemExit("failed")

    monkeypatch.setattr(anchor, "run", other_failure)
    with pytest.raises(SystemExit):
        anchor.their_row(a, tmp_path / "v", tmp_path / "d", env, [2, 16, 29])


def test_a_store_of_another_verifier_is_not_reused(tmp_path):
    """capture() reuses --work's store only for the same data settings and the same verifier (its fingerprint):
    a run for another preset in the same --work stops with what to delete, not training on the other's features."""
    tiny_store(tmp_path / "store")  # data "x", 4 records, max_len 16, target fingerprint "f"
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text('{"model_type": "llama"}')
    a = anchor.Args(data="x", num_records=4, max_len=16, work=tmp_path)
    with pytest.raises(SystemExit, match="holds other settings.*target f.*delete"):
        anchor.capture(a, verifier)
