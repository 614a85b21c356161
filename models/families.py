"""Every draft family, one line each (its network and contract are its file in models/; the
contract's fields are in models/family.py). Adding a family: a new file that ends with
`FAMILY = Family(...)`, and a line here."""

import torch

from models import dflash, domino, dspark, eagle3, peagle
from models.family import Family

FAMILIES: dict[str, Family] = {
    "eagle3": eagle3.FAMILY,  # EAGLE-3 / EAGLE-3.1 (+ LK objectives, MoE MLP): K TTT steps
    "peagle": peagle.FAMILY,  # P-EAGLE: K depths drafted in one parallel forward
    "dflash": dflash.FAMILY,  # DFlash (+ D-PACE): blocks of K masked slots after a clean anchor
    "domino": domino.FAMILY,  # Domino: DFlash blocks fed the previous drafted token's embedding
    "dspark": dspark.FAMILY,  # DSpark: blocks of K whose anchor predicts, Markov + confidence heads
}
assert all(name == f.name for name, f in FAMILIES.items())

# the TrainConfig fields that only some families read (train.py refuses the rest when set)
FAMILY_OPTIONS = frozenset().union(*(f.options for f in FAMILIES.values()))


def family_of(name: str | None) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown strategy {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def load_draft(meta: dict, state_dict: dict) -> torch.nn.Module:
    """A checkpoint's config.json {strategy, draft, ...} and its tensors -> the fp32 draft (eval)."""
    f = family_of(meta.get("strategy"))
    draft = f.draft_cls(f.config_cls(**meta["draft"]))
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state_dict.items()}, strict=True)
    return draft.eval()
