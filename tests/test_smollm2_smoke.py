"""Short smoke test on the real default target (SmolLM2-135M-Instruct from the packaged GGUF)."""

import json

import gguf
import pytest
import torch

from core.train_config import TrainConfig
from core.trainer import Trainer
from data.assets import asset_path
from models.target import Target, gguf_parsed_once


@pytest.mark.slow
def test_smollm2_capture_and_train(tmp_path, smollm2_dir):
    target = Target.load(smollm2_dir)
    assert target.aux_layers == [1, 14, 26]  # [1, L//2-1, L-4] for 30 layers
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356]])
    feats = target(ids)
    assert feats.aux_hidden.shape == (1, 7, 3 * 576) and feats.final_hidden.shape == (1, 7, 576)
    # the captured features are HF's hidden_states at [i+1] and the final (normed) state
    ref = target.model(ids, output_hidden_states=True)
    hs = ref.hidden_states
    torch.testing.assert_close(feats.aux_hidden, torch.cat([hs[2], hs[15], hs[27]], -1))
    torch.testing.assert_close(target.lm_head(feats.final_hidden), ref.logits)

    cfg = TrainConfig(
        num_records=40,
        holdout=2,
        max_len=96,
        batch_size=2,
        steps=3,
        ttt_length=2,
        draft_vocab_size=1024,
        out=str(tmp_path / "run"),
        progress=False,
    )
    res = Trainer(cfg).train()
    rows = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if r["split"] == "train"]
    assert len(train) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert set(res["eval_end"]) == {"acc_0", "acc_1", "loss_0", "loss_1"}
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    assert {"config", "git_commit", "versions", "hardware", "results"} <= set(meta)
    assert (tmp_path / "run" / "ckpt" / "step_3" / "draft.safetensors").exists()


def test_gguf_parsed_once():
    """resolve_target's conversion parses the GGUF once (not once each for config, tokenizer and weights) and
    builds the tensor-name map once; outside the context the gguf package is as it was."""
    path = asset_path("smollm2_gguf")
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # transformers passes a str, we a Path: one parse
        assert first.fields["general.architecture"] is not None
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30) is names
        assert names.get_name("model.layers.0.self_attn.q_proj") == "blk.0.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (real_reader, real_map)
    assert gguf.GGUFReader(path) is not first
