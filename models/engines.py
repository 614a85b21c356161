"""What every serving layout shares (DESIGN.md, "Serving formats"): the engines, how each numbers the
target layers a draft reads, the error a draft that cannot be written or read raises, and the fields
a serving config.json copies from the target's. export.py and the layouts (models/eagle_serving.py,
models/block_serving.py) import them, so each convention is written once.

Aux layer ids, checked in the engines' code:

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
"""

import torch

from models.target import default_aux_layers

ENGINES = ("vllm", "sglang", "speculators")
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_parameters")
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


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
    return engine_aux_ids(default_aux_layers(num_layers), "vllm")


def aux_layers_from_engine(ids: list[int], engine: str) -> list[int]:
    return [i - 1 for i in ids] if engine in ("vllm", "speculators") else engine_aux_ids(ids, engine)


def speculators_ids(spec: dict, key: str, num_layers: int | None, where: str) -> list[int]:
    """The vLLM-convention aux ids a speculators config names under `key`, else vLLM's defaults for a
    target of `num_layers` layers (None: not at hand, refused)."""
    ids = spec.get(key)
    if not ids:
        if num_layers is None:
            raise ExportError(f"{where}: no {key}; pass --target so vLLM's default layers can be derived")
        ids = default_ids(num_layers)
    return ids


# ---- fields both layouts write from the draft's config ----
def layer_fields(c) -> dict:
    """A draft layer's heads, activation, norm eps, context and vocabulary (from its config `c`), in the order
    both layouts' config.json list them."""
    return {
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
    }


# ---- fields a serving config takes from the target, and back ----
def target_rope(target_config: dict, rope_parameters: dict) -> dict:
    """The target's rope fields as its config.json has them (the draft's rope must be the target's:
    positions are shared), else the draft's own `rope_parameters`."""
    rope = {k: target_config[k] for k in ROPE_FIELDS if target_config.get(k) is not None}
    return rope or {"rope_parameters": rope_parameters}


def target_tokens(target_config: dict) -> dict:
    """The target's special token ids (bos, eos, pad) that its config.json names."""
    return {k: target_config[k] for k in TOKEN_FIELDS if k in target_config}


def cast(sd: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors in the serving dtype, the rest (d2t, t2d) as they are; contiguous for safetensors."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in sd.items()}
