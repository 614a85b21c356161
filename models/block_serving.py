"""The block serving layout (DFlash, DSpark), to and from vLLM's and speculators' formats (dflash and
dspark build their `Serving` here; export.py calls it through the family contract, models/family.py).

DFlash (vLLM 0.32 models/qwen3_dflash.py): config.json with architectures ["DFlashDraftModel"],
model_type qwen3, Qwen3 layer fields, num_hidden_layers, block_size, dflash_config {mask_token_id,
target_layer_ids, use_aux_hidden_state}; model.safetensors with fc.weight, hidden_norm.weight,
layers.{i}.{input_layernorm,post_attention_layernorm}.weight,
layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
layers.{i}.mlp.{gate,up,down}_proj.weight, norm.weight. No lm_head / embed_tokens: the drafts use the
target's frozen ones and vLLM shares them when the checkpoint has none. dflash_config.target_layer_ids
are our layer-output indices: vLLM adds 1 (get_eagle3_aux_layers_from_config) to get its capture
ids, which are HF hidden_states indices (models/engines.py), so no conversion is written here.

DSpark (vLLM 0.32 models/qwen3_dspark.py, architecture Qwen3DSparkModel): the DFlash tensors
and config plus markov_head.markov_w1.weight [V, r], markov_head.markov_w2.weight [V, r],
confidence_head.proj.{weight [1, H + r], bias [1]}; config markov_rank, draft_vocab_size (= V:
no lm_head / d2t written, vLLM shares the target's head), enable_confidence_head,
confidence_head_with_markov, sample_from_anchor=true (blocks of block_size = K slots, the anchor
slot predicts; served with method "dspark", num_speculative_tokens = block_size).

speculators (vLLM 0.32 algos.py reads dflash and dspark): the same tensors and names, and the fields
listed in `to_speculators`. The CPU build's V1 runner refuses dspark in either format, so DSpark is
checked by the reader only. Variants we do not implement (DSpark's gated/rnn heads, DFlash with a
draft vocabulary) fail.
"""

from dataclasses import dataclass

import torch

from models.engines import (
    HF_DTYPE_NAMES,
    ExportError,
    aux_layers_from_engine,
    cast,
    engine_aux_ids,
    layer_fields,
    speculators_ids,
    target_rope,
    target_tokens,
)
from models.family import Serving
from models.layers import rope_parameters

DFLASH, DSPARK = "DFlashDraftModel", "Qwen3DSparkModel"  # vLLM's classes
IDS = "aux_hidden_state_layer_ids"  # speculators' key (vLLM ids); vLLM's own dir names ours under dflash_config


@dataclass(frozen=True)
class BlockServing(Serving):
    """DFlash (anchor = the bonus token, K = block_size - 1 masked slots) or, with architecture
    Qwen3DSparkModel, DSpark (the anchor slot predicts: K = block_size; Markov and confidence heads)."""

    @property
    def heads(self) -> bool:
        """DSpark's format: the anchor predicts, and the Markov and confidence heads are written."""
        return self.architecture == DSPARK

    def write(self, draft, engine, target_config, dtype, embeddings):
        """(config.json, tensors) of a DFlash / DSpark serving dir for vLLM."""
        c, family = draft.config, draft.family
        if embeddings is not None:
            raise ExportError(f"{family}: no embeddings are written (vLLM shares the target's)")
        sd = cast(draft.state_dict(), dtype)
        cfg = {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_layers,
            **layer_fields(c),
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
        if self.heads:
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
        cfg.update(target_rope(target_config, c.rope_parameters))
        cfg.update(target_tokens(target_config))
        # a fresh draft of the config, on the CPU: under torch.device("meta") transformers' llama3 rope
        # init fails (it copies inv_freq to the CPU), so Llama-3.1 targets could not be exported
        want = {k: tuple(v.shape) for k, v in type(draft)(c).state_dict().items()}
        got = {k: tuple(v.shape) for k, v in sd.items()}
        if want != got or not all(torch.isfinite(v).all() for v in sd.values() if v.is_floating_point()):
            raise ExportError(
                f"{family}: tensors differ from the draft config's (missing {sorted(set(want) - set(got))}, "
                f"unexpected {sorted(set(got) - set(want))}) or are not finite"
            )
        return cfg, sd, {"strategy": family}

    def read(self, cfg: dict, engine: str | None = None, where: str = "serving config", num_layers=None) -> dict:
        d = cfg.get("dflash_config", {})
        kw = dict(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_parameters=rope_parameters(cfg),
            max_position_embeddings=cfg["max_position_embeddings"],
            vocab_size=cfg["vocab_size"],
            target_hidden_size=cfg.get("target_hidden_size", cfg["hidden_size"]),
            aux_layers=list(d["target_layer_ids"]),
            num_layers=cfg["num_hidden_layers"],
            block_size=cfg["block_size"],
            mask_token_id=d["mask_token_id"],
            hidden_act=cfg.get("hidden_act", "silu"),
        )
        if self.heads:
            if (
                not cfg.get("sample_from_anchor", True)
                or cfg.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]
                or not cfg.get("enable_confidence_head")
            ):
                raise ExportError(
                    "dspark: only anchor-sampling, full-vocabulary drafts with a confidence head are read here"
                )
            kw.update(
                markov_rank=cfg["markov_rank"],
                confidence_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
            )
        return kw

    def speculative_tokens(self, c) -> int:
        # a DFlash block's masked slots (its anchor is the bonus token), a whole DSpark block
        return c.block_size - (not self.heads)

    def to_speculators(self, c) -> dict:
        """vLLM 0.32's algos.py takes aux_hidden_state_layer_ids (vLLM ids; target_layer_ids = id - 1 =
        ours), mask_token_id, block_size, sample_from_anchor, sliding_window_non_causal
        (dflash_config.causal = not it), and for dspark the Markov / confidence fields."""
        spec = {
            IDS: engine_aux_ids(c.aux_layers, "speculators"),
            "mask_token_id": c.mask_token_id,
            "block_size": c.block_size,
            "sample_from_anchor": self.heads,  # dflash: the anchor is the bonus token; dspark: it predicts
            "sliding_window_non_causal": True,  # the block attends to itself both ways
        }
        if self.heads:
            spec.update(
                markov_rank=c.markov_rank,
                markov_head_type="vanilla",
                enable_confidence_head=True,
                confidence_head_with_markov=bool(c.confidence_with_markov),
            )
        return spec

    def from_speculators(self, spec, layer_cfg, k, num_layers, where) -> dict:
        name = self.speculators[0]
        ids = speculators_ids(spec, IDS, num_layers, where)
        cfg = {**layer_cfg, "target_hidden_size": spec.get("target_hidden_size") or layer_cfg["hidden_size"]}
        anchor = spec.get("sample_from_anchor", self.heads)
        if anchor != self.heads or spec.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]:
            raise ExportError(
                f"{where}: {name} with sample_from_anchor={anchor}, draft_vocab_size={spec.get('draft_vocab_size')}: "
                f"our {name} drafts {'predict from' if self.heads else 'do not predict from'} the anchor "
                "and use the full target vocabulary"
            )
        if self.heads and spec.get("markov_head_type", "vanilla") != "vanilla":
            raise ExportError(f"{where}: markov_head_type {spec['markov_head_type']!r}: only 'vanilla' is ours")
        cfg.update(
            architectures=[self.architecture],
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
        return cfg
