"""What a draft family is to the rest of the code (DESIGN.md, "Family contract"): the fields of
`Family`, which each family's file in models/ fills in at its end (`FAMILY = Family(...)`);
models/families.py lists them, one line each. train.py, export.py, evaluate.py and gate.py reach a
family only through that list, so adding one is a new file here plus one line there.

    name        the key everywhere: `train.py --strategy NAME`, a checkpoint's config.json
                "strategy", the draft module's `.family`
    config_cls, draft_cls   the draft's config dataclass and nn.Module (config_cls(**json) rebuilds it)
    objectives  accepted --objective values, the first is the default
    options_cls the dataclass of this family's own train.py options (e.g. models/eagle3.py Eagle3Options;
                families of one kind share one); TrainConfig holds every family's, `train.py --strategy
                NAME --help` shows this family's only, and train.py refuses another family's (`options`:
                the names)
    attentions, losses  the --attention / --loss values it reads (empty: it reads no such option,
                and train.py refuses one given); `auto(device kind)` -> the values "auto" means there
    build       (cfg, target, token counts, tokenizer) -> the draft module
    host        host-side additions to a collated batch (TTT rows, block anchors, sampled depths),
                made on the prefetch thread; random draws come from generators seeded by
                (seed, batch key, index of the example in the global batch), so one rank and N
                ranks, resumed runs and repeated evaluations see the same draws
    make_batch  (features, batch on the device, target, draft) -> the draft's batch (no grad)
    counts      (the draft's batch, draft, cfg) -> [K, 2] (accuracy rows, loss rows) for its K
                drafted positions; train.py sums them over ranks before the step, so each loss is
                a mean over the global batch
    step        (draft module, its batch, counts, cfg, b, schedule) -> (loss, {"loss_sum": [K],
                "correct": [K]}); schedule = the fraction of training done (Domino's curriculum)
    proposer    (draft, HF target model, depth, topk) -> the Proposer evaluate.py and gate.py
                decode with (models/proposer.py)
    decode_depth  the proposer drafts any depth / top-k tree asked for (evaluate.py -k, --tree-topk);
                otherwise the K it was trained for per step, of which it verifies the first depth <= K
    serving     how export.py writes it for the engines and reads it back (a `Serving`; None: no engine
                in reach loads it)
    packs       whether its host / make_batch / step keep the documents of packed rows apart
                (data/packing.py: doc_ids, position_ids in the batch); train.py packs only those
    ttt_passes  the draft runs over every row token once per drafted position (EAGLE-3's TTT):
                MFU counts 6*N*K

K is --ttt-length for every family: TTT steps (eagle3), parallel depths (peagle), predicted block
slots (dflash/domino: blocks of K + 1 with the clean anchor first; dspark: blocks of K whose
anchor slot predicts the first token).
"""

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from data.vocab import build_vocab_mapping


@dataclass(frozen=True)
class Serving:
    """How a family is written for the engines and read back. export.py calls only this (it names no
    family); a layout module builds it for the families drafting that way, so the engines' key names
    of a layout are written in one file: models/eagle_serving.py (EAGLE-3, P-EAGLE) and
    models/block_serving.py (DFlash, DSpark). What every layout shares is in models/engines.py.

    engines       the engines whose format is written ("speculators" comes with "vllm")
    vllm_method   speculative_config method, and the extra settings it needs (P-EAGLE:
                  parallel_drafting, whose dir also carries mask_token_id and mask_hidden)
    architecture  the `architectures` entry of its vLLM / SGLang config.json
    speculators   (speculators_model_type, the class speculators writes); empty: not in that format
    missing       why the engines left out of `engines` are (said when one is asked for)
    foreign       other trainers write this dir too (the EAGLE repo, SpecForge): `export.py
                  --import-from safeailab|specforge` reads it
    checks_tensors  the layout names every tensor (`check` refuses a misfit before any load);
                  otherwise a strict load against the draft config is the check
    ids_key       the config key of the aux-layer ids whose reading depends on the engine ("" if none)
    speculators_names  (our tensor name prefix, speculators') where the two differ
    """

    engines: tuple[str, ...]
    vllm_method: str
    vllm_extra: dict = field(default_factory=dict)
    architecture: str = ""
    speculators: tuple[str, str] = ("", "")
    missing: str = ""
    foreign: bool = False
    checks_tensors: ClassVar[bool] = False
    ids_key: ClassVar[str] = ""
    speculators_names: ClassVar[tuple[str, str]] = ("", "")

    def owns(self, cfg: dict) -> bool:
        """Whether a config.json in the engines' format holds a draft of this family."""
        return cfg.get("architectures") == [self.architecture]

    def unservable(self, c) -> str:
        """Why a draft of this config cannot be written ("": it can), asked before anything else."""
        return ""

    def write(self, draft, engine: str, target_config: dict, dtype, embeddings) -> tuple[dict, dict, dict]:
        """(config.json, tensors, provenance entries) of the engine's dir; `embeddings` is None, or a
        function that reads the target's embed_tokens (--with-embeddings)."""
        raise NotImplementedError

    def read(self, cfg: dict, engine: str | None = None, where: str = "serving config", num_layers=None) -> dict:
        """A config.json of the engines' format -> the draft config's fields. `engine` says how the aux
        ids read (default: the provenance's); `num_layers`, given for another trainer's dir, returns the
        target's layer count (or None), for the engines' default ids when the config names none."""
        raise NotImplementedError

    def named_ids(self, cfg: dict) -> list[int] | None:
        """The engine-dependent aux ids a config.json names (under `ids_key`), None when it names none."""
        return None

    def check(self, sd: dict, c, where: str) -> None:
        """The loud tensor checks of a layout with `checks_tensors`."""

    def speculative_tokens(self, c) -> int:
        """K written as speculators' speculative_tokens (vLLM's default num_speculative_tokens)."""
        raise NotImplementedError

    def to_speculators(self, c) -> dict:
        """This family's fields of a speculators config.json (refusing what speculators' reader drops)."""
        raise NotImplementedError

    def from_speculators(self, spec: dict, layer_cfg: dict, k: int, num_layers: int | None, where: str) -> dict:
        """A speculators config.json (its transformer_layer_config `layer_cfg`, its K) -> a config.json in
        the engines' format, which `read` takes."""
        raise NotImplementedError


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    draft_cls: type
    objectives: tuple[str, ...]
    options_cls: type
    build: Callable
    host: Callable
    make_batch: Callable
    counts: Callable
    step: Callable
    proposer: Callable
    serving: Serving | None
    attentions: tuple[str, ...] = ()
    losses: tuple[str, ...] = ()
    auto: Callable[[str], dict] = lambda kind: {}
    packs: bool = False
    ttt_passes: bool = False
    decode_depth: bool = False

    @property
    def options(self) -> frozenset[str]:
        return frozenset(f.name for f in fields(self.options_cls))


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


def with_vocab(draft, counts, size: int):
    """Fill the draft's d2t / t2d with the `size` most frequent trained tokens (EAGLE-3, P-EAGLE)."""
    d2t, t2d = build_vocab_mapping(counts, size)
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


# --attention of the parallel families (P-EAGLE, DFlash, Domino, DSpark): eager = dense masks (the
# reference, any device), flex = FlexAttention block masks (GPU: no flex backward on CPU)
PARALLEL_ATTENTIONS = ("eager", "flex")


def parallel_auto(kind: str) -> dict:
    return {"attention": "flex" if kind == "cuda" else "eager"}


def parallel_attention(cfg) -> str:
    """The parallel families' attention as their modules name it: flex, or dense for eager."""
    return "flex" if cfg.attention == "flex" else "dense"
