"""Training checkpoint -> serving directory (EAGLE-3 / EAGLE-3.1 for vLLM or SGLang; P-EAGLE,
DFlash and DSpark for vLLM, in its own format or in speculators'), and drafts made elsewhere ->
training checkpoint.

    python export.py runs/default [--out DIR] [--engine vllm|sglang|speculators] [--dtype bf16|fp32] [--with-embeddings]
    python export.py SRC --import-from auto|speculators|safeailab|specforge --out RUN [--target DIR]

The input is a checkpoint dir (<run>/ckpt/step_N), a run dir (its ckpt/latest is taken) or a
run's ckpt/ dir. The output dir holds config.json + model.safetensors in the format both
engines' `LlamaForCausalLMEagle3` loaders read (DESIGN.md, "Serving formats"):

  fc.weight [H, 3*H_t]   midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
  midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]   midlayer.self_attn.o_proj.weight [H, Hq*D]
  midlayer.mlp.{gate,up,down}_proj.weight   norm.weight [H]   lm_head.weight [Vd, H]
  d2t int64 [Vd] (target_id = draft_id + d2t[draft_id])   t2d bool [V]
  embed_tokens.weight [V, H] only with --with-embeddings (the engines otherwise share the target's)

P-EAGLE (vLLM 0.32 llama_eagle3.py + llm_base_proposer.py, speculative_config parallel_drafting):
the EAGLE-3 dir plus `mask_hidden` [n_aux*H_t] (vLLM feeds fc(mask_hidden) to the parallel slots)
and config `mask_token_id` (the token those slots are fed).

DFlash (vLLM 0.32 models/qwen3_dflash.py): config.json
with architectures ["DFlashDraftModel"], model_type qwen3, Qwen3 layer
fields, num_hidden_layers, block_size, dflash_config {mask_token_id, target_layer_ids,
use_aux_hidden_state}; model.safetensors with fc.weight, hidden_norm.weight,
layers.{i}.{input_layernorm,post_attention_layernorm}.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight, norm.weight. No lm_head / embed_tokens: the drafts use the target's
frozen ones and vLLM shares them when the checkpoint has none. dflash_config.target_layer_ids
are our layer-output indices: vLLM adds 1 (get_eagle3_aux_layers_from_config) to get its capture
ids, which are HF hidden_states indices (see below), so no conversion is written here.

DSpark (vLLM 0.32 models/qwen3_dspark.py, architecture Qwen3DSparkModel): the DFlash tensors
and config plus markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [V, r],
confidence_head.proj.{weight [1, H + r], bias [1]}; config markov_rank, draft_vocab_size (= V:
no lm_head / d2t written, vLLM shares the target's head), enable_confidence_head,
confidence_head_with_markov, sample_from_anchor=true (blocks of block_size = K slots, the anchor
slot predicts; served with method "dspark", num_speculative_tokens = block_size).
Domino: no engine loader in reach (vLLM 0.32 has none), so it is not exported.

speculators (vLLM's own trainer, 0.9.0; `--engine speculators`): the same tensors (EAGLE layouts
name midlayer.* layers.0.*) under the config.json `vllm serve DIR` loads with no speculative config
(vLLM 0.32 transformers_utils/configs/speculators/: a config with speculators_config and no model_type
is read by its SpeculatorsConfig): speculators_model_type, transformer_layer_config (the layer
fields), the family's fields (speculators_config() lists them), and speculators_config {algorithm,
proposal_methods [{proposal_type greedy, speculative_tokens K}], verifier {name_or_path = the target
dir, architectures}}; vLLM takes the method, K and the target from it. vLLM 0.32 reads eagle3, peagle,
dflash, dflash2 and dspark in that format, so all four of our served families are written (checked:
tests/test_speculators.py runs vLLM's reader on all four and serves the shipped EAGLE-3 draft both
ways on the CPU build: same tokens, same counters; random SmolLM2-shaped P-EAGLE and DFlash drafts
served both ways gave the same tokens and counters too, by hand; the CPU build's V1 runner refuses
dspark in either format, so DSpark is checked by the reader only). Domino has no reader there.
Refused: P-EAGLE with fc_norm / norm_output (vLLM's peagle reader drops them) and EAGLE drafts with
other than 3 aux layers (its eagle3 model sizes fc for 3 when the ids are not under eagle_config).

Import (`--import-from`; import_draft) writes <out>/ckpt/step_0/{draft.safetensors, config.json} +
ckpt/latest, which load_checkpoint, evaluate.py and gate.py read (no train_state.pt: a fresh run
starts from it with train.py --init-draft). Formats: speculators (above), SafeAILab EAGLE-3 (the EAGLE
repo: config.json LlamaForCausalLMEagle3 + pytorch_model.bin or model.safetensors with the tensor
names above, usually no aux ids: the engines' defaults, which need --target for the layer count),
SpecForge EAGLE-3 (the same layout in model.safetensors; explicit eagle_config ids are read as
SGLang's, the engine SpecForge trains for), and our own serving dirs (their provenance names the
engine). `auto` refuses to guess the convention of explicit ids in a foreign LlamaForCausalLMEagle3
dir. embed_tokens.weight is dropped (our drafts share the target's), refused if it differs from the
target's; speculators' verifier_* copies are dropped; variants we do not implement
(norm_before_residual, norm_before_fc, DSpark's gated/rnn heads, DFlash with a draft vocabulary) fail.

This file alone knows the engines' conventions. Aux layer ids, checked in the engines' code:

  ours   `aux_layers` are 0-based decoder-layer indices whose OUTPUTS feed fc: layer i's output
         is HF `output_hidden_states[i + 1]` (models/target.py).
  vLLM   (0.32, vllm/model_executor/models/llama.py) `LlamaModel.forward` loops
         `for idx, layer in enumerate(layers): if idx in self.aux_hidden_state_layers:
         aux_hidden_states.append(hidden_states + residual)` BEFORE running layer idx, i.e. it
         captures the INPUT of layer idx = output of layer idx-1 = HF hidden_states[idx].
         The ids come unchanged from the draft config's `eagle_aux_hidden_state_layer_ids`
         (read by the model runner, vllm/v1/worker/*model_runner*.py, and handed to
         `set_aux_hidden_state_layers`); the default when absent is (2, L//2, L-3)
         (`get_eagle3_aux_hidden_state_layers`). So vLLM id k == HF hidden_states[k] and
         vllm_id = our_index + 1.
  SGLang (0.5.x, python/sglang/srt/models/llama.py) `set_eagle3_layers_to_capture(layer_ids)`
         stores `[val + 1 for val in layer_ids]` and its forward appends `hidden_states +
         residual` before running layer i when i is in that list (again the input of layer i);
         default [2, L//2, L-3]. So SGLang id k == output of layer k == HF hidden_states[k+1]
         and sglang_id = our_index.
  Both defaults are the same three tensors: outputs of layers [1, L//2-1, L-4] (our default).
  We always write explicit ids, so a draft trained on non-default layers serves correctly.
  Checked end to end on vLLM 0.32 CPU: its vllm:spec_decode_* counters equal our PyTorch
  evaluator's exactly (gate.py; evaluate.py --vllm, experiments/results/acceptance_cpu.md).
  vLLM's loader skips t2d, renames d2t to draft_id_to_target_id and leaves that table at zero
  (silently wrong drafts) when d2t is missing: hence the loud checks here.
"""

import errno
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import tyro

from models.eagle3 import Eagle3Config, Eagle3Draft
from models.families import FAMILIES, family_of
from models.families import load_draft as load_family_draft
from models.peagle import PEagleConfig
from runlog import RUN_FILES, clear_previous_run, previous_run, write_checkpoint

ENGINES = ("vllm", "sglang", "speculators")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")


class ExportError(RuntimeError):
    """A checkpoint or serving dir that is missing, incomplete or misshaped."""


# ---- index conventions (the only place that knows them) ----
def engine_aux_ids(aux_layers: list[int], engine: str) -> list[int]:
    """Our 0-based layer-output indices -> the engine's eagle_aux_hidden_state_layer_ids."""
    if engine in ("vllm", "speculators"):  # speculators' ids are the ones vLLM reads (algos.py passes them on)
        return [i + 1 for i in aux_layers]  # vLLM id k = input of layer k = HF hidden_states[k]
    if engine == "sglang":
        return list(aux_layers)  # SGLang adds +1 itself
    raise ValueError(f"unknown engine {engine!r}: choose one of {ENGINES}")


def default_ids(num_layers: int) -> list[int]:
    """vLLM's ids when a draft config names none (get_eagle3_aux_hidden_state_layers: 2, L//2, L-3), which
    are also the EAGLE repo's capture layers (the input of those layers)."""
    from models.target import default_aux_layers

    return engine_aux_ids(default_aux_layers(num_layers), "vllm")


def aux_layers_from_engine(ids: list[int], engine: str) -> list[int]:
    return [i - 1 for i in ids] if engine in ("vllm", "speculators") else engine_aux_ids(ids, engine)


# ---- training checkpoints ----
def read_tensors(f: Path) -> dict[str, torch.Tensor]:
    """A safetensors file, or an ExportError naming it (truncated, corrupted, missing) and the intact-looking
    checkpoints beside it."""
    from safetensors.torch import load_file

    try:
        return load_file(f)
    except Exception as e:  # SafetensorError (bad header, short buffer), OSError, ...
        why = str(e).splitlines()[0][:200] if str(e) else ""
        others = sorted(
            (
                d.name
                for d in f.parent.parent.glob("step_*")
                if d != f.parent and (d / f.name).exists() and d.name[5:].isdigit()
            ),
            key=lambda n: -int(n[5:]),
        )
        hint = (
            f"; other checkpoints beside it: {', '.join(others)} (pass one's directory)"
            if others and f.parent.name.startswith("step_")
            else ""
        )
        raise ExportError(
            f"{f} is damaged or unreadable ({type(e).__name__}{': ' + why if why else ''}){hint}"
        ) from None


def read_json(f: Path) -> dict:
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{f} is damaged or unreadable ({type(e).__name__}: {e})") from None


def find_checkpoint(path: str | Path) -> Path:
    """ckpt/step_N, a run dir (-> ckpt/latest) or a ckpt/ dir (-> latest)."""
    p = Path(path)
    if (p / "draft.safetensors").exists():
        return p
    for ckpt_dir in (p / "ckpt", p):
        latest = ckpt_dir / "latest"
        if latest.exists():
            d = ckpt_dir / latest.read_text().strip()
            if not (d / "draft.safetensors").exists():
                raise ExportError(f"{latest} points to {d}, which has no draft.safetensors")
            return d
    raise ExportError(f"{p}: not a training checkpoint (no draft.safetensors, no ckpt/latest)")


def expected_shapes(c: Eagle3Config) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """Every tensor of the serving format: name -> (shape, dtype or None for 'any float')."""
    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    shapes = {
        "fc.weight": ((H, len(c.aux_layers) * c.target_hidden_size), None),
        "midlayer.input_layernorm.weight": ((H,), None),
        "midlayer.hidden_norm.weight": ((H,), None),
        "midlayer.post_attention_layernorm.weight": ((H,), None),
        "midlayer.self_attn.q_proj.weight": ((q, 2 * H), None),
        "midlayer.self_attn.k_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.v_proj.weight": ((kv, 2 * H), None),
        "midlayer.self_attn.o_proj.weight": ((H, q), None),
        "midlayer.mlp.gate_proj.weight": ((I, H), None),
        "midlayer.mlp.up_proj.weight": ((I, H), None),
        "midlayer.mlp.down_proj.weight": ((H, I), None),
        "norm.weight": ((H,), None),
        "lm_head.weight": ((c.draft_vocab_size, H), None),
        "d2t": ((c.draft_vocab_size,), torch.int64),
        "t2d": ((c.vocab_size,), torch.bool),
    }
    if c.fc_norm:  # EAGLE-3.1
        shapes.update({f"fc_norm.{i}.weight": ((c.target_hidden_size,), None) for i in range(len(c.aux_layers))})
    if isinstance(c, PEagleConfig):  # P-EAGLE: the stand-in aux hidden states of the parallel slots
        shapes["mask_hidden"] = ((len(c.aux_layers) * c.target_hidden_size,), None)
    return shapes


def check_tensors(sd: dict[str, torch.Tensor], c: Eagle3Config, where: str, optional=("embed_tokens.weight",)):
    """Fail loudly on missing, unexpected, misshaped or non-finite tensors and on a d2t/t2d
    pair that does not describe the same draft vocabulary."""
    want = expected_shapes(c)
    missing = sorted(set(want) - set(sd))
    extra = sorted(set(sd) - set(want) - set(optional))
    if missing or extra:
        raise ExportError(f"{where}: missing tensors {missing}" + (f", unexpected {extra}" if extra else ""))
    for name, (shape, dtype) in want.items():
        t = sd[name]
        if tuple(t.shape) != shape:
            raise ExportError(f"{where}: {name} has shape {tuple(t.shape)}, expected {shape} (from the draft config)")
        if dtype is not None and t.dtype != dtype:
            raise ExportError(f"{where}: {name} has dtype {t.dtype}, expected {dtype}")
        if dtype is None and not (t.is_floating_point() and torch.isfinite(t).all()):
            raise ExportError(f"{where}: {name} is not a finite float tensor")
    ids = torch.arange(c.draft_vocab_size) + sd["d2t"]
    if ids.min() < 0 or ids.max() >= c.vocab_size or len(set(ids.tolist())) != c.draft_vocab_size:
        raise ExportError(f"{where}: d2t does not map the draft vocab to distinct target ids in [0, {c.vocab_size})")
    if int(sd["t2d"].sum()) != c.draft_vocab_size or not bool(sd["t2d"][ids].all()):
        raise ExportError(f"{where}: t2d does not mark exactly the target ids that d2t maps to")
    if "embed_tokens.weight" in sd and tuple(sd["embed_tokens.weight"].shape) != (c.vocab_size, c.hidden_size):
        raise ExportError(
            f"{where}: embed_tokens.weight has shape {tuple(sd['embed_tokens.weight'].shape)}, "
            f"expected {(c.vocab_size, c.hidden_size)}"
        )


def _draft_from(sd: dict, c: Eagle3Config, where: str) -> Eagle3Draft:
    if not c.moe_experts:  # MoE drafts (research only) are not in the serving format; strict load below checks them
        check_tensors(sd, c, where)
    draft = next(f.draft_cls for f in FAMILIES.values() if type(c) is f.config_cls)(c)  # Eagle3Draft or PEagleDraft
    draft.load_state_dict(
        {k: v.float() if v.is_floating_point() else v for k, v in sd.items() if k != "embed_tokens.weight"}, strict=True
    )
    return draft.eval()


def load_checkpoint(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """A training checkpoint -> (fp32 draft of its strategy, its config.json {strategy, draft, target})."""
    d = find_checkpoint(path)
    meta_path = d / "config.json"
    if not meta_path.exists():
        raise ExportError(f"{d}: config.json is missing")
    meta = read_json(meta_path)
    try:
        f = family_of(meta.get("strategy"))
    except ValueError as e:
        raise ExportError(f"{d}: {e}") from None
    meta["checkpoint"] = str(d)
    if f.serving and f.serving.layout == "eagle3":  # the serving format's loud tensor checks first
        try:
            c = f.config_cls(**meta["draft"])
        except (KeyError, TypeError) as e:
            raise ExportError(f"{meta_path}: bad draft config: {e}") from None
        return _draft_from(read_tensors(d / "draft.safetensors"), c, str(d / "draft.safetensors")), meta
    try:
        return load_family_draft(meta, read_tensors(d / "draft.safetensors")), meta
    except (KeyError, TypeError, RuntimeError) as e:
        raise ExportError(f"{d}: cannot load the {meta['strategy']} draft: {e}") from None


# ---- serving dirs ----
def serving_config(c: Eagle3Config, target_config: dict, engine: str, dtype: torch.dtype) -> dict:
    """config.json of the serving dir. Rope fields are copied as the target's config has them
    (the draft's rope must be the target's: positions are shared)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # the midlayer's residual is the un-normed hidden state (vLLM/SGLang default)
        "norm_before_residual": False,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": engine_aux_ids(c.aux_layers, engine),
            "use_aux_hidden_state": True,
        },
        # EAGLE-3.1 (vLLM llama_eagle3.py: `fc_norm` = one RMSNorm per aux chunk before fc, weights
        # fc_norm.{i}.weight; `norm_output` = the hidden state handed to the next draft step is the
        # normed output)
        "fc_norm": bool(c.fc_norm),
        "norm_output": bool(c.norm_output),
        "torch_dtype": HF_DTYPE_NAMES[dtype],
        "dtype": HF_DTYPE_NAMES[dtype],
    }
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in target_config:
            cfg[k] = target_config[k]
    rope = {k: target_config[k] for k in ROPE_FIELDS if target_config.get(k) is not None}
    if not rope:
        rope = {"rope_parameters": c.rope_parameters}
    cfg.update(rope)
    return cfg


def tokenizer_digest(tokenizer) -> str:
    """A short fingerprint of a tokenizer's vocabulary (token -> id): two tokenizers with the same
    vocabulary size but other ids would make a draft propose nonsense without any error."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()[:16]


def target_mismatch(c, tc: dict, tokenizer=None, recorded: dict | None = None) -> list[str]:
    """Why draft config `c` cannot run on the target whose config.json is `tc` ([] = it can):
    hidden size, vocabulary, aux layers, and (when the export recorded one) the tokenizer."""
    tc = tc.get("text_config", tc)
    why = []
    if getattr(c, "target_hidden_size", None) not in (None, tc.get("hidden_size")):
        why.append(
            f"hidden size: the draft reads {c.target_hidden_size}-wide target features, "
            f"the target's are {tc.get('hidden_size')}"
        )
    if c.vocab_size != tc.get("vocab_size"):
        why.append(f"vocabulary: the draft maps to {c.vocab_size} target tokens, the target has {tc.get('vocab_size')}")
    L = tc.get("num_hidden_layers")
    if L is not None and any(not 0 <= i < L for i in getattr(c, "aux_layers", [])):
        why.append(f"aux layers: the draft reads layers {list(c.aux_layers)}, the target has {L} (0..{L - 1})")
    want = (recorded or {}).get("tokenizer")
    if tokenizer is not None and want and tokenizer_digest(tokenizer) != want:
        why.append(
            f"tokenizer: the draft was exported for tokenizer {want}, this target's is {tokenizer_digest(tokenizer)}"
        )
    return why


def _target_config(target_dir: str | Path | None, c: Eagle3Config) -> dict:
    if target_dir and (Path(target_dir) / "config.json").exists():
        tc = json.loads((Path(target_dir) / "config.json").read_text())
        if why := target_mismatch(c, tc):
            raise ExportError(f"target {target_dir} does not match the draft: {'; '.join(why)}")
        return tc.get("text_config", tc)
    return {}


def export(
    ckpt: str | Path,
    out: str | Path,
    engine: str = "vllm",
    dtype: str = "bf16",
    with_embeddings: bool = False,
    target: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the serving dir; returns it. The write goes through a temporary dir renamed into
    place, so a failed export never leaves a dir that looks complete. An existing `out` is replaced
    only if export wrote it, or with overwrite (check_export_out)."""
    check_export_out(out, find_checkpoint(ckpt), overwrite)
    if engine not in ENGINES:
        raise ExportError(f"unknown engine {engine!r}: choose one of {ENGINES}")
    if dtype not in DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}: choose one of {tuple(DTYPES)}")
    draft, meta = load_checkpoint(ckpt)
    c, tdtype = draft.config, DTYPES[dtype]
    if getattr(c, "moe_experts", 0):
        raise ExportError(
            f"{ckpt}: MoE drafts (--moe-experts {c.moe_experts}) cannot be served: vLLM's and SGLang's EAGLE-3 "
            "loaders expect one dense MLP (evaluate.py measures them from the checkpoint)"
        )
    target_dir = target or meta.get("target")
    tc = _target_config(target_dir, c)
    family, serving = meta["strategy"], FAMILIES[meta["strategy"]].serving
    if serving is None:
        raise ExportError(f"strategy {family!r}: no serving engine here loads it (README, 'Draft families')")
    if engine not in serving.engines and not (engine == "speculators" and "vllm" in serving.engines):
        names = {"vllm": "vLLM", "sglang": "SGLang"}
        raise ExportError(
            f"{family}: only the {' and '.join(names[e] for e in serving.engines)} format is written"
            + (" (SGLang has no EAGLE-3 parallel drafting here)" if serving.vllm_extra.get("parallel_drafting") else "")
        )
    prov = {
        "engine": engine,
        "aux_layer_outputs": list(c.aux_layers),
        "target": str(target_dir) if target_dir else None,
        "checkpoint": meta["checkpoint"],
    }
    if tc:  # the tokenizer the draft was trained with, so a target with another one is refused at load
        from data.chat import DataError
        from models.target import load_tokenizer

        try:
            prov["tokenizer"] = tokenizer_digest(load_tokenizer(Path(target_dir)))
        except DataError:  # a target dir without tokenizer files (tests' random targets): nothing to record
            pass
    if serving.layout == "block":
        if with_embeddings:
            raise ExportError(f"{family}: no embeddings are written (vLLM shares the target's)")
        cfg, sd = block_serving(draft, serving.architecture, tc, tdtype)
        if engine == "speculators":
            cfg = speculators_config(cfg, c, family, _verifier(target_dir))
        return _write(out, cfg, sd, {**prov, "strategy": meta["strategy"]})
    sd = {k: (v.to(tdtype) if v.is_floating_point() else v).contiguous() for k, v in draft.state_dict().items()}
    if with_embeddings:
        if c.hidden_size != c.target_hidden_size:
            raise ExportError("--with-embeddings needs the draft's hidden size to equal the target's")
        sd["embed_tokens.weight"] = _target_embeddings(target_dir).to(tdtype).contiguous()
    check_tensors(sd, c, "export")
    cfg = serving_config(c, tc, engine, tdtype)
    if serving.vllm_extra.get("parallel_drafting"):
        # vLLM (llm_base_proposer.py) feeds mask slots the token config.mask_token_id and the hidden
        # state fc(mask_hidden) when speculative_config has parallel_drafting=True
        cfg["mask_token_id"] = c.mask_token_id
        prov["depths"] = c.depths  # K it was trained for (vLLM takes K from num_speculative_tokens)
    if engine == "speculators":
        cfg = speculators_config(cfg, c, family, _verifier(target_dir))
        sd = {k.replace("midlayer.", "layers.0.", 1): v for k, v in sd.items()}
    return _write(out, cfg, sd, prov)


EXPORT_MARKER = ".nanospec-export"  # written into every serving dir: the only kind of existing dir export replaces


def _overlaps(a: Path, b: Path) -> bool:
    """a is b, or one holds the other."""
    return a == b or a in b.parents or b in a.parents


def _written_by_export(d: Path) -> bool:
    """A serving dir export wrote: its marker, or (dirs written before the marker) exactly config.json +
    model.safetensors with our provenance in the config."""
    if (d / EXPORT_MARKER).is_file():
        return True
    if {p.name for p in d.iterdir()} != {"config.json", "model.safetensors"}:
        return False
    try:
        return "nanospec_export" in json.loads((d / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def check_export_out(out: str | Path, ckpt: Path, overwrite: bool = False):
    """--out before anything is read or written. Never the checkpoint being exported, its run's files or a
    directory holding them (refused even with overwrite: replacing --out would delete them); an existing
    directory only if export wrote it (EXPORT_MARKER) or overwrite; never a file."""
    out, ck = Path(out), Path(ckpt).resolve()
    res = out.resolve()
    protected = [ck]
    if ck.parent.name == "ckpt" or (ck.parent / "latest").exists():  # ck is <run>/ckpt/step_N
        run = ck.parent.parent
        protected += [ck.parent, *(run / n for n in RUN_FILES if (run / n).exists())]
    if hit := next((p for p in protected if _overlaps(res, p)), None):
        raise ExportError(
            f"--out {out} would replace {hit}, part of the checkpoint being exported ({ckpt}): choose another --out "
            "(the default is <run>/export-<engine>)"
        )
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite and not _written_by_export(out):
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir())
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ExportError(
            f"--out {out} holds files export did not write ({shown}; no {EXPORT_MARKER}): "
            "choose another --out, or pass --overwrite to replace the whole directory"
        )


def _write(out, cfg: dict, sd: dict, provenance: dict) -> Path:
    """out (checked by check_export_out) written through a temporary dir beside it, then swapped in."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = None
    cfg["nanospec_export"] = {**provenance, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # ignored by the engines
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))  # never a user's name
        (tmp / EXPORT_MARKER).write_text("written by nanospec export.py; export --out replaces this directory\n")
        save_file(sd, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"--out {out}: cannot write the serving dir there ({os_why(e)})") from None
    return out


def os_why(e: OSError) -> str:
    """An OSError in words a user acts on."""
    return {
        errno.EROFS: "it is on a read-only file system",
        errno.EACCES: "no permission to write there",
        errno.EPERM: "no permission to write there",
        errno.ENOSPC: "no space left on the device",
    }.get(e.errno, e.strerror or str(e))


def vllm_method(family: str) -> tuple[str, dict]:
    """vLLM's speculative_config method (+ extra settings) that serves a draft family."""
    serving = FAMILIES[family].serving if family in FAMILIES else None
    if serving is None or "vllm" not in serving.engines:
        raise ExportError(f"vLLM has no loader for {family!r} drafts")
    return serving.vllm_method, dict(serving.vllm_extra)


# ---- block drafters (DFlash family) ----
# vLLM architecture -> family, for the families written in the block layout
BLOCK_FAMILIES = {
    f.serving.architecture: name for name, f in FAMILIES.items() if f.serving and f.serving.layout == "block"
}


def block_serving(draft, architecture: str, target_config: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    """(config.json, tensors) of a DFlash / DSpark serving dir for vLLM."""
    c, family = draft.config, draft.family
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in draft.state_dict().items()}
    cfg = {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
        "block_size": c.block_size,
        # target_layer_ids: our layer-output indices (vLLM adds 1, see the module doc); causal: the
        # block attends to itself both ways (qwen3_dflash.py _dflash_layer_causal)
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.aux_layers),
            "use_aux_hidden_state": True,
            "causal": False,
        },
        "torch_dtype": HF_DTYPE_NAMES[dtype],
        "dtype": HF_DTYPE_NAMES[dtype],
    }
    if architecture == "Qwen3DSparkModel":
        # qwen3_dspark.py: markov_head.markov_w{1,2} [V, r], confidence_head.proj [1, H (+ r)] + bias
        # (loaded only with enable_confidence_head); DSparkSpeculator: sample_from_anchor = blocks
        # of K slots whose anchor predicts (vLLM then takes K = num_speculative_tokens = block_size)
        cfg.update(
            markov_rank=c.markov_rank,
            draft_vocab_size=c.vocab_size,
            enable_confidence_head=True,
            confidence_head_with_markov=c.confidence_with_markov,
            sample_from_anchor=True,
        )
    rope = {k: target_config[k] for k in ROPE_FIELDS if target_config.get(k) is not None}
    cfg.update(rope or {"rope_parameters": c.rope_parameters})
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in target_config:
            cfg[k] = target_config[k]
    # a fresh draft of the config, on the CPU: under torch.device("meta") transformers' llama3 rope
    # init fails (it copies inv_freq to the CPU), so Llama-3.1 targets could not be exported
    want = {k: tuple(v.shape) for k, v in type(draft)(c).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in sd.items()}
    if want != got or not all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point()):
        raise ExportError(
            f"{family}: tensors differ from the draft config's (missing {sorted(set(want) - set(got))}, "
            f"unexpected {sorted(set(got) - set(want))}) or are not finite"
        )
    return cfg, sd


def block_config_from_serving(cfg: dict):
    """A DFlash / DSpark serving config.json -> (strategy name, its draft config)."""
    arch = (cfg.get("architectures") or [None])[0]
    family = BLOCK_FAMILIES.get(arch) if len(cfg.get("architectures") or []) == 1 else None
    if family is None:
        raise ExportError(f"architectures {cfg.get('architectures')} is not a DFlash or DSpark draft")
    d = cfg.get("dflash_config", {})
    rope = cfg.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": cfg["rope_theta"],
        **(cfg.get("rope_scaling") or {}),
    }
    kw = dict(
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_parameters=dict(rope),
        max_position_embeddings=cfg["max_position_embeddings"],
        vocab_size=cfg["vocab_size"],
        target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
        aux_layers=list(d["target_layer_ids"]),
        num_layers=cfg["num_hidden_layers"],
        block_size=cfg["block_size"],
        mask_token_id=d["mask_token_id"],
        hidden_act=cfg.get("hidden_act", "silu"),
    )
    if arch == "Qwen3DSparkModel":
        if (
            not cfg.get("sample_from_anchor", True)
            or cfg.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]
            or not cfg.get("enable_confidence_head")
        ):
            raise ExportError(
                "dspark: only anchor-sampling, full-vocabulary drafts with a confidence head are read here"
            )
        kw.update(
            markov_rank=cfg["markov_rank"], confidence_with_markov=bool(cfg.get("confidence_head_with_markov", False))
        )
    return family, FAMILIES[family].config_cls(**kw)


def _target_embeddings(target_dir) -> torch.Tensor:
    from safetensors import safe_open

    if not target_dir:
        raise ExportError("--with-embeddings needs the target dir (the checkpoint names none; pass --target)")
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for name in (
                "model.embed_tokens.weight",
                "embed_tokens.weight",
                "model.language_model.embed_tokens.weight",
            ):
                if name in st.keys():
                    return st.get_tensor(name)
    raise ExportError(f"no embed_tokens weight found in {target_dir}/*.safetensors")


def config_from_serving(cfg: dict, engine: str | None = None) -> Eagle3Config:
    """An exported config.json -> Eagle3Config. The engine (which fixes how the aux ids read)
    comes from the provenance block, else must be given."""
    prov = cfg.get("nanospec_export", {})
    engine = engine or prov.get("engine")
    if engine not in ENGINES:
        raise ExportError("serving config names no engine: pass engine='vllm' or 'sglang' to read its aux layer ids")
    try:
        ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        rope = cfg.get("rope_parameters") or {
            "rope_type": "default",
            "rope_theta": cfg["rope_theta"],
            **(cfg.get("rope_scaling") or {}),
        }
        c = Eagle3Config(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_parameters=dict(rope),
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg["draft_vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            aux_layers=aux_layers_from_engine(ids, engine),
            hidden_act=cfg.get("hidden_act", "silu"),
            fc_norm=bool(cfg.get("fc_norm", False)),
            norm_output=bool(cfg.get("norm_output", False)),
        )
    except KeyError as e:
        raise ExportError(f"serving config lacks field {e}") from None
    if prov.get("aux_layer_outputs") is not None and prov["aux_layer_outputs"] != c.aux_layers:
        raise ExportError(
            f"aux ids {ids} ({engine}) disagree with the recorded layer outputs {prov['aux_layer_outputs']}"
        )
    if "mask_token_id" in cfg:  # P-EAGLE (parallel drafting)
        from dataclasses import asdict

        c = PEagleConfig(**asdict(c), mask_token_id=int(cfg["mask_token_id"]), depths=int(prov.get("depths", 4)))
    return c


def load_exported(path: str | Path, engine: str | None = None) -> tuple[torch.nn.Module, dict]:
    """A serving dir -> (fp32 draft, its config.json)."""
    p = Path(path)
    if not (p / "config.json").exists() or not (p / "model.safetensors").exists():
        raise ExportError(f"{p}: not a serving dir (needs config.json and model.safetensors)")
    cfg = read_json(p / "config.json")
    if "speculators_config" in cfg:
        return read_draft(p, "speculators")[0], cfg
    if cfg.get("architectures") in [[a] for a in BLOCK_FAMILIES]:
        family, c = block_config_from_serving(cfg)
        draft = FAMILIES[family].draft_cls(c)
        try:
            draft.load_state_dict({k: v.float() for k, v in read_tensors(p / "model.safetensors").items()}, strict=True)
        except RuntimeError as e:
            raise ExportError(f"{p}: {e}") from None
        return draft.eval(), cfg
    if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
        raise ExportError(f"{p}: architectures {cfg.get('architectures')} is not an EAGLE-3 draft")
    return _draft_from(
        read_tensors(p / "model.safetensors"), config_from_serving(cfg, engine), str(p / "model.safetensors")
    ), cfg


def open_draft(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """Any draft dir (training checkpoint, run dir or serving dir) -> (fp32 draft, what was
    recorded with it: "target" dir (or None), and for exports "tokenizer", see target_mismatch)."""
    p = Path(path)
    if (p / "model.safetensors").exists():
        draft, cfg = load_exported(p)
        return draft, cfg.get("nanospec_export", {})
    draft, meta = load_checkpoint(p)
    return draft, meta


def resolve_dir(target) -> Path:
    from models.target import TargetError, resolve_target

    try:
        return resolve_target(str(target))
    except (FileNotFoundError, TargetError) as e:
        raise ExportError(f"target {target}: {e}") from None


# ---- the speculators format (vLLM's own trainer; vLLM 0.32 loads it natively) ----
# family -> (speculators_model_type, the architecture speculators 0.9.0 writes). vLLM 0.32
# (transformers_utils/configs/speculators/algos.py) registers eagle3, peagle, dflash, dflash2 and
# dspark; Domino has no entry there (nor any vLLM loader).
SPECULATORS = {
    "eagle3": ("eagle3", "Eagle3Speculator"),
    "peagle": ("peagle", "PEagleSpeculator"),
    "dflash": ("dflash", "DFlashSpeculator"),
    "dspark": ("dspark", "DSparkSpeculator"),
}
# the decoder-layer fields that go into transformer_layer_config (the base of the config vLLM builds)
LAYER_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    *ROPE_FIELDS,
    "torch_dtype",
    "dtype",
)


def speculative_tokens(c, family: str) -> int:
    """K written as the greedy proposal's speculative_tokens (vLLM's default num_speculative_tokens): the
    depths P-EAGLE was trained for, a DFlash block's masked slots, a DSpark block; 3 for EAGLE-3."""
    if family == "peagle":
        return c.depths
    return c.block_size - (family == "dflash") if family in ("dflash", "dspark") else 3


def _verifier(target_dir) -> dict:
    """speculators_config.verifier: `vllm serve DRAFT` serves the draft on this target (its name_or_path)."""
    if not target_dir:
        raise ExportError("the speculators format names its target (verifier): pass --target")
    d = resolve_dir(target_dir).resolve()
    return {"name_or_path": str(d), "architectures": read_json(d / "config.json").get("architectures") or []}


def speculators_config(cfg: dict, c, family: str, verifier: dict) -> dict:
    """Our vLLM-format config.json -> the speculators one (same tensors; EAGLE layouts rename midlayer. to
    layers.0.). What vLLM 0.32's algos.py reads back: transformer_layer_config is the base of the draft's
    config; eagle3/peagle take draft_vocab_size, target_hidden_size, norm_before_residual (default TRUE for
    eagle3 there, hence written), norm_before_fc, fc_norm, norm_output (eagle3 only: peagle drops them),
    eagle_aux_hidden_state_layer_ids, mask_token_id (peagle, as pard_token); dflash/dspark take
    aux_hidden_state_layer_ids (vLLM ids; target_layer_ids = id - 1 = ours), mask_token_id, block_size,
    sample_from_anchor, sliding_window_non_causal (dflash_config.causal = not it), and for dspark the
    Markov / confidence fields. The method and K come from speculators_config (peagle -> eagle3 with
    parallel_drafting)."""
    name, arch = SPECULATORS[family]
    if family in ("eagle3", "peagle"):
        if len(c.aux_layers) != 3:  # llama_eagle3.py sizes fc from eagle_config (absent here): 3 sources
            raise ExportError(
                f"{family}: vLLM 0.32 reads speculators EAGLE-3 drafts with 3 aux layers, not {len(c.aux_layers)}"
            )
        if family == "peagle" and (c.fc_norm or c.norm_output):
            raise ExportError(
                "peagle: vLLM 0.32's speculators reader drops fc_norm / norm_output (EAGLE-3.1): use --engine vllm"
            )
    spec = {
        "architectures": [arch],
        "speculators_model_type": name,
        "transformer_layer_config": {k: cfg[k] for k in LAYER_FIELDS if k in cfg},
        "speculators_config": {
            "algorithm": name,
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens(c, family),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": verifier,
        },
        "draft_vocab_size": cfg.get("draft_vocab_size", c.vocab_size),
        "target_hidden_size": c.target_hidden_size,
    }
    ids = engine_aux_ids(c.aux_layers, "speculators")
    if family in ("eagle3", "peagle"):
        spec.update(
            eagle_aux_hidden_state_layer_ids=ids,
            norm_before_residual=False,
            norm_before_fc=False,
            fc_norm=bool(c.fc_norm),
            norm_output=bool(c.norm_output),
        )
        if family == "peagle":
            spec["mask_token_id"] = c.mask_token_id
    else:
        spec.update(
            aux_hidden_state_layer_ids=ids,
            mask_token_id=c.mask_token_id,
            block_size=c.block_size,
            sample_from_anchor=family == "dspark",  # dflash: the anchor is the bonus token; dspark: it predicts
            sliding_window_non_causal=True,  # the block attends to itself both ways
        )
        if family == "dspark":
            spec.update(
                markov_rank=c.markov_rank,
                markov_head_type="vanilla",
                enable_confidence_head=True,
                confidence_head_with_markov=bool(c.confidence_with_markov),
            )
    return spec


def config_from_speculators(spec: dict, num_layers: int | None, where: str):
    """A speculators config.json -> (family, our draft config). `num_layers` (the target's) gives vLLM's
    default aux ids (2, L//2, L-3) when the config names none."""
    name = spec.get("speculators_model_type")
    family = next((f for f, (n, _) in SPECULATORS.items() if n == name), None)
    if family is None:
        raise ExportError(
            f"{where}: speculators_model_type {name!r} is not read here (known: {', '.join(SPECULATORS)})"
        )
    try:
        cfg = dict(spec["transformer_layer_config"])
        k = spec["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
        key = "eagle_aux_hidden_state_layer_ids" if family in ("eagle3", "peagle") else "aux_hidden_state_layer_ids"
        ids = spec.get(key)
        if not ids:
            if num_layers is None:
                raise ExportError(f"{where}: no {key}; pass --target so vLLM's default layers can be derived")
            ids = default_ids(num_layers)
        cfg.update(target_hidden_size=spec.get("target_hidden_size") or cfg["hidden_size"])
        if family in ("eagle3", "peagle"):
            # vLLM's defaults when absent: norm_before_residual True for eagle3, False for peagle
            unread = [
                f
                for f, dflt in (("norm_before_residual", family == "eagle3"), ("norm_before_fc", False))
                if spec.get(f, dflt)
            ]
            if unread:
                raise ExportError(f"{where}: {', '.join(unread)} is set: our EAGLE-3 layer has no such variant")
            cfg.update(
                draft_vocab_size=spec["draft_vocab_size"],
                eagle_config={"eagle_aux_hidden_state_layer_ids": list(ids)},
                fc_norm=bool(spec.get("fc_norm", False)),
                norm_output=bool(spec.get("norm_output", False)),
                nanospec_export={"engine": "speculators", "depths": k},
            )
            if family == "peagle":
                cfg["mask_token_id"] = spec["mask_token_id"]
            return family, config_from_serving(cfg)
        anchor = spec.get("sample_from_anchor", family == "dspark")
        if anchor != (family == "dspark") or spec.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]:
            raise ExportError(
                f"{where}: {family} with sample_from_anchor={anchor}, draft_vocab_size={spec.get('draft_vocab_size')}: "
                f"our {family} drafts {'predict from' if family == 'dspark' else 'do not predict from'} the anchor "
                "and use the full target vocabulary"
            )
        if family == "dspark" and spec.get("markov_head_type", "vanilla") != "vanilla":
            raise ExportError(f"{where}: markov_head_type {spec['markov_head_type']!r}: only 'vanilla' is ours")
        cfg.update(
            architectures=[FAMILIES[family].serving.architecture],
            block_size=spec["block_size"],
            dflash_config={
                "mask_token_id": spec["mask_token_id"],
                "target_layer_ids": aux_layers_from_engine(ids, "speculators"),
            },
            markov_rank=spec.get("markov_rank"),
            enable_confidence_head=spec.get("enable_confidence_head", True),
            confidence_head_with_markov=spec.get("confidence_head_with_markov", True),
            sample_from_anchor=anchor,
        )
        return block_config_from_serving(cfg)
    except (KeyError, IndexError, TypeError) as e:
        raise ExportError(f"{where}: not a speculators config (lacks {e})") from None


# ---- import: a draft made elsewhere -> our training checkpoint ----
IMPORT_FORMATS = ("auto", "speculators", "safeailab", "specforge")


def read_weights(d: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """model.safetensors or pytorch_model.bin (the EAGLE repo's) of a draft dir, and the file read."""
    if (d / "model.safetensors").exists():
        return read_tensors(d / "model.safetensors"), d / "model.safetensors"
    f = d / "pytorch_model.bin"
    if f.exists():
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ExportError(f"{f} is damaged or unreadable ({type(e).__name__}: {str(e)[:200]})") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise ExportError(f"{f} is not a state dict of tensors")
        return sd, f
    if any(d.glob("*.index.json")):
        raise ExportError(f"{d}: sharded weights are not read here (merge them into one model.safetensors)")
    raise ExportError(f"{d}: no model.safetensors or pytorch_model.bin")


def _target_layers(target) -> int | None:
    """The target's layer count, or None where it is not at hand (e.g. a hub name in a speculators config)."""
    try:
        tc = read_json(resolve_dir(target) / "config.json") if target else {}
    except ExportError:
        return None
    return tc.get("text_config", tc).get("num_hidden_layers")


def import_draft(
    src: str | Path, out: str | Path, fmt: str = "auto", target: str | None = None, overwrite: bool = False
) -> Path:
    """A speculators, SafeAILab EAGLE-3, SpecForge EAGLE-3 or nanospec serving dir -> a training checkpoint
    out/ckpt/step_0/{draft.safetensors, config.json} + out/ckpt/latest (what load_checkpoint, evaluate.py
    and gate.py read); returns the step dir. Tensors keep their values (fp32 in, fp32 out: bit for bit).
    An `out` holding a run (a trained one's ckpt/latest would silently name the import) is refused unless
    overwrite, which deletes that run's files first, as train.py --overwrite does."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory")
    if old := previous_run(out):
        src_r = Path(src).resolve()
        if hit := next(
            (out / n for n in RUN_FILES if (out / n).exists() and _overlaps(src_r, (out / n).resolve())), None
        ):
            raise ExportError(f"--out {out}: the draft to import ({src}) is in its {hit.name}: choose another --out")
        if not overwrite:
            raise ExportError(
                f"--out {out} holds a run ({', '.join(old)}): choose another --out, or pass --overwrite to replace it "
                "(its checkpoints and metrics are deleted)"
            )
    draft, found = read_draft(src, fmt, target)
    meta = {
        "strategy": draft.family,
        "draft": draft.config.to_dict(),
        "target": found["target"],
        "imported_from": {"format": found["format"], "path": str(Path(src).resolve())},
    }
    try:
        clear_previous_run(out)
        return write_checkpoint(out / "ckpt", "step_0", draft.state_dict(), meta)  # no train_state.pt
    except OSError as e:
        raise ExportError(f"--out {out}: cannot write the checkpoint there ({os_why(e)})") from None


def read_draft(src: str | Path, fmt: str = "auto", target: str | None = None) -> tuple[torch.nn.Module, dict]:
    """A draft dir in any format read here -> (fp32 draft, {"format", "target": given, else recorded})."""
    p = Path(src)
    if fmt not in IMPORT_FORMATS:
        raise ExportError(f"unknown import format {fmt!r}: choose one of {IMPORT_FORMATS}")
    if not (p / "config.json").exists():
        raise ExportError(f"{p}: config.json is missing (not a draft dir)")
    cfg = read_json(p / "config.json")
    eagle_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if fmt == "auto":
        if "speculators_config" in cfg:
            fmt = "speculators"
        elif "nanospec_export" in cfg:
            fmt = "nanospec"
        elif cfg.get("architectures") == ["LlamaForCausalLMEagle3"] and eagle_ids:
            raise ExportError(
                f"{p / 'config.json'}: explicit eagle_aux_hidden_state_layer_ids {eagle_ids}, read differently by "
                "vLLM and SGLang: pass --import-from safeailab (vLLM ids) or specforge (SGLang ids)"
            )
        elif cfg.get("architectures") == ["LlamaForCausalLMEagle3"]:
            fmt = "safeailab"  # no ids: SpecForge's dir reads the same (the engines' default layers)
        else:
            raise ExportError(
                f"{p / 'config.json'}: not a draft format read here (no speculators_config, architectures "
                f"{cfg.get('architectures')}): pass --import-from {'|'.join(IMPORT_FORMATS[1:])}"
            )
    where = str(p / "config.json")
    recorded = None
    if fmt == "nanospec":
        draft, cfg = load_exported(p)
        sd, recorded = draft.state_dict(), cfg.get("nanospec_export", {}).get("target")
    else:
        sd, wfile = read_weights(p)
        if fmt == "speculators":
            recorded = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
            family, c = config_from_speculators(cfg, _target_layers(target or recorded), where)
            sd = {
                k.replace("layers.0.", "midlayer.", 1) if family in ("eagle3", "peagle") else k: v
                for k, v in sd.items()
            }
        else:
            if cfg.get("architectures") != ["LlamaForCausalLMEagle3"]:
                raise ExportError(
                    f"{where}: architectures {cfg.get('architectures')}, expected ['LlamaForCausalLMEagle3']"
                )
            if not eagle_ids:
                L = _target_layers(target)
                if L is None:
                    raise ExportError(f"{where}: no eagle_aux_hidden_state_layer_ids; pass --target (for the defaults)")
                cfg = {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": default_ids(L)}}
            family = "eagle3"
            c = config_from_serving(cfg, "sglang" if fmt == "specforge" and eagle_ids else "vllm")
        sd = {k: v for k, v in sd.items() if not k.startswith("verifier_")}  # speculators' frozen verifier copies
        if "embed_tokens.weight" in sd:  # our drafts share the target's: the same values or refused
            own, ref = sd.pop("embed_tokens.weight"), target or recorded
            if (
                ref
                and _target_layers(ref) is not None
                and not torch.equal(own.float(), _target_embeddings(resolve_dir(ref)).float())
            ):
                raise ExportError(
                    f"{wfile}: embed_tokens.weight differs from the target's (our drafts share the target's)"
                )
        if FAMILIES[family].serving.layout == "eagle3":
            draft = _draft_from(sd, c, str(wfile))
        else:
            draft = FAMILIES[family].draft_cls(c)
            try:
                draft.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
            except RuntimeError as e:
                raise ExportError(f"{wfile}: {str(e).splitlines()[0]} {str(e).splitlines()[1:2]}") from None
    return draft.eval(), {"format": fmt, "target": target or recorded}


@dataclass
class ExportArgs:
    ckpt: tyro.conf.Positional[str]
    """training checkpoint dir (ckpt/step_N), or a run dir (its latest checkpoint)"""
    out: str = ""
    """serving dir to write (default: <run>/export-<engine>)"""
    engine: Literal["vllm", "sglang", "speculators"] = "vllm"
    """whose config format and aux-layer-id convention is written (the tensors are the same; speculators:
    the config.json of vLLM's own trainer, which `vllm serve DIR` loads without a speculative config)"""
    dtype: Literal["bf16", "fp32", "fp16"] = "bf16"
    with_embeddings: bool = False
    """also write embed_tokens.weight (the target's); engines share the target's otherwise"""
    target: str = ""
    """target dir (default: the one recorded in the checkpoint)"""
    import_from: Literal["", "auto", "speculators", "safeailab", "specforge"] = ""
    """the other way: read the draft dir CKPT (speculators, SafeAILab EAGLE-3 or SpecForge EAGLE-3; auto
    tells them apart) into a training checkpoint at --out (evaluate.py and gate.py read it)"""
    overwrite: bool = False
    """replace an --out that export did not write (export: a dir without its .nanospec-export marker; import: a
    run, whose checkpoints and metrics are deleted). Never the checkpoint being exported or its run"""


def main(a: ExportArgs) -> Path:
    """Every expected failure (ExportError, a missing file) is one `error: ...` line and exit 1."""
    if a.import_from:
        if not a.out:
            raise SystemExit("error: import failed: pass --out (the run dir to write)")
        try:
            path = import_draft(a.ckpt, a.out, a.import_from, a.target or None, a.overwrite)
        except (ExportError, FileNotFoundError) as e:
            raise SystemExit(f"error: import failed: {e}") from None
        print(
            f"[import] {a.ckpt} -> {path} ({json.loads((path / 'config.json').read_text())['imported_from']['format']})"
        )
        return path
    try:
        d = find_checkpoint(a.ckpt)
        out = a.out or str(d.parent.parent / f"export-{a.engine}")
        path = export(d, out, a.engine, a.dtype, a.with_embeddings, a.target or None, a.overwrite)
    except (ExportError, FileNotFoundError) as e:
        raise SystemExit(f"error: export failed: {e}") from None
    print(f"[export] {d} -> {path} ({a.engine}, {a.dtype}{', with embeddings' if a.with_embeddings else ''})")
    return path


if __name__ == "__main__":
    main(tyro.cli(ExportArgs))
