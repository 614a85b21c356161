"""Data regeneration (SpecForge paper): the same EAGLE-3 draft trained on ShareGPT's original answers
and on the answers the target itself wrote for the same prompts; τ on MT-Bench, HumanEval, GSM8K.

Both settings train on the same conversations: the regenerated set (`sharegpt-regen`, 3,390 chats,
data/sharegpt_smollm2_regen/) and, for each of its chats, the original ShareGPT record cut to the
same turns. Chats whose user turns do not line up with the original are left out of both (counted
in <runs-dir>/data_regen/data/matched.json).

    python experiments/data_regen.py --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf   # H200
    python experiments/data_regen.py --smoke

Rows: experiments/results/data_regen.csv.
"""

import json
import statistics
import sys
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from data.chat import to_messages  # noqa: E402
from experiments.sweep import SweepArgs, main  # noqa: E402

SHAREGPT_SCAN = 8000  # the regenerated chats come from the first 8,000 ShareGPT records


def original_replies(messages: list[dict]) -> list[tuple[list[dict], dict]]:
    """(non-assistant messages, the original reply after them) pairs, with the turns the
    regeneration dropped dropped too (capture.py reply_slots: an assistant turn with no new user
    input before it, leading or repeated, is not a reply)."""
    out, cur = [], []
    for m in messages:
        if m["role"] != "assistant":
            cur.append(m)
        elif any(x["role"] == "user" for x in cur):
            out.append((cur, m))
            cur = []
    return out


def matched_files(out: Path, limit: int = 0) -> tuple[Path, Path]:
    """(original.jsonl, regen.jsonl): the same chats, in the same order, answered by ShareGPT's
    authors and by the target."""
    from data.datasets import SHAREGPT, SHAREGPT_REGEN, load_records  # lazy: imports torch; --help runs without torch

    orig_path, regen_path, info = out / "original.jsonl", out / "regen.jsonl", out / "matched.json"
    if info.exists() and json.loads(info.read_text()).get("limit") == limit:
        return orig_path, regen_path
    out.mkdir(parents=True, exist_ok=True)
    originals = {r["id"]: r for r in load_records(SHAREGPT, SHAREGPT_SCAN)}
    regen = load_records(SHAREGPT_REGEN)
    kept, skipped = [], {"not_in_sharegpt": 0, "turns_differ": 0}
    for r in regen:
        if limit and len(kept) >= limit:
            break
        if r["id"] not in originals:
            skipped["not_in_sharegpt"] += 1
            continue
        new = to_messages(r)
        old = [m for group, reply in original_replies(to_messages(originals[r["id"]])) for m in (*group, reply)]
        old = old[: len(new)]
        if [(m["role"], m["content"]) for m in old if m["role"] != "assistant"] != [
            (m["role"], m["content"]) for m in new if m["role"] != "assistant"
        ] or [m["role"] for m in old] != [m["role"] for m in new]:
            skipped["turns_differ"] += 1
            continue
        kept.append((r["id"], old, new))
    for path, which in ((orig_path, 1), (regen_path, 2)):
        with open(path, "w") as f:
            for row in kept:
                f.write(json.dumps({"id": row[0], "messages": row[which]}) + "\n")
    info.write_text(json.dumps({"limit": limit, "kept": len(kept), "skipped": skipped}, indent=1))
    print(f"[data_regen] {len(kept)} matched chats ({skipped}) in {out}", flush=True)
    return orig_path, regen_path


def repetition(text: str, n: int = 4) -> float:
    """Share of the reply's word n-grams that repeat an earlier one (0 = none; a reply stuck in a
    loop approaches 1)."""
    w = text.split()
    grams = [tuple(w[i : i + n]) for i in range(len(w) - n + 1)]
    return 1 - len(set(grams)) / len(grams) if grams else 0.0


def reply_stats(path: Path, loop_share: float = 0.2) -> dict:
    """Words per assistant reply and how repetitive the replies are, for one matched file: the
    check behind experiments/README.md's reading of the regeneration result."""
    words, reps = [], []
    for line in open(path):
        for m in json.loads(line)["messages"]:
            if m["role"] == "assistant":
                words.append(len(m["content"].split()))
                reps.append(repetition(m["content"]))
    return {
        "replies": len(words),
        "words_median": statistics.median(words),
        "words_mean": round(statistics.fmean(words), 1),
        "repeated_4gram_share_mean": round(statistics.fmean(reps), 3),
        f"replies_over_{loop_share:g}_repeated": round(sum(r > loop_share for r in reps) / len(reps), 3),
    }


def prepare(a: SweepArgs) -> SweepArgs:
    orig, regen = matched_files(Path(a.runs_dir) / "data_regen" / "data", a.num_records if a.smoke else 0)
    SETTINGS[:] = [("original", ["--data", str(orig)]), ("regenerated", ["--data", str(regen)])]
    return a


SETTINGS: list = []  # filled by prepare() (the files live under --runs-dir)

if __name__ == "__main__":
    args = tyro.cli(SweepArgs)
    sys.exit(main("data_regen", SETTINGS, args, prepare=prepare))
