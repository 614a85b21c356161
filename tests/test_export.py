"""export.py: training checkpoint -> serving dir -> back, bit for bit (fp32), with the names,
shapes and config fields vLLM's EAGLE-3 loader (vllm 0.32, models/llama_eagle3.py) reads, the
per-engine aux layer ids, and loud failures on broken checkpoints."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import export
from models.eagle3 import Eagle3Config, Eagle3Draft
from models.target import Target
from tests.tiny import tiny_llama


def make_checkpoint(root, seed=0, draft_vocab=40, aux_layers=None, hf=None):
    """A run dir laid out as train.py writes it: ckpt/step_N/{draft.safetensors, config.json}
    + ckpt/latest, next to a saved tiny target."""
    hf = hf or tiny_llama(seed=seed, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    tdir = root / "target"
    hf.save_pretrained(tdir)
    t = Target(hf, aux_layers)
    cfg = Eagle3Config.from_target(hf.config, draft_vocab, t.aux_layers)
    torch.manual_seed(seed)
    d = Eagle3Draft(cfg)
    for p in d.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.randperm(hf.config.vocab_size)[:draft_vocab].sort().values
    d.d2t.copy_(ids - torch.arange(draft_vocab))
    d.t2d[ids] = True
    step = root / "run" / "ckpt" / "step_7"
    step.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, step / "draft.safetensors")
    (step / "config.json").write_text(json.dumps({"strategy": "eagle3", "draft": cfg.to_dict(), "target": str(tdir)}))
    (root / "run" / "ckpt" / "latest").write_text("step_7")
    return root / "run", d, hf


def draft_outputs(d: Eagle3Draft, seed=0):
    """Logits of a KV-cached decode: two calls, so the cache path is covered too."""
    g = torch.Generator().manual_seed(seed)
    H, Ht, n = d.config.hidden_size, d.config.target_hidden_size, len(d.config.aux_layers)
    emb, aux = torch.randn(1, 6, H, generator=g), torch.randn(1, 6, n * Ht, generator=g)
    with torch.no_grad():
        h, past = d.decode(emb[:, :4], d.fc(aux[:, :4]), torch.arange(4)[None])
        h2, _ = d.decode(emb[:, 4:], h[:, -2:], torch.arange(4, 6)[None], past)
        return torch.cat([d.logits(h), d.logits(h2)], 1), d.draft_ids


def test_roundtrip_fp32_is_exact(tmp_path):
    run, d, _ = make_checkpoint(tmp_path)
    out = export.export(run, tmp_path / "served", dtype="fp32")
    back, cfg = export.load_exported(out)
    assert back.config == d.config
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    (l0, ids0), (l1, ids1) = draft_outputs(d), draft_outputs(back)
    assert torch.equal(l0, l1) and torch.equal(ids0, ids1)
    # a run dir, its ckpt/ dir and the step dir name the same checkpoint
    assert export.find_checkpoint(run) == export.find_checkpoint(run / "ckpt") == run / "ckpt" / "step_7"


def test_bf16_default_dtypes(tmp_path):
    run, d, _ = make_checkpoint(tmp_path)
    out = export.export(run, tmp_path / "served")
    sd = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16"
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.bfloat16 for k, v in sd.items() if k not in ("d2t", "t2d"))
    back, _ = export.load_exported(out)
    torch.testing.assert_close(draft_outputs(back)[0], draft_outputs(d)[0], rtol=0.05, atol=0.05)


# what vLLM 0.32's Eagle3LlamaForCausalLM.load_weights does to checkpoint names
_VLLM_STACKED = {
    ".q_proj": ".qkv_proj",
    ".k_proj": ".qkv_proj",
    ".v_proj": ".qkv_proj",
    ".gate_proj": ".gate_up_proj",
    ".up_proj": ".gate_up_proj",
}


def vllm_param_names(names):
    out = set()
    for name in names:
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name
        name = name.replace("midlayer.", "layers.0.")
        for a, b in _VLLM_STACKED.items():
            name = name.replace(a, b)
        out.add(name)
    return out


VLLM_PARAMS = {  # the parameters of Eagle3LlamaForCausalLM for a 1-layer draft with draft_vocab < V
    "model.fc.weight",
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.hidden_norm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
    "draft_id_to_target_id",
}


@pytest.mark.parametrize("with_embeddings", [False, True])
def test_names_shapes_and_config_match_vllm_loader(tmp_path, with_embeddings):
    run, d, hf = make_checkpoint(tmp_path)
    out = export.export(run, tmp_path / "served", with_embeddings=with_embeddings)
    sd = load_file(out / "model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    c, tc = d.config, hf.config
    want = VLLM_PARAMS | ({"model.embed_tokens.weight"} if with_embeddings else set())
    assert vllm_param_names(sd) == want
    if with_embeddings:
        assert torch.equal(sd["embed_tokens.weight"], hf.get_input_embeddings().weight.to(torch.bfloat16))
    H, Ht, D = c.hidden_size, c.target_hidden_size, c.head_dim
    n_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    # shapes vLLM allocates from the config
    assert sd["fc.weight"].shape == (cfg["hidden_size"], cfg["target_hidden_size"] * n_aux)
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (q, 2 * cfg["hidden_size"])
    assert sd["midlayer.self_attn.k_proj.weight"].shape == sd["midlayer.self_attn.v_proj.weight"].shape == (kv, 2 * H)
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (cfg["intermediate_size"], H)
    assert sd["lm_head.weight"].shape == (cfg["draft_vocab_size"], H)
    assert sd["d2t"].shape == (cfg["draft_vocab_size"],) and sd["t2d"].shape == (cfg["vocab_size"],)
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == tc.vocab_size and cfg["target_hidden_size"] == tc.hidden_size == Ht
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert not cfg["norm_before_residual"]  # residual = un-normed hidden, as our midlayer does
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}  # the target's
    assert cfg["head_dim"] == D and cfg["rms_norm_eps"] == tc.rms_norm_eps
    # d2t is an offset table: target id = draft id + d2t
    assert torch.equal(torch.arange(c.draft_vocab_size) + sd["d2t"], d.draft_ids)
    # transformers parses it as a Llama config (the engines go through AutoConfig)
    from transformers import AutoConfig  # heavy (transformers): not at module import

    hc = AutoConfig.from_pretrained(out)
    assert hc.model_type == "llama" and hc.num_hidden_layers == 1 and hc.draft_vocab_size == c.draft_vocab_size


@pytest.mark.parametrize("engine,ids", [("vllm", [2, 3, 5]), ("sglang", [1, 2, 4])])
def test_aux_ids_per_engine(tmp_path, engine, ids):
    """Ours: outputs of layers [1, 2, 4] (HF hidden_states [2, 3, 5]). vLLM's id k is HF
    hidden_states[k]; SGLang adds +1 to its ids itself."""
    run, d, hf = make_checkpoint(tmp_path, aux_layers=[1, 2, 4])
    out = export.export(run, tmp_path / engine, engine=engine, dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
    back, _ = export.load_exported(out)
    assert back.config.aux_layers == [1, 2, 4]
    # without the provenance block the engine must be named
    del cfg["nanospec_export"]
    assert export.config_from_serving(cfg, engine).aux_layers == [1, 2, 4]
    with pytest.raises(export.ExportError, match="engine"):
        export.config_from_serving(cfg)
    # the default capture is the engines' default: vLLM (2, L//2, L-3) for L layers
    L = hf.config.num_hidden_layers
    assert export.engine_aux_ids([1, L // 2 - 1, L - 4], "vllm") == [2, L // 2, L - 3]


def _rewrite(step, fn):
    sd = load_file(step / "draft.safetensors")
    fn(sd)
    save_file(sd, step / "draft.safetensors")


@pytest.mark.parametrize(
    "breakage,message",
    [
        (lambda sd: sd.pop("d2t"), r"missing tensors \['d2t'\]"),
        (lambda sd: sd.pop("midlayer.hidden_norm.weight"), r"missing tensors \['midlayer.hidden_norm.weight'\]"),
        (lambda sd: sd.update({"fc.weight": sd["fc.weight"][:, :-1].contiguous()}), r"fc.weight has shape"),
        (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].T.contiguous()}), r"lm_head.weight has shape"),
        (lambda sd: sd.update({"d2t": sd["d2t"].int()}), r"d2t has dtype"),
        (lambda sd: sd.update({"d2t": torch.zeros_like(sd["d2t"])}), r"t2d does not mark"),
        (lambda sd: sd.update({"d2t": sd["d2t"] + 10_000}), r"d2t does not map"),
        (
            lambda sd: sd.update({"norm.weight": torch.full_like(sd["norm.weight"], float("nan"))}),
            r"norm.weight is not a finite",
        ),
        (lambda sd: sd.update({"extra.weight": torch.zeros(3)}), r"unexpected \['extra.weight'\]"),
    ],
)
def test_broken_checkpoints_fail_loudly(tmp_path, breakage, message):
    run, _, _ = make_checkpoint(tmp_path)
    _rewrite(run / "ckpt" / "step_7", breakage)
    with pytest.raises(export.ExportError, match=message):
        export.export(run, tmp_path / "served")
    assert not (tmp_path / "served").exists()


def test_broken_serving_dir_fails_loudly(tmp_path):
    run, _, _ = make_checkpoint(tmp_path)
    out = export.export(run, tmp_path / "served")
    sd = load_file(out / "model.safetensors")
    del sd["t2d"]
    save_file(sd, out / "model.safetensors")
    with pytest.raises(export.ExportError, match=re.escape("missing tensors ['t2d']")):
        export.load_exported(out)


def test_cli_and_target_mismatch(tmp_path, capsys):
    run, _, _ = make_checkpoint(tmp_path)
    path = export.main(export.ExportArgs(ckpt=str(run)))
    assert path == run / "export-vllm" and (path / "model.safetensors").exists()
    other = tiny_llama(vocab=64, seed=1)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(SystemExit, match="does not match the draft"):
        export.main(export.ExportArgs(ckpt=str(run), target=str(tmp_path / "other"), out=str(tmp_path / "x")))
    with pytest.raises(SystemExit, match="not a training checkpoint"):
        export.main(export.ExportArgs(ckpt=str(tmp_path)))
