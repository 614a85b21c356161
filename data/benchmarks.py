"""The packaged benchmarks drafts are evaluated on (evaluate.py) and kept out of training data
(data/selfinstruct.py): mtbench (80 questions x 2 turns), humaneval (164 code prompts), gsm8k
(1319 questions), or a JSONL file whose lines hold "prompt", "turns" or "messages"."""

import gzip
import json
from pathlib import Path

from data.assets import asset_path
from data.chat import DataError
from data.datasets import json_object_line, text_lines

DATASETS = ("mtbench", "humaneval", "gsm8k")


def load_prompts(name: str, n: int) -> list[list[str]]:
    """A dataset -> up to n conversations, each a list of user turns."""
    if name == "mtbench":
        rows = [json.loads(x) for x in open(asset_path("mtbench"))]
        turns = [r["turns"] for r in rows]
    elif name == "humaneval":
        with gzip.open(asset_path("humaneval"), "rt") as f:
            turns = [[json.loads(x)["prompt"]] for x in f if x.strip()]
    elif name == "gsm8k":
        turns = [[json.loads(x)["question"]] for x in open(asset_path("gsm8k")) if x.strip()]
    else:
        turns = read_prompt_file(name)
    return turns[:n] if n else turns


def read_prompt_file(name: str) -> list[list[str]]:
    """A JSONL file of prompts, one conversation per line: {"prompt": str}, {"turns": [str, ...]} or
    {"messages": [{"role", "content"}, ...]} (its user turns). Anything else is a DataError naming the line."""
    path = Path(name)
    if not path.is_file():
        raise DataError(
            f"unknown dataset {name!r}: use {', '.join(DATASETS)} or a JSONL file"
            + (" (a directory is not one)" if path.is_dir() else "")
        )
    expected = "expected an object with 'prompt' (a string), 'turns' (strings) or 'messages' ({role, content} objects)"
    turns = []
    for lineno, line in text_lines(path):
        r = json_object_line(path, lineno, line, f"{expected}, got a")
        if r is None:
            continue
        if "messages" in r:
            msgs = r["messages"]
            if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs):
                raise DataError(f"{path}:{lineno}: 'messages' must be a list of {{role, content}} objects")
            t = [m.get("content") for m in msgs if m.get("role") == "user"]
            if not t:
                raise DataError(f"{path}:{lineno}: 'messages' has no user turn")
        else:
            t = r.get("turns") or [r.get("prompt")]
        if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
            raise DataError(f"{path}:{lineno}: {expected}, got keys {sorted(r)}")
        turns.append(t)
    if not turns:
        raise DataError(f"{path}: no prompts in it (empty)")
    return turns
