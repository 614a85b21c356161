"""Draft families behind one training runtime (DESIGN.md, "Strategy contract").

A strategy is what differs between draft families; everything else is shared: train.py runs each
one the same way (data, target or feature store, FSDP2, checkpoints, logs), export.py writes its
serving dir, evaluate.py drafts with it. `train.py --strategy NAME` picks one of STRATEGIES.

    features    target features the step reads: "aux" (outputs of the aux layers, always) and
                "final" (final hidden state -> the target's distribution / argmax)
    objectives  accepted --objective values, the first is the default
    build       (cfg, target, token counts, tokenizer) -> the draft module (its file in models/)
    host        host-side additions to a collated batch (TTT rows, block anchors, sampled depths),
                made on the prefetch thread; random draws come from generators seeded by
                (seed, batch key, index of the example in the global batch), so one rank and N
                ranks, resumed runs and repeated evaluations see the same draws
    make_batch  (features, batch on the device, target, draft) -> the draft's batch (no grad)
    counts      the draft's batch -> [K, 2] (accuracy rows, loss rows) for its K drafted
                positions; train.py sums them over ranks before the step, so each loss is a
                mean over the global batch
    step        (draft module, its batch, counts, cfg, b, progress) -> (loss,
                {"loss_sum": [K], "correct": [K]}); acc_k / loss_k in the logs come from these
    serving     export.py's format for it (None: no engine in reach loads it)
    draft_vocab whether --draft-vocab-size applies (a d2t / t2d subset of the target vocabulary)
    packs       whether its host / make_batch / step keep the documents of packed rows apart
                (data/packing.py: doc_ids, position_ids in the batch); train.py packs only those

K is --ttt-length for every family: TTT steps (eagle3), parallel depths (peagle), predicted block
slots (dflash/domino: blocks of K + 1 with the clean anchor first; dspark: blocks of K whose
anchor slot predicts the first token).
"""
from dataclasses import dataclass
from typing import Callable

import torch

from data.vocab import build_vocab_mapping
from models.dflash import OBJECTIVES as DFLASH_OBJECTIVES
from models.dflash import DFlashConfig, DFlashDraft, block_counts, block_host, make_block_batch
from models.domino import DominoConfig, DominoDraft
from models.dspark import DSparkConfig, DSparkDraft, prefix_rows
from models.eagle3 import OBJECTIVES as EAGLE3_OBJECTIVES
from models.eagle3 import Eagle3Config, Eagle3Draft, local_counts, select_rows
from models.eagle3 import make_batch as eagle3_batch
from models.peagle import PEagleConfig, PEagleDraft, make_peagle_batch, peagle_counts, peagle_host


@dataclass(frozen=True)
class Strategy:
    name: str
    features: tuple[str, ...]
    objectives: tuple[str, ...]
    build: Callable
    host: Callable
    make_batch: Callable
    counts: Callable
    step: Callable
    config_cls: type
    draft_cls: type
    serving: str | None
    draft_vocab: bool = False  # the draft proposes from a --draft-vocab-size subset of the target's vocabulary (d2t / t2d)
    packs: bool = False  # its batch, masks and loss honour packed rows' doc_ids / position_ids (train.py --pack)
    ttt_passes: bool = False  # the draft runs over every row token once per drafted position (EAGLE-3's TTT): MFU's 6*N*K


def generator(seed: int, key: int, example: int) -> torch.Generator:
    return torch.Generator().manual_seed(((seed * 1_000_003 + key) * 65_537 + example) % (2**63))


def pick_mask_token(tokenizer, counts: torch.Tensor) -> int:
    """The token fed at masked / parallel slots (DFlash, P-EAGLE): a special token that
    never occurs in the training data (its frozen target embedding then carries no meaning of
    its own), else the rarest token of the vocabulary."""
    V = counts.numel()
    specials = sorted({i for i in (tokenizer.all_special_ids or []) if i is not None and 0 <= i < V})
    specials += sorted(i for i in getattr(tokenizer, "added_tokens_decoder", {}) if 0 <= i < V and i not in specials)
    unused = [i for i in specials if counts[i] == 0]
    return int(unused[-1]) if unused else int(counts.argmin())


# ---------------------------------------------------------------- eagle3 (+ EAGLE-3.1, LK)
def _with_vocab(draft, counts, size: int):
    """Fill the draft's d2t / t2d with the `size` most frequent trained tokens (EAGLE-3, P-EAGLE)."""
    d2t, t2d = build_vocab_mapping(counts, size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


def _eagle3_build(cfg, target, counts, tokenizer):
    moe = {k: getattr(cfg, k) for k in Eagle3Config.__dataclass_fields__ if k.startswith("moe_") and hasattr(cfg, k)}  # MoE draft MLP
    c = Eagle3Config.from_target(target.config, cfg.draft_vocab_size, target.aux_layers, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output, **moe)
    return _with_vocab(Eagle3Draft(c), counts, cfg.draft_vocab_size)


def _eagle3_host(b, cfg, device, key, first=0):
    if device.type == "cuda":  # host-chosen TTT rows: no nonzero() sync per step on the GPU
        b["rows"] = select_rows(b["loss_mask"], cfg.ttt_length, doc_ids_BT=b.get("doc_ids"))
    return b


def _eagle3_make_batch(feats, b, target, draft):
    return eagle3_batch(feats, b["input_ids"], b["loss_mask"], target.embed_tokens, target.lm_head, draft.draft_ids,
                        b.get("doc_ids"), b.get("position_ids"))


def _eagle3_step(module, batch, counts, cfg, b, progress):
    return module(batch, cfg.ttt_length, counts, attention=cfg.attention, loss=cfg.loss, rows=b.get("rows"), objective=cfg.objective)


# ---------------------------------------------------------------- block drafters (DFlash family)
def _block_host(b, cfg, device, key, first=0):
    return block_host(b, cfg.num_anchors, lambda i: generator(cfg.seed, key, first + i))


def _block_make_batch(feats, b, target, draft, target_p=False, prev_embeds=False):
    c = draft.config
    packed = "doc_ids" in b  # packed rows: each block's document span, positions inside the documents
    return make_block_batch(feats, b["input_ids"], b["loss_mask"], b["attention_mask"], b["anchors"], target.embed_tokens, target.lm_head,
                            draft.K, c.block_size, c.mask_token_id, target_p=target_p, prev_embeds=prev_embeds,
                            anchor_start=b["anchor_start"] if packed else None, anchor_end=b["anchor_end"] if packed else None,
                            position_ids=b.get("position_ids"))


def _block_attention(cfg) -> str:
    return "flex" if cfg.attention.startswith("flex") else "dense"


def _dflash_build(cfg, target, counts, tokenizer):
    c = DFlashConfig.from_target(target.config, target.aux_layers, cfg.ttt_length + 1, pick_mask_token(tokenizer, counts), cfg.draft_layers)
    return DFlashDraft(c)


def _dflash_step(module, batch, counts, cfg, b, progress):
    return module(batch, counts, objective=cfg.objective, loss_decay=cfg.loss_decay, attention=_block_attention(cfg))


def _domino_build(cfg, target, counts, tokenizer):
    c = DominoConfig.from_target(target.config, target.aux_layers, cfg.ttt_length + 1, pick_mask_token(tokenizer, counts), cfg.draft_layers)
    return DominoDraft(c)


def _domino_step(module, batch, counts, cfg, b, progress):  # progress drives the base -> corrected curriculum
    return module(batch, counts, progress=progress, loss_decay=cfg.loss_decay, attention=_block_attention(cfg))


def _dspark_build(cfg, target, counts, tokenizer):  # blocks of K slots: the anchor slot predicts too
    c = DSparkConfig.from_target(target.config, target.aux_layers, cfg.ttt_length, pick_mask_token(tokenizer, counts), cfg.draft_layers)
    return DSparkDraft(c)


def _dspark_make_batch(feats, b, target, draft):
    batch = _block_make_batch(feats, b, target, draft, target_p=True)
    batch.weights = prefix_rows(batch.weights)  # DSpark trains a slot only while its block prefix is trained
    return batch


# ---------------------------------------------------------------- peagle
def _peagle_build(cfg, target, counts, tokenizer):
    c = PEagleConfig.from_target(target.config, cfg.draft_vocab_size, target.aux_layers, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output,
                                 mask_token_id=pick_mask_token(tokenizer, counts), depths=cfg.ttt_length)
    return _with_vocab(PEagleDraft(c), counts, cfg.draft_vocab_size)


def _peagle_make_batch(feats, b, target, draft):
    return make_peagle_batch(feats, b["input_ids"], b["loss_mask"], b["pe_pos"], b["pe_depth"], b["pe_doc"], target.embed_tokens, target.lm_head,
                             draft.draft_ids, draft.t2d, draft.config.mask_token_id, b["pe_start"], b["pe_end"])


STRATEGIES: dict[str, Strategy] = {
    "eagle3": Strategy(
        name="eagle3", features=("aux", "final"), objectives=EAGLE3_OBJECTIVES, build=_eagle3_build, host=_eagle3_host,
        make_batch=_eagle3_make_batch, counts=lambda batch, draft, cfg: local_counts(batch, draft.t2d, cfg.ttt_length),
        step=_eagle3_step, config_cls=Eagle3Config, draft_cls=Eagle3Draft, serving="eagle3", draft_vocab=True, packs=True,
        ttt_passes=True,
    ),
    "peagle": Strategy(
        name="peagle", features=("aux", "final"), objectives=("kl",), build=_peagle_build,
        host=lambda b, cfg, device, key, first=0: peagle_host(b, cfg.ttt_length, lambda i: generator(cfg.seed, key, first + i)),
        make_batch=_peagle_make_batch, counts=lambda batch, draft, cfg: peagle_counts(batch, cfg.ttt_length),
        step=lambda module, batch, counts, cfg, b, progress: module(batch, counts, attention=_block_attention(cfg)),
        config_cls=PEagleConfig, draft_cls=PEagleDraft, serving="peagle", draft_vocab=True, packs=True,
    ),
    "dflash": Strategy(
        name="dflash", features=("aux",), objectives=DFLASH_OBJECTIVES, build=_dflash_build, host=_block_host,
        make_batch=_block_make_batch, counts=lambda batch, draft, cfg: block_counts(batch), step=_dflash_step,
        config_cls=DFlashConfig, draft_cls=DFlashDraft, serving="dflash", packs=True,
    ),
    "domino": Strategy(
        name="domino", features=("aux",), objectives=("ce",), build=_domino_build, host=_block_host,
        make_batch=lambda feats, b, target, draft: _block_make_batch(feats, b, target, draft, prev_embeds=True),
        counts=lambda batch, draft, cfg: block_counts(batch), step=_domino_step,
        config_cls=DominoConfig, draft_cls=DominoDraft, serving=None, packs=True,  # no engine loader (vLLM 0.32 has none)
    ),
    "dspark": Strategy(
        name="dspark", features=("aux", "final"), objectives=("ce-l1-conf",), build=_dspark_build, host=_block_host,
        make_batch=_dspark_make_batch, counts=lambda batch, draft, cfg: block_counts(batch),
        step=lambda module, batch, counts, cfg, b, progress: module(batch, counts, attention=_block_attention(cfg)),
        config_cls=DSparkConfig, draft_cls=DSparkDraft, serving="dspark", packs=True,
    ),
}


def load_draft(meta: dict, state_dict: dict) -> torch.nn.Module:
    """A checkpoint's config.json {strategy, draft, ...} and its tensors -> the fp32 draft (eval)."""
    s = STRATEGIES.get(meta.get("strategy"))
    if s is None:
        raise ValueError(f"unknown strategy {meta.get('strategy')!r} (known: {', '.join(STRATEGIES)})")
    draft = s.draft_cls(s.config_cls(**meta["draft"]))
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}, strict=True)
    return draft.eval()
