"""The EAGLE-3 serving layout, to and from the engines' and speculators' formats (eagle3 and peagle
build their `Serving` here; export.py calls it through the family contract, models/family.py).

The dir is config.json + model.safetensors in the format both engines' `LlamaForCausalLMEagle3`
loaders read:

  fc.weight [H, 3*H_t]   midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
  midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]   midlayer.self_attn.o_proj.weight [H, Hq*D]
  midlayer.mlp.{gate,up,down}_proj.weight   norm.weight [H]   lm_head.weight [Vd, H]
  d2t int64 [Vd] (target_id = draft_id + d2t[draft_id])   t2d bool [V]
  embed_tokens.weight [V, H] only with --with-embeddings (the engines otherwise share the target's)

vLLM's loader skips t2d, renames d2t to draft_id_to_target_id and leaves that table at zero
(silently wrong drafts) when d2t is missing: hence the loud checks here (`check_tensors`).

P-EAGLE (vLLM 0.32 llama_eagle3.py + llm_base_proposer.py, speculative_config parallel_drafting):
the EAGLE-3 dir plus `mask_hidden` [n_aux*H_t] (vLLM feeds fc(mask_hidden) to the parallel slots)
and config `mask_token_id` (the token those slots are fed).

speculators (vLLM 0.32 transformers_utils/configs/speculators/algos.py reads eagle3 and peagle):
the same tensors with midlayer.* named layers.0.*, and the fields listed in `to_speculators`.
Refused there: P-EAGLE with fc_norm / norm_output (vLLM's peagle reader drops them) and drafts with
other than 3 aux layers (its eagle3 model sizes fc for 3 when the ids are not under eagle_config).
Read back too: SafeAILab EAGLE-3 dirs (the EAGLE repo: usually no aux ids, the engines' defaults) and
SpecForge's (explicit ids in SGLang's convention, the engine it trains for); variants we do not
implement (norm_before_residual, norm_before_fc) fail.
"""

from dataclasses import dataclass

import torch

from models.engines import (
    ENGINES,
    HF_DTYPE_NAMES,
    ExportError,
    aux_layers_from_engine,
    cast,
    default_ids,
    engine_aux_ids,
    layer_fields,
    speculators_ids,
    target_rope,
    target_tokens,
)
from models.family import Serving
from models.layers import rope_parameters

ARCHITECTURE = "LlamaForCausalLMEagle3"
IDS = "eagle_aux_hidden_state_layer_ids"


def expected_shapes(c, parallel: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
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
    if parallel:  # P-EAGLE: the stand-in aux hidden states of the parallel slots
        shapes["mask_hidden"] = ((len(c.aux_layers) * c.target_hidden_size,), None)
    return shapes


def check_tensors(
    sd: dict[str, torch.Tensor], c, where: str, parallel: bool = False, optional=("embed_tokens.weight",)
):
    """Fail loudly on missing, unexpected, misshaped or non-finite tensors and on a d2t/t2d
    pair that does not describe the same draft vocabulary."""
    want = expected_shapes(c, parallel)
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


def serving_config(c, target_config: dict, engine: str, dtype: torch.dtype) -> dict:
    """config.json of the serving dir. Rope fields are copied as the target's config has them
    (the draft's rope must be the target's: positions are shared)."""
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        **layer_fields(c),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        # the midlayer's residual is the un-normed hidden state (vLLM/SGLang default)
        "norm_before_residual": False,
        "eagle_config": {IDS: engine_aux_ids(c.aux_layers, engine), "use_aux_hidden_state": True},
        # EAGLE-3.1 (vLLM llama_eagle3.py: `fc_norm` = one RMSNorm per aux chunk before fc, weights
        # fc_norm.{i}.weight; `norm_output` = the hidden state handed to the next draft step is the
        # normed output)
        "fc_norm": bool(c.fc_norm),
        "norm_output": bool(c.norm_output),
        "torch_dtype": HF_DTYPE_NAMES[dtype],
        "dtype": HF_DTYPE_NAMES[dtype],
    }
    cfg.update(target_tokens(target_config))
    cfg.update(target_rope(target_config, c.rope_parameters))
    return cfg


@dataclass(frozen=True)
class EagleServing(Serving):
    """EAGLE-3 (and P-EAGLE when vllm_extra has parallel_drafting: vLLM drafts it as EAGLE-3 whose
    later slots are fed mask_token_id and fc(mask_hidden))."""

    architecture: str = ARCHITECTURE
    foreign: bool = True
    checks_tensors = True
    ids_key = IDS
    speculators_names = ("midlayer.", "layers.0.")

    @property
    def parallel(self) -> bool:
        return bool(self.vllm_extra.get("parallel_drafting"))

    def owns(self, cfg: dict) -> bool:
        # a P-EAGLE dir is an EAGLE-3 dir that names the token its parallel slots are fed
        return cfg.get("architectures") == [ARCHITECTURE] and ("mask_token_id" in cfg) == self.parallel

    def unservable(self, c) -> str:
        if not c.moe_experts:
            return ""
        return (
            f"MoE drafts (--moe-experts {c.moe_experts}) cannot be served: vLLM's and SGLang's EAGLE-3 "
            "loaders expect one dense MLP (evaluate.py measures them from the checkpoint)"
        )

    def write(self, draft, engine, target_config, dtype, embeddings):
        c, prov = draft.config, {}
        sd = cast(draft.state_dict(), dtype)
        if embeddings is not None:
            if c.hidden_size != c.target_hidden_size:
                raise ExportError("--with-embeddings needs the draft's hidden size to equal the target's")
            sd["embed_tokens.weight"] = embeddings().to(dtype).contiguous()
        check_tensors(sd, c, "export", self.parallel)
        cfg = serving_config(c, target_config, engine, dtype)
        if self.parallel:
            # vLLM (llm_base_proposer.py) feeds mask slots the token config.mask_token_id and the hidden
            # state fc(mask_hidden) when speculative_config has parallel_drafting=True
            cfg["mask_token_id"] = c.mask_token_id
            prov["depths"] = c.depths  # K it was trained for (vLLM takes K from num_speculative_tokens)
        return cfg, sd, prov

    def named_ids(self, cfg: dict) -> list[int] | None:
        return (cfg.get("eagle_config") or {}).get(IDS)

    def read(self, cfg: dict, engine: str | None = None, where: str = "serving config", num_layers=None) -> dict:
        """The engine (which fixes how the aux ids read) comes from the provenance block, else must be
        given. A dir read with `num_layers` (another trainer's) that names no ids reads as the engines'
        defaults for a target of num_layers() layers."""
        prov = cfg.get("nanospec_export", {})
        if num_layers is not None and not self.named_ids(cfg):
            L = num_layers()
            if L is None:
                raise ExportError(f"{where}: no {IDS}; pass --target (for the defaults)")
            cfg, engine = {**cfg, "eagle_config": {IDS: default_ids(L)}}, "vllm"
        engine = engine or prov.get("engine")
        if engine not in ENGINES:
            raise ExportError(
                "serving config names no engine: pass engine='vllm' or 'sglang' to read its aux layer ids"
            )
        try:
            ids = cfg["eagle_config"][IDS]
            kw = dict(
                hidden_size=cfg["hidden_size"],
                intermediate_size=cfg["intermediate_size"],
                num_attention_heads=cfg["num_attention_heads"],
                num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                rms_norm_eps=cfg["rms_norm_eps"],
                rope_parameters=rope_parameters(cfg),
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
        if prov.get("aux_layer_outputs") is not None and prov["aux_layer_outputs"] != kw["aux_layers"]:
            raise ExportError(
                f"aux ids {ids} ({engine}) disagree with the recorded layer outputs {prov['aux_layer_outputs']}"
            )
        if self.parallel:
            kw.update(mask_token_id=int(cfg["mask_token_id"]), depths=int(prov.get("depths", 4)))
        return kw

    def check(self, sd, c, where):
        if not c.moe_experts:  # MoE drafts (research only) are not in the serving format; the strict load checks them
            check_tensors(sd, c, where, self.parallel)

    def speculative_tokens(self, c) -> int:
        # P-EAGLE: the depths it was trained for; EAGLE-3: 3 (vLLM's usual chain)
        return c.depths if self.parallel else 3

    def to_speculators(self, c) -> dict:
        """vLLM 0.32's algos.py takes draft_vocab_size, target_hidden_size, norm_before_residual (default
        TRUE for eagle3 there, hence written), norm_before_fc, fc_norm, norm_output (eagle3 only: peagle
        drops them), eagle_aux_hidden_state_layer_ids, mask_token_id (peagle, as pard_token); the method
        and K come from speculators_config (peagle -> eagle3 with parallel_drafting)."""
        name = self.speculators[0]
        if len(c.aux_layers) != 3:  # llama_eagle3.py sizes fc from eagle_config (absent here): 3 sources
            raise ExportError(
                f"{name}: vLLM 0.32 reads speculators EAGLE-3 drafts with 3 aux layers, not {len(c.aux_layers)}"
            )
        if self.parallel and (c.fc_norm or c.norm_output):
            raise ExportError(
                f"{name}: vLLM 0.32's speculators reader drops fc_norm / norm_output (EAGLE-3.1): use --engine vllm"
            )
        spec = {
            IDS: engine_aux_ids(c.aux_layers, "speculators"),
            "norm_before_residual": False,
            "norm_before_fc": False,
            "fc_norm": bool(c.fc_norm),
            "norm_output": bool(c.norm_output),
        }
        if self.parallel:
            spec["mask_token_id"] = c.mask_token_id
        return spec

    def from_speculators(self, spec, layer_cfg, k, num_layers, where) -> dict:
        ids = speculators_ids(spec, IDS, num_layers, where)
        cfg = {**layer_cfg, "target_hidden_size": spec.get("target_hidden_size") or layer_cfg["hidden_size"]}
        # vLLM's defaults when absent: norm_before_residual True for eagle3, False for peagle
        defaults = (("norm_before_residual", not self.parallel), ("norm_before_fc", False))
        if unread := [f for f, dflt in defaults if spec.get(f, dflt)]:
            raise ExportError(f"{where}: {', '.join(unread)} is set: our EAGLE-3 layer has no such variant")
        cfg.update(
            draft_vocab_size=spec["draft_vocab_size"],
            eagle_config={IDS: list(ids)},
            fc_norm=bool(spec.get("fc_norm", False)),
            norm_output=bool(spec.get("norm_output", False)),
            nanospec_export={"engine": "speculators", "depths": k},
        )
        if self.parallel:
            cfg["mask_token_id"] = spec["mask_token_id"]
        return cfg
