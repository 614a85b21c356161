"""The manifest of a training mix: per source file, records, assistant tokens (the trained tokens),
the share of replies that loop (data/loops.py) and that ran to the token cap, its share of the
mix's tokens, and the SHA256 of the file's JSONL, decompressed (what a rebuild on the GPU machine is checked
against; the same whether the file travels as .jsonl, .gz or .xz: the packaged sources were recompressed).

    ./dev python experiments/mix_manifest.py FILE_OR_DIR... --out data/smollm2_domains/manifest.json
"""

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cli_options import TargetOption  # noqa: E402
from data.datasets import OPENERS, PLAIN, load_records  # noqa: E402
from data.loops import loop_cut  # noqa: E402
from models.target import load_tokenizer, resolve_target  # noqa: E402


@dataclass
class Args(TargetOption):
    sources: tyro.conf.Positional[tuple[str, ...]]
    """JSONL(.gz, .xz) files of messages-style records (or directories of them)"""
    out: str = ""
    """write the manifest JSON here (default: print only)"""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with OPENERS.get(path.suffix.lower(), PLAIN)[0](path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def source_stats(path: Path, tok) -> dict:
    recs = load_records(str(path))
    replies = [m["content"] for r in recs for m in r["messages"] if m["role"] == "assistant" and m["content"]]
    ids = tok(replies, add_special_tokens=False)["input_ids"] if replies else []
    loops = sum(loop_cut(x) is not None for x in ids)
    capped = sum(int(r.get("hit_max_new_tokens") or 0) for r in recs)
    return {
        "file": path.name,
        "records": len(recs),
        "replies": len(replies),
        "reply_tokens": sum(map(len, ids)),
        "loop_share": round(loops / max(len(ids), 1), 3),
        "hit_cap_share": round(capped / max(len(replies), 1), 3),
        "sha256": sha256(path) if path.is_file() else None,
    }


def main(a: Args):
    tok = load_tokenizer(resolve_target(a.target))
    files = [f for s in map(Path, a.sources) for f in (sorted(s.iterdir()) if s.is_dir() else [s])]
    rows = [source_stats(f, tok) for f in files]
    total = sum(r["reply_tokens"] for r in rows)
    for r in rows:
        r["token_share"] = round(r["reply_tokens"] / max(total, 1), 3)
        print(json.dumps(r), flush=True)
    doc = {"sources": rows, "reply_tokens": total, "records": sum(r["records"] for r in rows)}
    print(json.dumps({k: v for k, v in doc.items() if k != "sources"}))
    if a.out:
        Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main(tyro.cli(Args))
