"""GGUF -> Hugging Face directory in a few seconds, for the files transformers' GGUF loader would convert the slow way.

Why: transformers converts the packaged SmolLM2-135M GGUF in ~13-18 s on a 2-core CPU: the gguf package parses every
metadata value through numpy memmap slices (49k vocabulary strings, 49k merges), transformers then re-reads each one
element by element, dequantises, builds an fp32 model and casts it. Every cold start of the main job pays that. Here the
file is read once (struct for the metadata, numpy for numeric arrays), blocks are dequantised by whole tensors in torch,
and the directory is written straight from the tensors and transformers' own config and tokenizer classes.

What: `read_gguf` parses a file (GGUF versions 2 and 3) or raises GGUFFormatError saying what is damaged; `unsupported`
says why this reader cannot convert it (then resolve_target goes through transformers), None when it can: architecture
llama, byte-level BPE vocabulary (tokenizer.ggml.model "gpt2"), tensors F32, F16, BF16, Q8_0, Q4_0 or Q4_1;
`convert` writes what resolve_target's transformers path writes (config.json, generation_config.json, model.safetensors
in bf16, tokenizer.json, tokenizer_config.json, chat_template.jinja), byte for byte but for two keys of
tokenizer_config.json that transformers' path adds from its own loading arguments (is_local, local_files_only);
tests/test_gguf_convert.py compares the two on the packaged file and on a tiny llama of every type read here.

The layout (the GGUF specification in the ggml repository), all little-endian:
  header    b"GGUF", u32 version, u64 tensor count, u64 metadata count
  metadata  per key: string key, u32 value type, value; a string is u64 length + UTF-8 bytes, an array is u32 element
            type + u64 count + elements
  tensors   per tensor: string name, u32 n_dims, n_dims x u64 dims (innermost first: the torch shape is reversed),
            u32 ggml type, u64 offset into the data section
  data      from the next multiple of general.alignment (default 32) after the tensor table
"""

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken

GGUF_MAGIC = b"GGUF"  # the first 4 bytes of every GGUF file (any version)
VERSIONS = (2, 3)  # version 1 counted in u32 (and neither the gguf package nor transformers reads it)
DEFAULT_ALIGNMENT = 32

# metadata value types -> struct format (the fixed-size ones); 8 is a string, 9 an array
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
U64 = struct.Struct("<Q")

# ggml tensor types read here: id -> (name, elements per block, bytes per block)
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TENSOR_TYPES = {
    F32: ("F32", 1, 4),
    F16: ("F16", 1, 2),
    BF16: ("BF16", 1, 2),
    Q8_0: ("Q8_0", 32, 34),  # f16 scale d, 32 x int8 q: d * q
    Q4_0: ("Q4_0", 32, 18),  # f16 scale d, 16 bytes of nibbles: d * (q - 8)
    Q4_1: ("Q4_1", 32, 20),  # f16 scale d, f16 minimum m, 16 bytes of nibbles: d * q + m
}
OTHER_TYPE_NAMES = {6: "Q5_0", 7: "Q5_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}  # for messages

# llama's metadata keys -> the config.json fields transformers' converter fills from them
CONFIG_KEYS = {
    "general.architecture": "model_type",
    "general.name": "_model_name_or_path",
    "llama.context_length": "max_position_embeddings",
    "llama.block_count": "num_hidden_layers",
    "llama.feed_forward_length": "intermediate_size",
    "llama.embedding_length": "hidden_size",
    "llama.rope.dimension_count": "head_dim",
    "llama.rope.freq_base": "rope_theta",
    "llama.attention.head_count": "num_attention_heads",
    "llama.attention.head_count_kv": "num_key_value_heads",
    "llama.attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "llama.vocab_size": "vocab_size",
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}

# GGUF tensor names -> Hugging Face Llama parameter names; blk.N.* are per layer
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# tokenizer.ggml.pre names that transformers 5.24 converts to the plain GPT-2 byte-level pre-tokenizer, the one built
# here (others, e.g. llama-bpe and qwen2, get a split regex of their own there). A list of names, not transformers'
# table: transformers 5.17 (the GPU machine's) has no such table, and its own conversion of SmolLM2 marks
# <|im_start|> as the eos token; this reader writes the same directory under either version.
PLAIN_PRE_TOKENIZERS = ("default", "gpt-2", "smollm")
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
CONTROL, USER_DEFINED = 3, 4
# the special tokens of a tokenizer_config and the metadata keys of their ids
SPECIAL_TOKENS = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}


class GGUFFormatError(ValueError):
    """The file is not a readable GGUF (cut off, or a count, size or string that cannot be): says where."""


@dataclass
class TensorInfo:
    shape: tuple[int, ...]  # torch order (outermost first)
    ggml_type: int
    start: int  # absolute byte offset of its data in the file


@dataclass
class GGUFFile:
    metadata: dict  # key -> int | float | bool | str | list | numpy array (numeric arrays)
    tensors: dict[str, TensorInfo]  # in file order
    buffer: mmap.mmap  # the file, mapped copy-on-write (writable for torch.frombuffer; the file is never written)


def read_gguf(path: Path) -> GGUFFile:
    """The file's metadata and tensor table; the tensor data stays on disk (mapped) until `convert` reads it."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise GGUFFormatError(f"{size} bytes: shorter than a GGUF header (24 bytes)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError(f"it starts with {buf[:4]!r}, not {GGUF_MAGIC!r}")
    version, n_tensors, n_keys = struct.unpack_from("<IQQ", buf, 4)
    if version not in VERSIONS:
        raise GGUFFormatError(f"GGUF version {version} (this reader, like the gguf package, reads versions 2 and 3)")
    pos, metadata = 24, {}
    for i in range(n_keys):
        key = None
        try:
            key, pos = _string(buf, pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = _value(buf, pos + 4, kind)
        except (EOFError, struct.error):
            raise GGUFFormatError(
                f"cut off in the metadata: key {i + 1} of {n_keys} ({key or 'its name'}) runs past the end of the "
                f"file ({size} bytes; an interrupted download or copy?)"
            ) from None
        except ValueError as e:  # text that is not UTF-8, a value type GGUF does not define
            raise GGUFFormatError(f"metadata key {i + 1} of {n_keys} ({key or 'its name'}): {e}") from None
    table = []
    for i in range(n_tensors):
        try:
            name, pos = _string(buf, pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
        except (EOFError, struct.error):
            raise GGUFFormatError(
                f"cut off in the tensor table: tensor {i + 1} of {n_tensors} runs past the end of the file "
                f"({size} bytes; an interrupted download or copy?)"
            ) from None
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"the name of tensor {i + 1} of {n_tensors} is not UTF-8 ({e})") from None
        table.append((name, tuple(reversed(dims)), kind, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0:
        raise GGUFFormatError(f"general.alignment is {alignment!r}, not a positive integer")
    data_start = -(-pos // alignment) * alignment
    tensors = {name: TensorInfo(shape, kind, data_start + offset) for name, shape, kind, offset in table}
    for name, t in tensors.items():
        if t.ggml_type in TENSOR_TYPES and t.start + _nbytes(name, t) > size:
            raise GGUFFormatError(
                f"cut off in the tensor data: {name} ({TENSOR_TYPES[t.ggml_type][0]} {list(t.shape)}) ends at byte "
                f"{t.start + _nbytes(name, t)}, the file has {size} (an interrupted download or copy?)"
            )
    return GGUFFile(metadata, tensors, buf)


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = U64.unpack_from(buf, pos)
    pos += 8
    if pos + n > len(buf):
        raise EOFError
    return str(buf[pos : pos + n], "utf-8"), pos + n


def _value(buf, pos: int, kind: int):
    """(value, position after it) of one metadata value of type `kind`."""
    if kind in SCALAR_FORMATS:
        return struct.unpack_from(SCALAR_FORMATS[kind], buf, pos)[0], pos + struct.calcsize(SCALAR_FORMATS[kind])
    if kind == STRING:
        return _string(buf, pos)
    if kind != ARRAY:
        raise ValueError(f"a value of type {kind} (GGUF defines 0 to 12)")
    item, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item in SCALAR_FORMATS:  # numbers: one numpy view, copied out of the map
        width = struct.calcsize(SCALAR_FORMATS[item])
        if pos + count * width > len(buf):
            raise EOFError
        return np.frombuffer(buf, np.dtype(SCALAR_FORMATS[item]), count, pos).copy(), pos + count * width
    if item == STRING:  # the vocabulary and the merges: ~50k each, so the loop is kept tight
        out, unpack, end = [], U64.unpack_from, len(buf)
        append = out.append
        for _ in range(count):
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise EOFError
            append(str(buf[pos : pos + n], "utf-8"))
            pos += n
        return out, pos
    out = []
    for _ in range(count):  # arrays of arrays: allowed, rare
        v, pos = _value(buf, pos, item)
        out.append(v)
    return out, pos


def _nbytes(name: str, t: TensorInfo) -> int:
    _, block, block_bytes = TENSOR_TYPES[t.ggml_type]
    if t.shape and t.shape[-1] % block:
        raise GGUFFormatError(f"{name}: rows of {t.shape[-1]} are not whole blocks of {block}")
    return prod(t.shape) // block * block_bytes


def unsupported(gg: GGUFFile) -> str | None:
    """Why `convert` cannot write what transformers would for this file (resolve_target then converts through
    transformers), or None."""
    md = gg.metadata
    arch = md.get("general.architecture")
    if arch != "llama":
        return f"architecture {arch!r}"
    if md.get("general.name") == "mistral":
        return "a llama file named 'mistral' (transformers builds a Mistral model for it)"
    if (kind := md.get("tokenizer.ggml.model")) != "gpt2":
        return f"tokenizer.ggml.model {kind!r}"
    if "tokenizer.ggml.tokens" not in md or "tokenizer.ggml.merges" not in md:
        return "a vocabulary without tokenizer.ggml.tokens or merges"
    if odd := [k for k in CONFIG_KEYS if k in md and isinstance(md[k], list | np.ndarray)]:
        return f"arrays where a config value is expected ({', '.join(odd)})"
    if "llama.attention.head_count" not in md or "llama.attention.head_count_kv" not in md:
        return "a file without llama.attention.head_count(_kv) (transformers leaves Q and K unpermuted then)"
    if odd := sorted({t.ggml_type for t in gg.tensors.values() if t.ggml_type not in TENSOR_TYPES}):
        odd = [OTHER_TYPE_NAMES.get(k, f"ggml type {k}") for k in odd]
        return f"tensor types {', '.join(odd)} (this reader: {', '.join(n for n, _, _ in TENSOR_TYPES.values())})"
    if not isinstance(layers := md.get("llama.block_count"), int):
        return "a file without llama.block_count"
    wanted = set(hf_names(layers))  # output.weight included: a file without it ties the embeddings
    if odd := sorted((set(gg.tensors) - wanted) | (wanted - set(gg.tensors) - {"output.weight"})):
        return f"tensors other than llama's, or some missing ({', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})"
    if (pre := md.get("tokenizer.ggml.pre")) not in PLAIN_PRE_TOKENIZERS:
        return f"tokenizer.ggml.pre {pre!r} (this reader: {', '.join(PLAIN_PRE_TOKENIZERS)})"
    return None


def hf_names(layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, for a llama of `layers` decoder layers."""
    names = {f"{g}.weight": f"{h}.weight" for g, h in TOP_NAMES.items()}
    for i in range(layers):
        names |= {f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in LAYER_NAMES.items()}
    return names


def convert(gg: GGUFFile, out: Path) -> None:
    """Write the Hugging Face directory of a file `unsupported` accepts into `out` (created)."""
    from transformers import GenerationConfig  # lazy: transformers (~2 s to import)

    config = hf_config(gg)
    tensors = hf_tensors(gg, config)
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})  # what save_pretrained writes
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    hf_tokenizer(gg).save_pretrained(out)


def hf_config(gg: GGUFFile):
    """The LlamaConfig transformers' converter builds: the mapped keys, tie_word_embeddings when there is no output
    tensor, vocab_size from the vocabulary when the file names none; saved as a bf16 LlamaForCausalLM."""
    from transformers import LlamaConfig  # lazy: transformers (~2 s to import)

    md = gg.metadata
    d = {field: md[key] for key, field in CONFIG_KEYS.items() if key in md}
    d["tie_word_embeddings"] = "output.weight" not in gg.tensors
    d.setdefault("vocab_size", len(md["tokenizer.ggml.tokens"]))
    config = LlamaConfig.from_dict(d)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    return config


def hf_tensors(gg: GGUFFile, config) -> dict[str, torch.Tensor]:
    """Every tensor dequantised, Q and K un-permuted, in bf16 under its Hugging Face name."""
    h, v, i = config.hidden_size, config.vocab_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    shapes = {  # by the last part of the Hugging Face name
        "embed_tokens": (v, h),
        "lm_head": (v, h),
        "norm": (h,),
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }
    out = {}
    for name, hf in hf_names(config.num_hidden_layers).items():
        if name not in gg.tensors:  # output.weight of a tied file
            continue
        t = gg.tensors[name]
        want = shapes[hf.removesuffix(".weight").rpartition(".")[2]]
        if t.shape != want:
            raise GGUFFormatError(f"{name} is {list(t.shape)}, the config's llama wants {list(want)}")
        w = dequantize(gg, name).to(torch.bfloat16)
        if ".attn_q." in name:
            w = unpermute(w, config.num_attention_heads)
        elif ".attn_k." in name:
            w = unpermute(w, config.num_key_value_heads)
        out[hf] = w
    return out


def dequantize(gg: GGUFFile, name: str) -> torch.Tensor:
    """Tensor `name` in fp32, [its torch shape], computed as the gguf package does (fp16 scales widened to fp32, one
    fp32 multiply, then one add for Q4_1), so every value is bitwise the same; whole tensors at once, no block loop."""
    t = gg.tensors[name]
    raw = torch.frombuffer(gg.buffer, dtype=torch.uint8, count=_nbytes(name, t), offset=t.start)
    if t.ggml_type == F32:
        return raw.view(torch.float32).view(t.shape)
    if t.ggml_type in (F16, BF16):
        return raw.view(torch.float16 if t.ggml_type == F16 else torch.bfloat16).float().view(t.shape)
    blocks = raw.view(-1, TENSOR_TYPES[t.ggml_type][2])  # [n_blocks, bytes per block]
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    if t.ggml_type == Q8_0:
        return (blocks[:, 2:].contiguous().view(torch.int8).float() * d).view(t.shape)
    nibbles = blocks[:, -16:]  # [n_blocks, 16]: byte j holds element j (low 4 bits) and element j + 16 (high 4 bits)
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).float()  # [n_blocks, 32]
    if t.ggml_type == Q4_0:
        return ((q - 8) * d).view(t.shape)  # q - 8 is exact in fp32, as the gguf package's int8 subtraction
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()  # [n_blocks, 1]
    return (d * q + m).view(t.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: per head it stores the rotary pairs interleaved ([dim/2, 2] -> row), transformers
    wants the two halves ([2, dim/2]). w [heads * dim, hidden] -> the same shape."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> a printable character (bytes that print as themselves keep their
    character; the others, in order, get chr(256), chr(257), ...)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 256
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(extra))
            extra += 1
    return chars


def hf_tokenizer(gg: GGUFFile):
    """The tokenizer transformers' GGUF converter builds for a byte-level BPE vocabulary: its GPT2Tokenizer from the
    vocabulary (tokens outside the byte alphabet respelled byte by byte) and merges, the tokens marked control as
    special tokens (those spelled in the byte alphabet only), the user-defined ones as added tokens, wrapped with the
    file's special tokens, add_bos/add_eos flags and chat template."""
    from transformers import GPT2Tokenizer, PreTrainedTokenizerFast  # lazy: transformers (~2 s to import)

    md = gg.metadata
    tokens = md["tokenizer.ggml.tokens"]
    types = md["tokenizer.ggml.token_type"].tolist() if "tokenizer.ggml.token_type" in md else []
    chars = byte_chars()
    alphabet = set(chars)
    vocab = {t if set(t) <= alphabet else "".join(chars[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ")) for m in md["tokenizer.ggml.merges"]]
    bpe = GPT2Tokenizer(vocab=vocab, merges=merges)
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == CONTROL]
    control = [a for a in control if set(a.content) <= alphabet]  # others are mislabelled: not added (as transformers)
    if control:
        bpe.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    known = bpe.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if user := [a for a in user if a.content in known]:
        bpe.add_tokens(user)
    kwargs = {k: md[f"tokenizer.ggml.{k}"] for k in ("add_bos_token", "add_eos_token") if f"tokenizer.ggml.{k}" in md}
    if "tokenizer.chat_template" in md:
        kwargs["chat_template"] = md["tokenizer.chat_template"]
    for name, key in SPECIAL_TOKENS.items():
        i = md.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and not 0 <= i < len(tokens):
            raise GGUFFormatError(f"tokenizer.ggml.{key}_token_id is {i}, past the vocabulary of {len(tokens)} tokens")
        kwargs[name] = tokens[i] if i is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=bpe.backend_tokenizer, **kwargs)
