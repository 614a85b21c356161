"""TTT length scaling (SpecForge paper): EAGLE-3 drafts trained with TTT 1, 2, 3, 5, 7, 9, 13 on the
same data and budget; τ on MT-Bench, HumanEval and GSM8K, training time and peak memory per TTT.

    python experiments/ttt_scaling.py --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf   # H200
    python experiments/ttt_scaling.py --smoke                                               # CPU, seconds

Rows: experiments/results/ttt_scaling.csv (see experiments/sweep.py); figures: experiments/plot.py.
"""

import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments.sweep import SweepArgs, main  # noqa: E402

TTT = (1, 2, 3, 5, 7, 9, 13)
SETTINGS = [(f"ttt{k}", ["--ttt-length", str(k)]) for k in TTT]

if __name__ == "__main__":
    sys.exit(main("ttt_scaling", SETTINGS, tyro.cli(SweepArgs)))
