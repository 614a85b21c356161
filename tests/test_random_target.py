"""tools/random_target.py: a preset-shaped random target directory loads back into the compiled
backend with the same weights (so train.py --backend compiled runs on it) and into transformers
with the same hidden states (the disaggregated producer's HF target), with a chat template."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.fast_target import PRESETS, FastTarget, TargetConfig
from models.target import Target, TargetError, load_heads
from tools.random_target import write_random_target

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_written_target_loads_back(tmp_path, preset):
    cfg = {**PRESETS[preset], **TINY}
    if preset == "qwen3-30b-a3b":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    out = write_random_target(cfg, tmp_path / "t", dtype=torch.float32, seed=3)
    ref = FastTarget.from_config(TargetConfig.from_dict(cfg), [0, 1, 2], dtype=torch.float32, device="cpu", seed=3)
    back = FastTarget.from_pretrained(out, [0, 1, 2], dtype=torch.float32, device="cpu")
    ids = torch.randint(0, cfg["vocab_size"], (2, 11))
    a, b = ref(ids), back(ids)
    assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden)
    # transformers reads it too (through model.safetensors.index.json): the disaggregated producer's target
    hf = Target.load(out, [0, 1, 2], torch.float32, "cpu")(ids)
    torch.testing.assert_close(hf.aux_hidden, a.aux_hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(hf.final_hidden, a.final_hidden, rtol=1e-4, atol=1e-5)
    from transformers import AutoTokenizer  # heavy (transformers): not at module import

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template and not (tmp_path / "t.tmp").exists()


def test_cli_says_what_does_not_fit_in_one_line(tmp_path):
    """--heads without --no-weights on the command line: an `error:` line and exit 1, no traceback, nothing written."""
    p = subprocess.run(
        [sys.executable, "tools/random_target.py", "llama-3.1-8b", str(tmp_path / "t"), "--heads"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: heads=True") and not (tmp_path / "t").exists()


def test_vocab_smaller_than_tokenizer_fails(tmp_path):
    with pytest.raises(ValueError, match="more than the preset's vocab_size"):
        write_random_target(
            {**PRESETS["llama-3.1-8b"], **TINY, "vocab_size": 1000}, tmp_path / "t", dtype=torch.float32
        )


def test_no_weights_target_is_drawn_at_load(tmp_path):
    """--no-weights: config.json and the tokenizer only (the 30B-A3B shape's 61 GB would fill the GPU machine's disk);
    the compiled backend draws the weights from_config would with the seed, --backend auto takes it on a GPU, and the
    loaders that read weight files refuse it by name."""
    from core.features import pick_backend  # core imports models/: this file tests tools/ and models/ otherwise

    cfg = {**PRESETS["qwen3-30b-a3b"], **TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    out = write_random_target(cfg, tmp_path / "t", dtype=torch.float32, seed=5, weights=False)
    assert not list(out.glob("*.safetensors")) and (out / "tokenizer.json").exists()
    ref = FastTarget.from_config(TargetConfig.from_dict(cfg), [0, 1, 2], dtype=torch.float32, device="cpu", seed=5)
    back = FastTarget.from_pretrained(out, [0, 1, 2], dtype=torch.float32, device="cpu")
    ids = torch.randint(0, cfg["vocab_size"], (2, 9))
    a, b = ref(ids), back(ids)
    assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden)
    assert back.path == out
    assert pick_backend(out, "cuda") == ("compiled", None)
    with pytest.raises(TargetError, match="no weight files.*the hf backend"):
        Target.load(out, [0, 1, 2], torch.float32, "cpu")
    with pytest.raises(TargetError, match="no weight files.*stored features"):
        load_heads(out, [0, 1, 2])


def test_heads_only_target_draws_the_layers_and_reads_its_heads(tmp_path):
    """--no-weights --heads (the offline anchor's 30B-A3B verifier): model.safetensors holds the embeddings, final norm
    and lm_head alone; the compiled backend draws the layers with the seed and takes those three from the file, the
    stored features' loader reads them, and transformers still refuses a directory without its layers."""
    cfg = {**PRESETS["qwen3-30b-a3b"], **TINY, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    with pytest.raises(ValueError, match="weights=False"):
        write_random_target(cfg, tmp_path / "w", dtype=torch.float32, heads=True)
    out = write_random_target(cfg, tmp_path / "t", dtype=torch.float32, seed=5, weights=False, heads=True)
    heads = load_file(out / "model.safetensors")
    assert sorted(heads) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    drawn = FastTarget.from_config(TargetConfig.from_dict(cfg), [0, 1, 2], dtype=torch.float32, device="cpu", seed=5)
    back = FastTarget.from_pretrained(out, [0, 1, 2], dtype=torch.float32, device="cpu")
    ours, ref = back.state_dict(), drawn.state_dict()
    for k in ref:
        assert torch.equal(ours[k], heads[k] if k in heads else ref[k]), k
    assert not torch.equal(ours["lm_head.weight"], ref["lm_head.weight"])  # the file's, not the seed's draw
    h = load_heads(out, [0, 1, 2])
    assert torch.equal(h.embed_tokens.weight, heads["model.embed_tokens.weight"])
    assert torch.equal(h.lm_head.weight, heads["lm_head.weight"])
    with pytest.raises(TargetError, match="no weight files.*the hf backend"):
        Target.load(out, [0, 1, 2], torch.float32, "cpu")
