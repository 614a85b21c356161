"""The frozen target model: load it (HF directory, GGUF file, or the packaged default) and
capture the features a draft trains on.

Index conventions (DESIGN.md, "Index conventions"): `aux_layers` are 0-based decoder-layer indices whose
*outputs* we capture; layer i's output is HF `output_hidden_states[i + 1]`. The EAGLE-3
default is [1, L//2 - 1, L - 4]. The final hidden state is after the model's final norm, so
`logits = lm_head(final_hidden)`.
"""

import contextlib
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from data.assets import CACHE_DIR, asset_path
from data.chat import DataError
from models.gguf_convert import GGUF_MAGIC, GGUFFormatError, read_gguf, unsupported
from models.gguf_convert import convert as convert_gguf

DEFAULT_TARGET = "smollm2"  # the packaged SmolLM2-135M-Instruct GGUF


class TargetError(DataError):
    """A target (directory, GGUF file, tokenizer) that cannot be loaded: names the file and why.
    A DataError, so the entry scripts print it as `error: ...` and exit non-zero."""


class AuxLayersError(TargetError, ValueError):
    """--aux-layers that the target does not have (a ValueError as before, and an `error:` line in the scripts)."""


def check_config(path: Path) -> dict:
    """The target directory's config.json, or a TargetError naming it: unreadable, not JSON, not
    an object, no model_type, or a model_type this transformers does not know (remote code is
    not loaded, so an auto_map does not help)."""
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"target directory {path} has no config.json: is it a Hugging Face model dir?")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TargetError(
            f"{file} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): "
            "the target directory is damaged or incompletely copied"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise TargetError(f"{file} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise TargetError(f"{file} holds a JSON {type(cfg).__name__}, not an object: is it a model config?")
    model_type = cfg.get("model_type")
    if not model_type:
        raise TargetError(
            f"{file} has no 'model_type': transformers cannot tell which architecture to build "
            '(a Hugging Face causal-LM config.json names it, e.g. "model_type": "llama")'
        )
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # lazy: transformers (~1.5 s)
    except ImportError:
        return cfg
    if model_type not in CONFIG_MAPPING_NAMES:
        import transformers  # lazy: transformers (~1.5 s), loaded by now

        raise TargetError(
            f"{file}: model_type {model_type!r} is not known to transformers {transformers.__version__} "
            "(misspelled, or a newer architecture: upgrade transformers)"
        )
    return cfg


def check_weights(path: Path) -> None:
    """Every *.safetensors file of a target directory whole: a readable header, and as many bytes as the
    tensors it lists. A truncated or incompletely copied file was a SafetensorError from deep inside
    from_pretrained; reading the headers costs a few KB a file."""
    for f in sorted(Path(path).glob("*.safetensors")):
        damaged = f"{f} is damaged or incompletely copied"
        try:
            size = f.stat().st_size
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if size < 8 or 8 + n > size:
                    raise TargetError(f"{damaged}: {size} bytes, its header alone needs {8 + n}")
                header = json.loads(fh.read(n))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except TargetError:
            raise
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:  # not a safetensors header
            raise TargetError(f"{damaged}: its header cannot be read ({type(e).__name__}: {e})") from None
        except OSError as e:
            raise TargetError(f"{f} cannot be read ({type(e).__name__}: {e})") from None
        if 8 + n + end > size:
            raise TargetError(f"{damaged}: {size} bytes, its tensors end at byte {8 + n + end} (truncated?)")


def check_gguf(path: Path) -> None:
    """Fail at once, before a conversion starts, on a file that is not GGUF."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise TargetError(f"target file {path} cannot be read ({type(e).__name__}: {e})") from None
    if head != GGUF_MAGIC:
        raise TargetError(
            f"target file {path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r} "
            "(pass a real .gguf file or a Hugging Face model directory)"
        )


def default_aux_layers(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def config_int(target_dir: Path, name: str) -> int | None:
    """An integer field of the target's config.json (or of its text_config, a multimodal model's), None if it names
    none or cannot be read (resolve_target has read it: not expected)."""
    try:
        c = json.loads((Path(target_dir) / "config.json").read_text())
        v = c.get(name) or (c.get("text_config") or {}).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def target_context(target_dir: Path) -> int | None:
    """The target's context: its config.json's max_position_embeddings, None if it names none."""
    return config_int(target_dir, "max_position_embeddings")


def eos_ids(model, tokenizer) -> list[int]:
    """The token ids that end a reply: the generation config's eos (one id or a list; an HF model's own, else the
    generation_config.json in `model.path`, a compiled target's directory) and the tokenizer's, in that order."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        from transformers import GenerationConfig  # lazy: transformers (~1.5 s to import)

        path = getattr(model, "path", None)
        found = path is not None and (Path(path) / "generation_config.json").exists()
        gc = GenerationConfig.from_pretrained(path) if found else GenerationConfig()
    ids = gc.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def past_context(target_dir: Path, tokens: int, what: str) -> str:
    """Why `tokens` (a row, a prompt plus its reply) do not fit the target's context (its config.json's
    max_position_embeddings, or its text_config's), "" when they do or the config names none: past it the target
    runs positions it was never trained on, and its hidden states are no longer what a draft should learn."""
    if (ctx := target_context(target_dir)) and tokens > ctx:
        return (
            f"{what} ({tokens}) does not fit the target's context of {ctx} tokens (max_position_embeddings in "
            f"{Path(target_dir) / 'config.json'})"
        )
    return ""


@contextlib.contextmanager
def gguf_parsed_once():
    """Within it, the `gguf` package parses a file once and builds a tensor-name map once. transformers converts a
    GGUF with three full parses (the config, the tokenizer, the weights; each reads every field, SmolLM2's 49k
    vocabulary strings included, ~6 s on a 2-core CPU) and builds the architecture's name map for every module of
    the model (~400 times, ~7 s): together about half of the conversion's time. transformers imports both names
    from `gguf` at call time, so swapping the module's attributes reaches it; the readers are read-only memory maps,
    the maps are looked up and never changed."""
    try:
        import gguf as gg  # optional: only a .gguf target needs it
    except ImportError:  # transformers says what to install when it needs it
        yield
        return
    real_reader, real_map = gg.GGUFReader, gg.get_tensor_name_map
    readers: dict = {}
    maps: dict = {}

    def reader(path, *args, **kwargs):
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    def name_map(*args):
        if args not in maps:
            maps[args] = real_map(*args)
        return maps[args]

    gg.GGUFReader, gg.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gg.GGUFReader, gg.get_tensor_name_map = real_reader, real_map


def resolve_target(spec: str) -> Path:
    """'smollm2' | path/to/model.gguf | HF model directory  ->  HF directory with safetensors.

    GGUF files are dequantised once into a cached bf16 safetensors directory (later loads take about a second). A
    llama file with a byte-level BPE vocabulary and F32/F16/BF16/Q8_0/Q4_0/Q4_1 tensors, the packaged SmolLM2 among
    them, goes through models/gguf_convert.py, which writes what transformers' GGUF loader would (~5 s for SmolLM2 on a
    2-core CPU from a bare process: ~1 s of work, the rest importing torch and transformers, which the main job
    imports next anyway); any other goes through that loader (~13 s). The `[target] converting` line says which ran.
    A damaged file (cut off, impossible sizes) is a TargetError before anything is written; the write goes to a
    temporary directory renamed into place, so an interrupted conversion never leaves a directory that looks complete.
    """
    gguf = asset_path("smollm2_gguf") if spec == DEFAULT_TARGET else Path(spec)
    if not gguf.exists():
        raise FileNotFoundError(f"target '{spec}' not found: pass an HF model directory, a .gguf file, or 'smollm2'")
    if gguf.is_dir():
        check_config(gguf)
        check_weights(gguf)
        return gguf
    if gguf.suffix != ".gguf":
        raise TargetError(f"target file {gguf} is not a .gguf file; pass a Hugging Face model directory instead")
    check_gguf(gguf)
    out = CACHE_DIR / "targets" / f"{gguf.stem}-{gguf.stat().st_size}"
    if (out / "config.json").exists():
        return out
    try:
        parsed = read_gguf(gguf)
    except GGUFFormatError as e:
        raise TargetError(f"cannot convert {gguf} ({e})") from None
    except OSError as e:
        raise TargetError(f"target file {gguf} cannot be read ({type(e).__name__}: {e})") from None
    why_not = unsupported(parsed)
    how = (
        "nanospec's GGUF reader, ~5 s"
        if why_not is None
        else f"transformers' GGUF loader, ~13 s: nanospec's reader does not take {why_not}"
    )
    print(f"[target] converting {gguf.name} to safetensors in {out} (one time, {how})", flush=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if why_not is None:
            convert_gguf(parsed, tmp)
        else:
            convert_with_transformers(gguf, tmp)
    except Exception as e:  # an architecture transformers cannot read, tensors of the wrong shape, ...
        shutil.rmtree(tmp, ignore_errors=True)
        raise TargetError(f"cannot convert {gguf} ({type(e).__name__}: {e})") from e
    (tmp / "nanospec_source.json").write_text(json.dumps({"gguf": str(gguf), "converted": time.ctime()}))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert_with_transformers(gguf: Path, out: Path) -> None:
    """A GGUF file through transformers' GGUF loader into the Hugging Face directory `out`: a bf16 model, its
    generation config and its tokenizer (any architecture and tensor type transformers reads)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: transformers (~1.5 s to import)

    kw = {}
    try:  # newer transformers keep GGUF blocks packed unless asked to unpack them
        from transformers import GgufConfig  # optional: only newer transformers have it

        kw["quantization_config"] = GgufConfig(gguf_file=gguf.name, dequantize=True)
    except ImportError:
        pass
    with gguf_parsed_once():  # one parse of the file for the config, the weights and the tokenizer
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = model.to(torch.bfloat16)
    if hasattr(model.config, "quantization_config"):  # the weights are plain tensors now
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer  # lazy: transformers (~1.5 s to import)

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, json.JSONDecodeError) as e:  # missing or damaged tokenizer files
        raise TargetError(f"cannot load the tokenizer of {path} ({type(e).__name__}: {e})") from None


@dataclass
class Features:
    aux_hidden: torch.Tensor  # [B, T, n_aux * H_t]: concatenated outputs of aux_layers
    final_hidden: torch.Tensor  # [B, T, H_t]: after the final norm


class Target(nn.Module):
    """A frozen HF causal LM that returns only what the draft step needs."""

    def __init__(self, model, aux_layers: list[int] | None = None, path: Path | None = None):
        super().__init__()
        self.path, self.model, self.config = path, model.eval().requires_grad_(False), model.config
        L = self.config.num_hidden_layers
        self.aux_layers = list(aux_layers) if aux_layers else default_aux_layers(L)
        if any(not 0 <= i < L for i in self.aux_layers):
            raise AuxLayersError(
                f"aux_layers {self.aux_layers} out of range for a {L}-layer target (--aux-layers takes 0..{L - 1})"
            )
        self._captured: dict[int, torch.Tensor] = {}
        for i in set(self.aux_layers):
            self.model.model.layers[i].register_forward_hook(self._hook(i))

    @classmethod
    def load(cls, spec: str | Path, aux_layers=None, dtype=torch.float32, device="cpu") -> "Target":
        from transformers import AutoModelForCausalLM  # lazy: transformers (~1.5 s to import)

        path = resolve_target(str(spec))
        refuse_drawn_at_load(path, "the hf backend (transformers)")
        model = _from_pretrained(AutoModelForCausalLM, path, dtype=dtype).to(device)
        return cls(model, aux_layers, path)

    def _hook(self, i):
        def save(_module, _inputs, output):
            self._captured[i] = output[0] if isinstance(output, tuple) else output

        return save

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> Features:
        """input_ids [B, T]; attention_mask [B, T] (right padding) or, for packed rows
        (data/packing.py), doc_ids [B, T] (document label per token, -1 = padding) and
        position_ids [B, T] (restarting per document): each document then sees only itself."""
        self._captured.clear()
        if doc_ids is not None:
            mask = packed_attention_mask(doc_ids, self.model.dtype, self.model.config._attn_implementation)
            out = self.model.model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
        else:
            # right padding only: pass no mask when nothing is padded so SDPA takes its causal path
            if attention_mask is not None and bool(attention_mask.all()):
                attention_mask = None
            out = self.model.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        aux = torch.cat([self._captured[i] for i in self.aux_layers], dim=-1)
        self._captured.clear()
        return Features(aux_hidden=aux, final_hidden=out.last_hidden_state)


PACKABLE_ATTENTION = ("sdpa", "eager")  # transformers implementations that add a 4D float mask as given


def packed_attention_mask(doc_ids: torch.Tensor, dtype, attn_implementation: str) -> torch.Tensor:
    """[B, 1, T, T] additive mask (0 = attend, dtype's min = not) for packed rows: causal within
    a document. transformers (5.x) passes a 4D mask to the attention unchanged (masking_utils:
    "If the mask is already 4D, simply return as-is"), and sdpa and eager both add a float mask
    to the scores; padding (-1) is one more document, so no row is empty. Other implementations
    (flash_attention_2, flex) take masks in other forms: refused, not silently mixed."""
    if attn_implementation not in PACKABLE_ATTENTION:
        raise ValueError(
            f"packed rows need the target's attention to be one of {PACKABLE_ATTENTION} (a 4D mask), "
            f"this target uses {attn_implementation!r}: pass --no-pack, or load it with sdpa"
        )
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    allowed = causal & (doc_ids[:, :, None] == doc_ids[:, None, :])
    return torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min
    )[:, None]


DRAWN_AT_LOAD = "drawn at load"  # config.json's nanospec_random.weights of `tools/random_target.py --no-weights`
HEADS_FILE = "model.safetensors"  # beside DRAWN_AT_LOAD (--no-weights --heads): the embeddings, final norm and lm_head


def seed_drawn_at_load(path: Path) -> int | None:
    """The seed of a random target whose weights are drawn when it loads (a directory without weight files:
    tools/random_target.py --no-weights), or None for a target with weights."""
    try:
        random = json.loads((Path(path) / "config.json").read_text()).get("nanospec_random") or {}
    except (OSError, ValueError):
        return None
    return int(random.get("seed", 0)) if random.get("weights") == DRAWN_AT_LOAD else None


def refuse_drawn_at_load(path: Path, who: str, heads_will_do: bool = False):
    """A TargetError for loaders that read weight files (transformers, the heads of stored features); with
    heads_will_do (a loader of the heads alone) none where HEADS_FILE holds them (tools/random_target.py --heads)."""
    if heads_will_do and (Path(path) / HEADS_FILE).exists():
        return
    if seed_drawn_at_load(path) is not None:
        raise TargetError(
            f"{path} has no weight files (tools/random_target.py --no-weights: the compiled backend draws them when "
            f"it loads): {who} reads weight files; pass --backend compiled, or write the target with its weights"
        )


def fingerprint(path: Path) -> str:
    """Identity of a target directory: config.json plus the size and the first and last MiB of
    every weight file (cheap; tells apart fine-tunes of one architecture)."""
    path = Path(path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _from_pretrained(auto, path: Path, **kw):
    """auto.from_pretrained(path), with the usual failures of a damaged or incomplete target
    directory (no weight files, a config transformers rejects) as a TargetError naming it."""
    try:
        return auto.from_pretrained(path, **kw)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise TargetError(f"cannot load the target {path} ({type(e).__name__}: {e})") from None


class TargetHeads(nn.Module):
    """The frozen pieces of a target that training from stored features needs: the input
    embeddings and the lm_head (stored final hidden states are already normed), and where asked
    the final norm (features from an engine that returns the pre-norm output). No forward."""

    def __init__(self, config, embed_tokens: nn.Module, lm_head: nn.Module, aux_layers, path: Path, norm=None):
        super().__init__()
        self.config, self.path, self.aux_layers = config, path, list(aux_layers)
        self.embed_tokens, self.lm_head = embed_tokens.requires_grad_(False), lm_head.requires_grad_(False)
        self.norm = norm.requires_grad_(False) if norm is not None else None


def load_heads(spec, aux_layers, dtype=torch.float32, device="cpu", norm: bool = False) -> TargetHeads:
    """Embeddings and lm_head (and with norm=True the final norm) of a target without its decoder
    layers: the model is built on the meta device (to learn the modules and their checkpoint
    names), then only those tensors are read from the safetensors files. Falls back to loading
    the whole model when the checkpoint names differ from the module names or the modules hold
    buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers (~1.5 s to import)

    path = resolve_target(str(spec))
    refuse_drawn_at_load(path, "training from stored features (its embeddings and lm_head)", heads_will_do=True)
    config = _from_pretrained(AutoConfig, path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    wanted = [model.get_input_embeddings(), model.get_output_embeddings()]
    if norm:
        wanted.append(model.get_decoder().norm)  # Llama / Qwen / Mistral ...: the norm after the last layer
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    index = path / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.exists() else None

    def read(param):
        for n in names[id(param)]:
            f = (path / files[n]) if files is not None and n in files else path / "model.safetensors"
            if f.exists():
                with safe_open(str(f), "pt") as st:
                    if n in st.keys():
                        return st.get_tensor(n)
        return None

    tensors = [read(m.weight) for m in wanted]
    extra = [x for m in wanted for x in (*m.buffers(), getattr(m, "bias", None)) if x is not None]
    if any(t is None for t in tensors) or extra:
        full = _from_pretrained(AutoModelForCausalLM, path, dtype=dtype).to(device)
        mods = [full.get_input_embeddings(), full.get_output_embeddings()]
        mods += [full.get_decoder().norm] if norm else []
        return TargetHeads(config, *mods[:2], aux_layers, path, norm=mods[2] if norm else None)
    mods = []
    for m, t in zip(wanted, tensors):
        m = m.to_empty(device=device)
        with torch.no_grad():
            m.weight.copy_(t)
        mods.append(m)
    return TargetHeads(config, mods[0], mods[1], aux_layers, path, norm=mods[2] if norm else None)
