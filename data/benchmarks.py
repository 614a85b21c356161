"""The packaged benchmarks drafts are evaluated on (evaluate.py) and kept out of training data
(data/selfinstruct.py): mtbench (80 questions x 2 turns), humaneval (164 code prompts), gsm8k
(1319 questions), or a JSONL file whose lines hold "prompt", "turns" or "messages"."""

import gzip
import json
from pathlib import Path

DATASETS = ("mtbench", "humaneval", "gsm8k")


def load_prompts(name: str, n: int) -> list[list[str]]:
    """A dataset -> up to n conversations, each a list of user turns."""
    from data.assets import asset_path

    if name == "mtbench":
        rows = [json.loads(x) for x in open(asset_path("mtbench"))]
        turns = [r["turns"] for r in rows]
    elif name == "humaneval":
        with gzip.open(asset_path("humaneval"), "rt") as f:
            turns = [[json.loads(x)["prompt"]] for x in f if x.strip()]
    elif name == "gsm8k":
        turns = [[json.loads(x)["question"]] for x in open(asset_path("gsm8k")) if x.strip()]
    else:
        path = Path(name)
        if not path.exists():
            raise SystemExit(f"unknown dataset {name!r}: use {', '.join(DATASETS)} or a JSONL file")
        turns = []
        for lineno, line in enumerate(open(path), 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if "messages" in r:
                t = [m["content"] for m in r["messages"] if m["role"] == "user"]
            else:
                t = r.get("turns") or [r.get("prompt")]
            if not t or not all(isinstance(x, str) for x in t):
                raise SystemExit(f"{path}:{lineno}: expected 'prompt', 'turns' or 'messages'")
            turns.append(t)
    return turns[:n] if n else turns
