"""The compiled target backend gives the HF reference's hidden states (aux layers and final
normed) on tiny random Llama (llama3 rope scaling, GQA), Qwen2 (q/k/v biases), Qwen3 (q/k norm)
and Qwen3-MoE (mixed dense/sparse layers) models: padded batches, packed rows, whole rows,
the MoE fallback, loading from a safetensors directory, early stop, and compiled layers."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.features import load_target, pick_backend
from data.chat import Example
from data.packing import pack
from models.dflash import DFlashConfig
from models.eagle3 import Eagle3Config
from models.fast_target import PRESETS, FastTarget, TargetConfig
from models.layers import layer_shape, rope_inv_freq, rope_parameters
from models.target import Target
from tests.tiny import LLAMA3_SHORT_ROPE, TINY_TARGET_SHAPE, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
TOL = dict(rtol=1e-5, atol=1e-5)  # atol is scaled by the reference's largest value (hidden states reach ~15)


def hf_model(kind: str, seed=0):
    import transformers as tf  # heavy (transformers): not at module import

    common = dict(TINY_TARGET_SHAPE, num_hidden_layers=6, tie_word_embeddings=False)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, rope_parameters=dict(LLAMA3_SHORT_ROPE, rope_theta=10000.0))
    elif kind == "llama_tied":
        cfg = tf.LlamaConfig(**{**common, "tie_word_embeddings": True, "num_key_value_heads": 4})
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common)
    elif kind == "qwen3_moe":  # layers 1, 3 sparse (step 2), 5 forced dense
        cfg = tf.Qwen3MoeConfig(
            **common,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            mlp_only_layers=[5],
        )
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # large random weights (the default init is nearly the identity), norms near 1
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if n.endswith("norm.weight") else 0.15 * torch.randn_like(p))
    return m


def padded_batch(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def close(x, ref, tol=TOL):
    torch.testing.assert_close(x, ref, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, ref.abs().max().item()))


def assert_features_close(f, ref, lengths, tol=TOL):
    for b, n in enumerate(lengths):  # valid positions only: padding holds garbage in both
        close(f.aux_hidden[b, :n], ref.aux_hidden[b, :n], tol)
        close(f.final_hidden[b, :n], ref.final_hidden[b, :n], tol)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen2", "qwen3", "qwen3_moe"])
def test_padded_and_whole_rows_match_hf(kind):
    hf = hf_model(kind)
    ref_t, fast = Target(hf, [0, 2, 3]), FastTarget.from_hf_model(hf, [0, 2, 3])
    lengths = [37, 20, 9]
    ids, mask = padded_batch(lengths, hf.config.vocab_size)
    assert_features_close(fast(ids, mask), ref_t(ids, mask), lengths)  # flex document mask
    full = [ids.shape[1]] * 2
    assert_features_close(fast(ids[:2]), ref_t(ids[:2]), full)  # causal SDPA
    if kind == "llama_tied":
        assert fast.lm_head.weight.data_ptr() == fast.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_packed_rows_match_separate_sequences(kind):
    hf = hf_model(kind, seed=1)
    ref_t, fast = Target(hf, [1, 4]), FastTarget.from_hf_model(hf, [1, 4])
    lengths = [23, 40, 7, 31, 12, 5]
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    packed = pack([Example(d, [1] * len(d)) for d in docs], row_len=48)
    assert packed["input_ids"].shape[0] < len(docs)  # several documents share a row
    f = fast(packed["input_ids"], doc_ids=packed["doc_ids"])
    pos = packed["position_ids"]
    f_pos = fast(packed["input_ids"], doc_ids=packed["doc_ids"], position_ids=pos)  # explicit positions: same
    torch.testing.assert_close(f_pos.aux_hidden, f.aux_hidden, rtol=0, atol=0)
    for i, d in enumerate(docs):
        r, s = packed["where"][i].tolist()
        ref = ref_t(torch.tensor([d]))
        close(f.aux_hidden[r, s : s + len(d)], ref.aux_hidden[0])
        close(f.final_hidden[r, s : s + len(d)], ref.final_hidden[0])


def test_moe_fallback_equals_grouped_mm():
    hf = hf_model("qwen3_moe", seed=2)
    fast = FastTarget.from_hf_model(hf, [1, 3])
    ids, mask = padded_batch([30, 30], hf.config.vocab_size, seed=2)
    grouped = fast(ids)
    for m in fast.modules():
        if hasattr(m, "use_grouped_mm"):
            assert m.use_grouped_mm == hasattr(torch, "_grouped_mm")
            m.use_grouped_mm = False
    fallback = fast(ids)
    close(fallback.aux_hidden, grouped.aux_hidden)
    close(fallback.final_hidden, grouped.final_hidden)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3_moe"])
def test_from_pretrained_safetensors(kind, tmp_path):
    hf = hf_model(kind, seed=3)
    hf.save_pretrained(tmp_path)
    fast = FastTarget.from_pretrained(tmp_path, [0, 5], dtype=torch.float32, device="cpu")
    ids, mask = padded_batch([25, 11], hf.config.vocab_size, seed=3)
    assert_features_close(fast(ids, mask), Target(hf, [0, 5])(ids, mask), [25, 11])


def test_stops_after_last_aux_layer():
    hf = hf_model("qwen3", seed=4)
    full, short = FastTarget.from_hf_model(hf, [1, 2]), FastTarget.from_hf_model(hf, [1, 2], need_final=False)
    assert len(short.model.layers) == 3 and len(full.model.layers) == 6
    ids, _ = padded_batch([19], hf.config.vocab_size, seed=4)
    f, s = full(ids), short(ids)
    assert s.final_hidden is None
    torch.testing.assert_close(s.aux_hidden, f.aux_hidden, rtol=0, atol=0)


def check_compiled_matches_eager(kinds, whole_rows=True):
    """torch.compile of the layers (inductor on CPU) against eager on the valid positions of a
    padded batch (16 of 24 valid), packed rows (two documents per row, the second row ending in
    8 padding tokens) and, with whole_rows, whole rows; each compiled call twice (the wrong
    values of inductor's CPU flex template differed from call to call: see dense_attention_mask)."""
    torch._dynamo.reset()
    for kind in kinds:
        hf = hf_model(kind, seed=5)
        fast = FastTarget.from_hf_model(hf, [1, 2, 4])
        ids, mask = padded_batch([24, 16], hf.config.vocab_size, seed=5)
        doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 9 + [1] * 7 + [-1] * 8], dtype=torch.int32)
        cases = [(dict(attention_mask=mask), [24, 16]), (dict(doc_ids=doc), [24, 16])]
        cases += [(dict(), [24, 24])] if whole_rows else []
        refs = [fast(ids, **kw) for kw, _ in cases]
        fast.compile_layers()
        for _ in range(2):
            for (kw, lengths), ref in zip(cases, refs):
                assert_features_close(fast(ids, **kw), ref, lengths, tol=dict(rtol=1e-4, atol=1e-5))


def test_compiled_layers_match_eager():
    """One graph for all layers, same numbers, dense and MoE (whose fp32 experts go through the
    opaque fallback op under compile)."""
    check_compiled_matches_eager(["llama", "qwen3_moe"])


@pytest.mark.parametrize("capability", ["default", "native"])
def test_compiled_layers_match_eager_per_cpu_capability(capability, tmp_path):
    """The same check in a fresh process with ATEN_CPU_CAPABILITY=default (inductor then emits
    scalar C++) and with the machine's own vector ISA (avx2, avx512, ...): compiled CPU layers
    must not depend on the vector width, as torch 2.13's C++ flex template did (wrong or NaN
    with AVX2 only). One dense model, padded and packed rows (one graph), to keep it short.
    A private inductor cache: torch 2.13 reuses a graph cached under another capability
    (vectorized C++ then fails to build under 'default': 'at::vec' has not been declared)."""
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    if capability == "default":
        env["ATEN_CPU_CAPABILITY"] = "default"
    code = (
        "import torch, tests.test_fast_target as t; print(torch.backends.cpu.get_cpu_capability(), flush=True); "
        "t.check_compiled_matches_eager(['llama'], whole_rows=False)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    assert (r.stdout.split()[0] == "DEFAULT") == (capability == "default"), r.stdout


def test_random_init_and_presets():
    c = TargetConfig.preset("llama-3.1-8b")
    assert (c.num_hidden_layers, c.num_key_value_heads, c.rope_parameters["rope_type"]) == (32, 8, "llama3")
    m = TargetConfig.preset("qwen3-30b-a3b")
    assert m.is_moe(0) and m.num_experts == 128 and m.norm_topk_prob and m.qk_norm
    assert TargetConfig.preset("qwen3-8b").qk_norm and not TargetConfig.preset("qwen3-8b").qkv_bias
    hf_cfg = c.to_hf()  # the HF config of a preset: same rope as ours
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # heavy (transformers): not at module import

    inv_hf, scale = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    inv, our_scale = rope_inv_freq(c)
    torch.testing.assert_close(inv, inv_hf, rtol=0, atol=0)
    assert scale == our_scale == 1.0
    tiny = TargetConfig.from_dict(
        {
            **PRESETS["qwen3-30b-a3b"],
            "hidden_size": 32,
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "vocab_size": 50,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
        }
    )
    t = FastTarget.from_config(tiny, [0, 1], dtype=torch.float32, device="cpu")
    assert not any(p.is_meta for p in t.parameters())
    std = t.model.layers[0].mlp.experts.gate_up_proj.std().item()
    assert 0.015 < std < 0.025 and torch.all(t.model.norm.weight == 1)
    f = t(torch.randint(0, 50, (2, 9)))
    assert f.aux_hidden.shape == (2, 9, 64) and torch.isfinite(f.final_hidden).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_cuda_bf16_eager_compiled_and_cudagraphs(kind):
    """On the GPU in bf16: ours eager (padded + whole rows), compiled, and compiled with CUDA graphs
    are each no further from the fp32 truth than HF's own bf16 forward (x2: bf16 rounding alone puts
    both ~2% away in relative L2, and flips a few MoE routing ties); MoE experts run torch._grouped_mm."""
    torch._dynamo.reset()
    hf32 = hf_model(kind, seed=6).cuda()
    hf = copy.deepcopy(hf32).to(torch.bfloat16)
    ref32, ref_t, fast = Target(hf32, [1, 3, 4]), Target(hf, [1, 3, 4]), FastTarget.from_hf_model(hf, [1, 3, 4])
    if kind == "qwen3_moe":
        assert all(m.use_grouped_mm for m in fast.modules() if hasattr(m, "use_grouped_mm"))
    lengths = [256, 200, 77]
    ids, mask = (x.cuda() for x in padded_batch(lengths, hf.config.vocab_size, seed=6))
    truth = {"pad": (ref32(ids, mask), lengths), "full": (ref32(ids), [256] * 3)}

    def rel_err(f, which):  # relative L2 error over valid positions, aux and final hidden states
        t, lens = truth[which]
        errs = []
        for a, b in ((f.aux_hidden, t.aux_hidden), (f.final_hidden, t.final_hidden)):
            x = torch.cat([a[i, :n] for i, n in enumerate(lens)]).float()
            y = torch.cat([b[i, :n] for i, n in enumerate(lens)]).float()
            errs.append(((x - y).norm() / y.norm()).item())
        return max(errs)

    budget = {w: 2 * rel_err(ref_t(ids, mask) if w == "pad" else ref_t(ids), w) + 1e-3 for w in truth}
    eager_pad, eager_full = fast(ids, mask), fast(ids)
    got = {("eager", "pad"): rel_err(eager_pad, "pad"), ("eager", "full"): rel_err(eager_full, "full")}
    for mode in (None, "reduce-overhead"):
        fast.compile_layers(mode=mode)
        for _ in range(3):  # CUDA graphs: warm-up, record, replay
            pad, full = fast(ids, mask), fast(ids)
        got[(mode or "compiled", "pad")], got[(mode or "compiled", "full")] = rel_err(pad, "pad"), rel_err(full, "full")
    assert all(e < budget[w] for (_, w), e in got.items()), (got, budget)


def test_backend_auto_picks_compiled_on_gpu_where_it_builds(tmp_path):
    """train.py --backend auto: compiled on a GPU for an architecture FastTarget builds from safetensors,
    hf with the reason otherwise, and always hf on CPU (the reference; compiling pays only on a GPU)."""
    llama = tmp_path / "llama"
    hf_model("llama").save_pretrained(llama)
    assert pick_backend(llama, "cuda") == ("compiled", None)
    assert pick_backend(llama, "cpu") == ("hf", None)
    assert type(load_target("auto", llama)) is Target  # what the disaggregated producers run on CPU

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 97}))
    backend, why = pick_backend(gpt2, "cuda")
    assert backend == "hf" and "'gpt2' not supported" in why

    bins = tmp_path / "bins"
    bins.mkdir()
    (bins / "config.json").write_text((llama / "config.json").read_text())
    backend, why = pick_backend(bins, "cuda")
    assert backend == "hf" and "no .safetensors" in why


def test_layer_shape_reads_an_hf_config_and_its_json_alike():
    """models/layers.layer_shape is the one reader of a target layer's shape (the EAGLE-3 and DFlash drafts, the
    compiled target): an HF config and its config.json dict give the same fields; kv heads and head_dim are
    derived where a config omits them; an old-style rope (rope_theta + rope_scaling) reads as rope_parameters."""
    hf = tiny_llama(seed=0)
    d = hf.config.to_dict()
    assert layer_shape(hf.config) == layer_shape(d)
    shape = layer_shape(d)
    assert shape["head_dim"] == hf.config.head_dim and shape["num_key_value_heads"] == hf.config.num_key_value_heads
    e = Eagle3Config.from_target(hf.config, 64, [0, 1, 2])
    b = DFlashConfig.from_target(hf.config, [0, 1, 2], 4, 1)
    assert all(getattr(e, k) == v == getattr(b, k) for k, v in shape.items())
    assert TargetConfig.from_dict(d).head_dim == shape["head_dim"]
    bare = {k: v for k, v in d.items() if k not in ("head_dim", "num_key_value_heads", "rope_parameters")}
    bare |= {"rope_theta": 5e5, "rope_scaling": {"factor": 8.0}}
    s = layer_shape(bare)
    assert s["num_key_value_heads"] == d["num_attention_heads"]
    assert s["head_dim"] == d["hidden_size"] // d["num_attention_heads"]
    assert s["rope_parameters"] == rope_parameters(bare) == {"rope_type": "default", "rope_theta": 5e5, "factor": 8.0}
    with pytest.raises(KeyError):
        layer_shape({k: v for k, v in d.items() if k != "hidden_size"})


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "qwen3_moe"])
def test_target_matmul_params_count_the_routed_experts_a_token_runs(kind):
    """MFU's target FLOPs (core/trainer.target_matmul_params): every matmul parameter once, the embedding lookup
    not, and of an MoE layer's E stacked experts only the k a token is routed to; HF's model and ours alike."""
    from core.trainer import target_matmul_params  # heavy (the trainer's imports): not at module import

    hf = hf_model(kind)
    c = hf.config
    H, V = c.hidden_size, c.vocab_size
    expected = sum(p.numel() for p in hf.parameters()) - (0 if c.tie_word_embeddings else V * H)
    if kind == "qwen3_moe":  # layers 1 and 3 sparse: E - k experts of gate, up and down not run by a token
        expected -= 2 * (c.num_experts - c.num_experts_per_tok) * 3 * H * c.moe_intermediate_size
    for t in (Target(hf, [1, 3]), FastTarget.from_hf_model(hf, [1, 3])):
        assert target_matmul_params(t) == expected
