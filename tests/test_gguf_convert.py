"""models/gguf_convert.py writes what transformers' GGUF loader writes (resolve_target's other path), bit for bit:
on the packaged SmolLM2 (Q4_1, Q8_0, F32) and on a tiny llama of every type it reads with an untied lm_head; its
dequantisation against the gguf package's own; damaged files named before anything is written."""

import filecmp
import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import models.target as target_mod
from data.assets import asset_path
from models.gguf_convert import PLAIN_PRE_TOKENIZERS, byte_chars, convert, dequantize, read_gguf, unsupported
from models.target import TargetError, convert_with_transformers, load_tokenizer, resolve_target

# tokenizer_config.json keys only transformers' path writes: from_pretrained records its own loading arguments
# (is_local, local_files_only) among the tokenizer's init arguments and save_pretrained writes them back; loading
# either directory passes its own, so the loaded tokenizers do not differ (test_smollm2_tokenizers_agree)
LOADING_ARGUMENTS = {"is_local", "local_files_only"}


def both_ways(gguf_path, root):
    """The file converted by nanospec's reader into root/fast and by transformers into root/transformers."""
    fast, slow = root / "fast", root / "transformers"
    convert(read_gguf(gguf_path), fast)
    convert_with_transformers(gguf_path, slow)
    return fast, slow


def assert_same_directory(fast, slow):
    """Every tensor bitwise equal under the same name, shape and dtype (the files byte for byte too), config.json,
    generation_config.json and tokenizer.json equal as JSON, the chat template equal, tokenizer_config.json equal but
    for LOADING_ARGUMENTS."""
    with safe_open(fast / "model.safetensors", "pt") as a, safe_open(slow / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert a.metadata() == b.metadata() == {"format": "pt"}
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert (x.shape, x.dtype) == (y.shape, y.dtype), name
            assert torch.equal(x.view(torch.int16), y.view(torch.int16)), f"{name} differs"
    assert filecmp.cmp(fast / "model.safetensors", slow / "model.safetensors", shallow=False)
    for f in ("config.json", "generation_config.json", "tokenizer.json"):
        # nothing ignored: both are written by the installed transformers' classes, so even transformers_version agrees
        assert json.loads((fast / f).read_text()) == json.loads((slow / f).read_text()), f
    if (slow / "chat_template.jinja").exists():
        assert (fast / "chat_template.jinja").read_text() == (slow / "chat_template.jinja").read_text()
    ours, theirs = (json.loads((d / "tokenizer_config.json").read_text()) for d in (fast, slow))
    assert ours == {k: v for k, v in theirs.items() if k not in LOADING_ARGUMENTS}
    assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in slow.iterdir())


# ---------------------------------------------------------------- the packaged SmolLM2
@pytest.fixture(scope="module")
def smollm2_both(tmp_path_factory):
    return both_ways(asset_path("smollm2_gguf"), tmp_path_factory.mktemp("smollm2"))


@pytest.mark.slow
def test_smollm2_directories_agree(smollm2_both):
    fast, slow = smollm2_both
    assert_same_directory(fast, slow)
    cfg = json.loads((fast / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (30, 3, True)


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Où est la gare ? 駅はどこですか"},
        {"role": "assistant", "content": "La gare est à gauche. 🚉"},
        {"role": "user", "content": "def f(x):\n\treturn x ** 2  # <|im_end|> inside text"},
    ],
]
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs,\n\nnewlines and trailing   ",
    "naïve café, Ελληνικά, русский, 中文字符, العربية, हिन्दी, emoji 🤖👍🏽, zero\u200bwidth",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2.5e-3; }  // C\nimport torch; print(torch.__version__)",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|><repo_name>x<file_sep>",
    "12345678901234567890 3.14159 1,000,000 0x1F",
    "",
]


@pytest.mark.slow
def test_smollm2_tokenizers_agree(smollm2_both):
    """Loaded as the main job loads them: the same ids for ASCII, unicode, code, special tokens and rendered chats,
    and the same text back."""
    a, b = (load_tokenizer(d) for d in smollm2_both)
    rendered = [a.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS]
    assert rendered == [b.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS]
    for text in TEXTS + rendered:
        ids = a(text)["input_ids"]
        assert ids == b(text)["input_ids"], text
        assert a.decode(ids) == b.decode(ids)
        assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    assert a.decode(a(TEXTS[2])["input_ids"]) == TEXTS[2]  # byte-level: lossless
    for c in CONVERSATIONS:
        assert a.apply_chat_template(c, tokenize=True) == b.apply_chat_template(c, tokenize=True)
    assert (a.bos_token, a.eos_token, a.pad_token, a.unk_token) == (b.bos_token, b.eos_token, b.pad_token, b.unk_token)
    assert len(a) == len(b) == 49152


@pytest.mark.slow
def test_smollm2_logits_agree(smollm2_both):
    a, b = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in smollm2_both)
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 30, 2]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def test_packaged_file_takes_the_fast_path(tmp_path, monkeypatch, capsys):
    """resolve_target converts the packaged file with nanospec's reader (transformers' loader is not called) and says
    so."""
    assert unsupported(read_gguf(asset_path("smollm2_gguf"))) is None
    monkeypatch.setattr(target_mod, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(target_mod, "convert_with_transformers", lambda *a: pytest.fail("transformers' path ran"))
    out = resolve_target("smollm2")
    assert "(one time, nanospec's GGUF reader" in capsys.readouterr().out
    written = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "nanospec_source.json"} <= written
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary directory left


# ---------------------------------------------------------------- tiny files written with the gguf package
def write_gguf(path, tensors: dict, metadata=None, arch="llama"):
    """A GGUF of `tensors` {name: (float32 array, ggml type)}, quantised by the gguf package, and metadata from
    `metadata(writer)`."""
    w = gguf.GGUFWriter(path, arch)
    if metadata:
        metadata(w)
    for name, (values, kind) in tensors.items():
        w.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rand(*shape, seed=0):
    """Normal values with a different scale per row (1e-3 to 1e3), so fp16 scales round in every way."""
    g = np.random.default_rng(seed)
    return (g.standard_normal(shape) * 10.0 ** g.uniform(-3, 3, (*shape[:-1], 1))).astype(np.float32)


BLOCK_SHAPES = [(1, 32), (3, 96), (5, 160), (2, 3, 64)]  # one block; rows of several blocks; 3-D
FLOAT_SHAPES = [(7,), (3, 5), (2, 3, 7), (4, 64)]


@pytest.mark.parametrize("kind", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1], ids=lambda k: k.name)
def test_dequantize_matches_the_gguf_package(tmp_path, kind):
    shapes = FLOAT_SHAPES if kind in (Q.F32, Q.F16, Q.BF16) else BLOCK_SHAPES
    tensors = {f"t{i}": (rand(*s, seed=i), kind) for i, s in enumerate(shapes)}
    gg = read_gguf(write_gguf(tmp_path / "t.gguf", tensors, arch="test"))
    for name, (values, _) in tensors.items():
        want = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(gguf.quants.quantize(values, kind), kind)))
        got = dequantize(gg, name)
        assert got.shape == values.shape and got.dtype == torch.float32, name
        assert torch.equal(got.view(torch.int32), want.reshape(values.shape).view(torch.int32)), f"{kind.name} {name}"


def tiny_vocab():
    """A byte-level vocabulary: control tokens (one spelled outside the byte alphabet: transformers skips it), a
    user-defined token, the 256 byte characters, merged tokens (" x" stored with a real space: respelled "Ġx"); no
    <|endoftext|>, which transformers' GPT-2 tokenizer adds as a default special token."""
    specials = ["<|im_start|>", "<|im_end|>", "<pad>", "<｜bad｜>", "<think>"]
    merged = ["Ġt", "he", "Ġthe", "in", "Ġa", " x"]
    tokens = specials + byte_chars() + merged
    types = [3, 3, 3, 3, 4] + [1] * (256 + len(merged))
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "Ġ x"]
    return tokens, types, merges


TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_llama_gguf(path, pre="default", kinds=None):
    """A 2-layer llama (hidden 64, 4 heads, 2 KV heads of 16, FFN 96) with an untied output, its tensors in every
    type nanospec's reader takes (`kinds` overrides some)."""
    tokens, types, merges = tiny_vocab()
    V, H, F = len(tokens), 64, 96
    plan = {"token_embd": (V, H, Q.Q8_0), "output": (V, H, Q.Q4_0), "output_norm": (H, None, Q.F32)}
    layer = {
        "attn_norm": (H, None, Q.F32),
        "ffn_norm": (H, None, Q.F16),
        "attn_q": (H, H, Q.Q4_1),
        "attn_k": (32, H, Q.Q4_0),
        "attn_v": (32, H, Q.F16),
        "attn_output": (H, H, Q.BF16),
        "ffn_gate": (F, H, Q.Q8_0),
        "ffn_up": (F, H, Q.Q4_1),
        "ffn_down": (H, F, Q.Q4_1),  # rows of 3 blocks
    }
    plan |= {f"blk.{i}.{n}": v for i in range(2) for n, v in layer.items()}
    plan |= kinds or {}
    tensors = {
        f"{n}.weight": (rand(*[d for d in (r, c) if d], seed=j), k) for j, (n, (r, c, k)) in enumerate(plan.items())
    }

    def metadata(w):
        w.add_name("tiny llama")
        w.add_context_length(256)
        w.add_embedding_length(H)
        w.add_block_count(2)
        w.add_feed_forward_length(F)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_rope_dimension_count(16)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_pad_token_id(2)
        w.add_add_bos_token(True)
        w.add_chat_template(TEMPLATE)

    return write_gguf(path, tensors, metadata)


@pytest.mark.parametrize("pre", PLAIN_PRE_TOKENIZERS)
def test_tiny_llama_agrees_with_transformers(tmp_path, pre):
    """Untied lm_head, grouped-query Q/K un-permutation, every tensor type, control / user-defined / mislabelled
    tokens, add_bos_token, each pre-tokenizer name the reader takes: the two directories agree, and the tokenizers
    encode alike."""
    path = tiny_llama_gguf(tmp_path / "tiny.gguf", pre=pre)
    assert unsupported(read_gguf(path)) is None
    fast, slow = both_ways(path, tmp_path)
    assert_same_directory(fast, slow)
    assert json.loads((fast / "config.json").read_text())["tie_word_embeddings"] is False
    a, b = load_tokenizer(fast), load_tokenizer(slow)
    for text in ("the cat in a hat x", " <think>the</think><|im_end|> <｜bad｜>", "é ü 🤖"):
        assert a(text)["input_ids"] == b(text)["input_ids"], text
    assert a("the")["input_ids"][0] == 0  # add_bos_token


def test_plain_pre_tokenizers_are_none_transformers_splits():
    """The names the reader takes are none of those transformers gives a split regex of their own (the table of the
    transformers CI installs; the GPU machine's older one has none)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # lazy: only this test reads the table
        GGUF_PRE_TOKENIZER_SPLITS,
    )

    assert "llama-bpe" in GGUF_PRE_TOKENIZER_SPLITS
    assert not set(PLAIN_PRE_TOKENIZERS) & set(GGUF_PRE_TOKENIZER_SPLITS)


@pytest.mark.parametrize(
    "case,why", [("pre", "tokenizer.ggml.pre 'llama-bpe'"), ("type", "tensor types Q5_0 (this reader: F32")]
)
def test_other_files_go_through_transformers(tmp_path, monkeypatch, capsys, case, why):
    """A pre-tokenizer transformers splits its own way, a tensor type nanospec's reader does not take (Q5_0):
    resolve_target converts through transformers and says why."""
    kinds = {"blk.1.ffn_up": (96, 64, Q.Q5_0)} if case == "type" else None
    path = tiny_llama_gguf(tmp_path / "t.gguf", pre="llama-bpe" if case == "pre" else "default", kinds=kinds)
    assert why in unsupported(read_gguf(path))
    monkeypatch.setattr(target_mod, "CACHE_DIR", tmp_path / "cache")
    assert (resolve_target(str(path)) / "model.safetensors").exists()
    assert f"transformers' GGUF loader, ~13 s: nanospec's reader does not take {why}" in capsys.readouterr().out


def test_unsupported_names_what_it_meets(tmp_path):
    """Other architectures and vocabularies, and a llama named 'mistral' (transformers builds a Mistral for it)."""
    empty = read_gguf(write_gguf(tmp_path / "q.gguf", {}, arch="qwen2"))
    assert unsupported(empty) == "architecture 'qwen2'"
    gg = read_gguf(tiny_llama_gguf(tmp_path / "t.gguf"))
    for key, value, why in [
        ("tokenizer.ggml.model", "llama", "tokenizer.ggml.model 'llama'"),
        ("general.name", "mistral", "named 'mistral'"),
        ("llama.attention.head_count_kv", np.array([2, 2], np.uint32), "arrays where a config value is expected"),
    ]:
        saved, gg.metadata[key] = gg.metadata[key], value
        assert why in unsupported(gg)
        gg.metadata[key] = saved
    assert unsupported(gg) is None


# ---------------------------------------------------------------- damaged files
@pytest.mark.parametrize(
    "cut,message",
    [
        (500_000, r"cut off in the metadata: key 25 of 33 \(tokenizer.ggml.tokens\) runs past the end of the file"),
        (1_777_000, r"cut off in the tensor table: tensor \d+ of 272 runs past the end of the file"),
        (60_000_000, r"cut off in the tensor data: blk\.\d+\.\w+\.weight \(Q4_1 \[\d+, \d+\]\) ends at byte \d+"),
    ],
    ids=["metadata", "tensor table", "tensor data"],
)
def test_cut_file_is_named_and_leaves_nothing(tmp_path, monkeypatch, capsys, cut, message):
    """The packaged file cut off (an interrupted download): a TargetError naming the file and where it ends, before
    the conversion starts, and nothing in the cache."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(target_mod, "CACHE_DIR", cache)
    bad = tmp_path / "cut.gguf"
    with open(asset_path("smollm2_gguf"), "rb") as f:
        bad.write_bytes(f.read(cut))
    with pytest.raises(TargetError, match=rf"cannot convert {bad} \({message}"):
        resolve_target(str(bad))
    assert not cache.exists() and "[target] converting" not in capsys.readouterr().out
