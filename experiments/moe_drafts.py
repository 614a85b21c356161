"""MoE drafts (SpecForge paper): the EAGLE-3 draft's MLP as a mixture of experts against the dense
draft, same data and budget; τ on MT-Bench, HumanEval and GSM8K. Settings (models/moe.py MoEMLP
states the sizes; I = the dense intermediate size, every MoE routes top-1):

    dense          the EAGLE-3 draft
    params-e2      2 experts of I/2: the dense parameter count (half its FLOPs per token)
    flops-e{2,3,4} 2/3/4 experts of I: the dense FLOPs per token (2/3/4x its MLP parameters)
    shared-e{2,3,4} one shared expert of I/2 + top-1 of 2/3/4 routed experts of I/2: the dense FLOPs

    python experiments/moe_drafts.py --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf   # H200
    python experiments/moe_drafts.py --smoke

Rows: experiments/results/moe_drafts.csv. MoE drafts are measured from their training checkpoints
(evaluate.py); export.py refuses them (no serving engine loads an MoE EAGLE-3 draft).
"""

import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.sweep import SweepArgs, main  # noqa: E402

SETTINGS = [
    ("dense", []),
    ("params-e2", ["--moe-experts", "2", "--moe-mode", "params"]),
    *[(f"flops-e{e}", ["--moe-experts", str(e), "--moe-mode", "flops"]) for e in (2, 3, 4)],
    *[(f"shared-e{e}", ["--moe-experts", str(e), "--moe-mode", "flops", "--moe-shared"]) for e in (2, 3, 4)],
]

if __name__ == "__main__":
    sys.exit(main("moe_drafts", SETTINGS, tyro.cli(SweepArgs)))
