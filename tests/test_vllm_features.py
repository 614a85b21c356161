"""--backend vllm: features from a vLLM engine (features.VllmTarget, core/vllm_features.py).

Cheap tests of our side run without vLLM: a fake worker writes the files vLLM's hidden-states
connector writes ({hidden_states [n, len(ids), H], token_ids}, vLLM id k = the input of layer k,
id L = the last layer's output before the final norm), computed here from the HF model's layer
outputs; VllmTarget must turn them into Target's features, padded and packed, and capture's
shards must equal the HF target's. The slow test starts vLLM's CPU build once (its venv is
created when missing, several minutes) and checks the whole `capture.py features` store against
the HF target's on SmolLM2-135M."""

import json

import pytest
import torch
from safetensors.torch import save_file

from capture import FeaturesConfig, features
from core.features import VllmTarget, _runs, capture_examples, open_for_training, read_hidden
from data.feature_store import open_feature_store
from data.packing import pack
from models.target import Target, load_heads
from tests.tiny import random_examples, tiny_llama


class FakeWorker:
    """core/vllm_features.FeatureWorker's interface over an HF model: the connector's files."""

    def __init__(self, model, layer_ids, root):
        self.model, self.ids, self.root, self.n = model, layer_ids, root, 0
        self.closed = False

    @torch.no_grad()
    def hidden_files(self, prompts):
        outs = {}
        hooks = [
            layer.register_forward_hook(lambda m, i, o, k=k: outs.__setitem__(k, o[0] if isinstance(o, tuple) else o))
            for k, layer in enumerate(self.model.model.layers)
        ]
        files = []
        for p in prompts:
            self.model.model(input_ids=torch.tensor([p]))
            hidden = torch.stack([outs[k - 1][0] for k in self.ids], dim=1)  # id k = output of layer k-1
            f = self.root / f"req{self.n}.safetensors"
            save_file({"hidden_states": hidden.contiguous(), "token_ids": torch.tensor(p)}, f)
            (self.root / f"req{self.n}.safetensors.lock").touch()  # released: vLLM's writer has finished
            files.append(f)
            self.n += 1
        for h in hooks:
            h.remove()
        return files

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama with a non-trivial final norm (so applying it, or not, shows), saved as a target dir."""
    root = tmp_path_factory.mktemp("vllm_tiny")
    model = tiny_llama(vocab=96, hidden=32, layers=5)
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    model.save_pretrained(root / "target")
    target = Target.load(root / "target", [0, 2, 3])
    heads = load_heads(root / "target", target.aux_layers, norm=True)
    vt = VllmTarget(heads, FakeWorker(target.model, [1, 3, 4, 5], root))  # export.engine_aux_ids + [L]
    return target, vt


def assert_same(f, g, rows):
    for b, s, n in rows:
        torch.testing.assert_close(f.aux_hidden[b, s : s + n], g.aux_hidden[b, s : s + n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f.final_hidden[b, s : s + n], g.final_hidden[b, s : s + n], rtol=1e-5, atol=1e-5)


def test_padded_rows_equal_the_targets(tiny):
    target, vt = tiny
    ex = random_examples(3, 96, min_len=4, max_len=20, seed=1)
    T = max(len(e.input_ids) for e in ex)
    ids, mask = torch.zeros(3, T, dtype=torch.long), torch.zeros(3, T, dtype=torch.long)
    for b, e in enumerate(ex):
        ids[b, : len(e.input_ids)], mask[b, : len(e.input_ids)] = torch.tensor(e.input_ids), 1
    f = vt(ids, mask)
    assert_same(f, target(ids, mask), [(b, 0, len(e.input_ids)) for b, e in enumerate(ex)])
    assert f.aux_hidden[mask == 0].abs().sum() == 0 and f.final_hidden[mask == 0].abs().sum() == 0
    assert not list(vt.worker.root.glob("req*"))  # read_hidden deleted the files and their locks


def test_packed_rows_equal_each_document_alone(tiny):
    target, vt = tiny
    ex = random_examples(5, 96, min_len=4, max_len=20, seed=2)
    b = pack(ex, 40)
    f = vt(b["input_ids"], doc_ids=b["doc_ids"], position_ids=b["position_ids"])
    for e, (r, s) in zip(ex, b["where"].tolist()):
        n = len(e.input_ids)
        g = target(torch.tensor([e.input_ids]))
        torch.testing.assert_close(f.aux_hidden[r, s : s + n], g.aux_hidden[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f.final_hidden[r, s : s + n], g.final_hidden[0], rtol=1e-5, atol=1e-5)


def test_runs_of_a_packed_row():
    assert _runs([0, 0, 0, 1, 1, 2, -1, -1]) == [(0, 3), (3, 2), (5, 1)]
    assert _runs([0, 0]) == [(0, 2)] and _runs([-1, -1]) == []


def test_capture_shard_equals_the_targets(tiny):
    """What capture.py / the producers store (capture_examples) is the same from either backend."""
    target, vt = tiny
    ex = random_examples(7, 96, min_len=3, max_len=30, seed=3)
    got, want = capture_examples(vt, ex, 64, "cpu"), capture_examples(target, ex, 64, "cpu")
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5)


def test_files_for_other_tokens_are_refused(tmp_path):
    f = tmp_path / "r.safetensors"
    save_file({"hidden_states": torch.zeros(3, 2, 4), "token_ids": torch.tensor([1, 2, 3])}, f)
    with pytest.raises(RuntimeError, match="other tokens"):
        read_hidden([f], [[1, 2, 4]])


@pytest.mark.slow
def test_vllm_store_equals_hf_store_on_smollm2(tmp_path, tiny_run_inputs, smollm2_dir):
    """capture.py features --backend vllm (vLLM 0.32 CPU build, fp32) writes the store --backend hf writes:
    same schema, shards, tokens; features equal within fp32 tolerance; train.py --features opens it."""
    _, data = tiny_run_inputs  # short ShareGPT chats (turns cut to 200 characters)
    kw = dict(target=str(smollm2_dir), data=str(data), num_records=6, max_len=192, shard_mb=1)
    res = {b: features(FeaturesConfig(**kw, out=str(tmp_path / b), backend=b)) for b in ("hf", "vllm")}
    assert all(r["complete"] for r in res.values())
    (hf, hf_ex), (vl, vl_ex) = open_feature_store(tmp_path / "hf"), open_feature_store(tmp_path / "vllm")
    assert vl.schema == hf.schema and vl.keys() == hf.keys() and len(hf_ex) == 6
    worst = {"aux_hidden": 0.0, "final_hidden": 0.0}
    for a, b in zip(hf_ex, vl_ex):
        x, y = hf.read(a.ref), vl.read(b.ref)
        assert x["input_ids"].tolist() == y["input_ids"].tolist() and x["loss_mask"].tolist() == y["loss_mask"].tolist()
        for k in worst:  # the aux layers hold SmolLM2's massive activations (~2e4): a relative tolerance
            torch.testing.assert_close(y[k], x[k], rtol=1e-4, atol=1e-3)
            worst[k] = max(worst[k], float((y[k] - x[k]).abs().max() / x[k].abs().max()))
    print(json.dumps({"max_diff_over_max_abs": worst, "tokens": res["vllm"]["tokens"]}))
    assert vl.header(vl.keys()[0])["meta"]["backend"] == "vllm"
    open_for_training(tmp_path / "vllm", smollm2_dir, (), torch.float32, "cpu")  # what train.py --features checks
