"""Regenerate the packaged ShareGPT conversations with SmolLM2-135M-Instruct (capture.py
regenerate) in time-bounded, resumable calls: one GPU command may run 10 minutes, so each call
stops cleanly at --time-limit, and the next call resumes from what the last one returned.

    # once, here on the CPU: the prompt subset the GPU calls read (~3 MB, carried)
    ./dev python experiments/regen_sharegpt.py prepare --state .stage/regen
    # each GPU call (carry .stage/regen; the results come back from --out)
    python3 experiments/regen_sharegpt.py run --state .stage/regen --out $OUT \\
        --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf --time-limit 480
    # between calls: copy the returned regen.jsonl.gz, regen.dropped.jsonl, regen.provenance.json
    # into .stage/regen/ so the next call skips what is done
    ./dev python experiments/regen_sharegpt.py smoke      # CPU: prepare + two resumed calls, tiny

Settings (PRESET): the first 8000 ShareGPT records, the first 2 assistant turns of each, at
most 512 new tokens a turn, prompts up to 2048 tokens, temperature 0.8 / top-p 0.95 (greedy
makes a 135M model loop), 384 conversations per batch, bf16 on the GPU. Expected output: about
14k turns, ~7.5 MB gzipped (measured with ShareGPT's own answers cut at 2000 chars as a
stand-in); a guard stops the run once the JSONL passes 36 MB (~9.5 MB gzipped at the measured
3.8x) so the result stays under 10 MB whatever the answer lengths. Time: unknown until the first
call prints tok/s; HF generate at ~15-35 ms a step puts it at 6-18 minutes. Needs no `datasets`
on the GPU box; `gguf` for the GGUF target.
"""

import dataclasses
import gzip
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.cli_options import NumRecordsOption, TargetOption  # noqa: E402
from data.chat import to_messages  # noqa: E402
from data.datasets import json_object_line, text_lines  # noqa: E402
from data.loops import loop_cut  # noqa: E402
from experiments.data_regen import reply_stats  # noqa: E402

# v1 (data/sharegpt_smollm2_regen, 2026-11-29): HF generate, sampled, 3,390 chats in 13 GPU minutes
PRESET_V1 = dict(
    num_records=8000,
    max_turns=2,
    max_new_tokens=512,
    max_prompt_len=2048,
    temperature=0.8,
    top_p=0.95,
    seed=0,
    batch_size=384,
    max_output_mb=36,
    engine="hf",
)
# v2 (data/sharegpt_smollm2_greedy): every packaged chat, 3 replies each, greedy (the decoding the
# draft is evaluated and served under; see data/sharegpt_smollm2_greedy/README.md for the choice),
# continuous batching (models/generate.py). The output guard keeps the gzipped file under ~25 MB.
PRESET = dict(
    PRESET_V1,  # its max_new_tokens, seed and batch_size
    num_records=0, max_turns=3, max_prompt_len=1536,  # every packaged chat, 3 replies each
    temperature=0.0, top_p=1.0,  # greedy
    max_output_mb=90, engine="slots", slots=512,  # continuous batching
)  # fmt: skip
SMOKE = dict(
    num_records=6, max_turns=2, max_new_tokens=12, max_prompt_len=512, temperature=0.8, top_p=0.95, seed=0, batch_size=2
)
FILES = ("regen.jsonl.gz", "regen.dropped.jsonl", "regen.provenance.json")


def prepare(state: Path, num_records: int, max_turns: int):
    """First num_records ShareGPT conversations, user/system turns up to the max_turns-th reply,
    assistant turns kept as empty placeholders (they are regenerated)."""
    from core.regenerate import conversation_ids, reply_slots  # lazy: imports torch (seconds), as run() below
    from data.datasets import load_records  # lazy: imports torch (seconds)

    records = load_records("sharegpt", num_records or None)  # 0 = all
    state.mkdir(parents=True, exist_ok=True)
    path = state / "prompts.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for cid, rec in zip(conversation_ids(records), records):
            msgs = []
            for group in reply_slots(to_messages(rec), max_turns):
                msgs += group + [{"role": "assistant", "content": ""}]
            f.write(json.dumps({"id": cid, "messages": msgs}, ensure_ascii=False) + "\n")
    print(f"[prepare] {len(records)} conversations -> {path} ({path.stat().st_size / 1e6:.2f} MB)", flush=True)


def run(state: Path, out_dir: Path, target: str, time_limit: float, settings: dict, num_records: int = 0) -> dict:
    from core.regenerate import RegenConfig, regenerate  # heavy: torch and transformers, only when a run starts

    work = state / "regen.jsonl"
    for name in FILES[1:]:  # copies of returned files may be read-only; they are appended to / replaced
        if (state / name).exists():
            os.chmod(state / name, 0o644)
    if not work.exists() and (state / FILES[0]).exists():  # a fresh machine: resume from the last call's output
        with gzip.open(state / FILES[0], "rb") as src, open(work, "wb") as dst:
            shutil.copyfileobj(src, dst)
    cfg = RegenConfig(
        target=target,
        data=str(state / "prompts.jsonl.gz"),
        out=str(work),
        time_limit=time_limit,
        **{**settings, "num_records": num_records or settings["num_records"]},
    )
    doc = regenerate(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / (FILES[0] + ".tmp")
    with open(work, "rb") as src, gzip.open(tmp, "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.replace(tmp, out_dir / FILES[0])
    for name in FILES[1:]:
        if (state / name).exists() and (state / name).resolve() != (out_dir / name).resolve():
            shutil.copy(state / name, out_dir / name)
    sizes = {n: (out_dir / n).stat().st_size for n in FILES if (out_dir / n).exists()}
    print(json.dumps({"regen": doc["counts"], "status": doc["runs"][-1]["status"], "bytes": sizes}), flush=True)
    return doc


def bench(state: Path, out_dir: Path, target: str, n: int, settings: dict) -> list[dict]:
    """The same first n conversations (first reply only) through today's path (--engine hf,
    batches of 128) and the slot engine, greedy, back to back on this machine; then the slot
    engine sampled (temperature 0.8, top-p 0.95, as v1): generated tokens/s, agreement of the
    greedy outputs, and how repetitive each setting's replies are (experiments/data_regen.py)."""
    from core.regenerate import RegenConfig, regenerate  # heavy: torch and transformers, only when a run starts

    base = {**settings, "max_turns": 1, "num_records": n}
    runs = [
        ("hf_greedy", {"engine": "hf", "batch_size": 128}),
        ("slots_greedy", {"engine": "slots"}),
        ("slots_t0.8", {"engine": "slots", "temperature": 0.8, "top_p": 0.95}),
    ]
    rows, texts = [], {}
    for name, over in runs:
        out = out_dir / "bench" / f"{name}.jsonl"
        out.parent.mkdir(parents=True, exist_ok=True)
        for f in out.parent.glob(f"{name}.*"):
            f.unlink()
        doc = regenerate(
            RegenConfig(target=target, data=str(state / "prompts.jsonl.gz"), out=str(out), **{**base, **over})
        )
        run = doc["runs"][-1]
        recs = [json.loads(line) for line in open(out)]
        texts[name] = {r["id"]: r["messages"][-1]["content"] for r in recs}
        rows.append(
            {
                "what": "regen_bench",
                "setting": name,
                "conversations": n,
                "new_tokens": doc["counts"]["new_tokens"],
                "seconds": run["generate_seconds"],
                "tokens_per_s": round(doc["counts"]["new_tokens"] / run["generate_seconds"]),
                **reply_stats(out),
                "hardware": run["hardware"],
                "versions": run["versions"],
                "git_commit": run["git_commit"],
                "date": time.strftime("%Y-%m-%d"),
            }
        )
    a, b = texts["hf_greedy"], texts["slots_greedy"]
    rows[1]["same_reply_as_hf"] = round(sum(a[k] == b.get(k) for k in a) / max(len(a), 1), 3)
    rows[1]["speedup_vs_hf"] = round(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], 2)
    with open(out_dir / "regen_bench.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k not in ("hardware", "versions")}), flush=True)
    return rows


def finalize(inputs: list[Path], dropped: list[Path], out_dir: Path, target: str) -> dict:
    """Merge regenerated files (conversation ids must not repeat) into out_dir/regen.jsonl.gz, and
    write out_dir/deloop.jsonl.gz: the same conversations with each looping reply cut after its
    loop's first repeat (data/loops.py). Later replies stay: they were written after the whole
    loop, so they are near-policy rather than exactly the target's answer to the cut context, but
    train.py recomputes the target's distribution on the context as given, so every soft label
    stays exact."""
    from transformers import AutoTokenizer  # lazy: transformers (~1.5 s to import)

    from models.target import resolve_target  # lazy: imports torch (seconds)

    tok = AutoTokenizer.from_pretrained(resolve_target(target))
    out_dir.mkdir(parents=True, exist_ok=True)
    seen, stats = set(), dict(conversations=0, replies=0, tokens=0, replies_cut=0, kept_tokens=0)
    raw, cut = (
        gzip.open(out_dir / "regen.jsonl.gz.tmp", "wt", encoding="utf-8"),
        gzip.open(out_dir / "deloop.jsonl.gz.tmp", "wt", encoding="utf-8"),
    )

    def records():
        for path in inputs:
            for lineno, line in text_lines(path):  # .jsonl, .gz or .xz (the packaged v3 set)
                r = json_object_line(path, lineno, line, "expected a JSON object per line, got")
                if r is None:  # a blank line
                    continue
                if r["id"] in seen:
                    raise SystemExit(f"{path}: conversation {r['id']} appears twice in the inputs")
                seen.add(r["id"])
                yield r

    def deloop(r: dict, ids: list[list[int]]) -> dict:
        msgs, kept, replies = [], 0, iter(ids)
        for m in r["messages"]:
            if m["role"] != "assistant":
                msgs.append(m)
                continue
            tokens = next(replies)
            n = loop_cut(tokens)
            stats["replies"] += 1
            stats["tokens"] += len(tokens)
            if n is None:
                msgs.append(m)
                kept += len(tokens)
                continue
            msgs.append({"role": "assistant", "content": tok.decode(tokens[:n])})
            kept += n
            stats["replies_cut"] += 1
        stats["kept_tokens"] += kept
        stats["conversations"] += 1
        return {**r, "messages": msgs, "kept_tokens": kept}

    chunk = []
    for r in itertools.chain(records(), [None]):
        if r is not None:
            chunk.append(r)
        if len(chunk) == 2048 or (r is None and chunk):  # one batched (multi-threaded) tokenizer call per chunk
            texts = [m["content"] for c in chunk for m in c["messages"] if m["role"] == "assistant"]
            flat, at = tok(texts, add_special_tokens=False)["input_ids"], 0
            for c in chunk:
                k = sum(m["role"] == "assistant" for m in c["messages"])
                raw.write(json.dumps(c, ensure_ascii=False) + "\n")
                cut.write(json.dumps(deloop(c, flat[at : at + k]), ensure_ascii=False) + "\n")
                at += k
            chunk = []
    raw.close()
    cut.close()
    for name in ("regen.jsonl.gz", "deloop.jsonl.gz"):
        os.replace(out_dir / (name + ".tmp"), out_dir / name)
    with open(out_dir / "regen.dropped.jsonl", "w") as f:
        for path in (p for p in dropped if p.exists()):  # a run that dropped nothing may write no file
            f.writelines(line if line.endswith("\n") else line + "\n" for line in open(path) if line.strip())
    stats["kept_share"] = round(stats["kept_tokens"] / max(stats["tokens"], 1), 4)
    print(json.dumps({"finalize": stats, "inputs": [str(p) for p in inputs]}), flush=True)
    return stats


def smoke():
    """Prepare 6 conversations, regenerate 3 in a first call and the rest in a second call on a
    'fresh machine' (only the returned files carried over); check nothing is lost or repeated."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        state, out1, out2 = tmp / "state", tmp / "out1", tmp / "out2"
        prepare(state, SMOKE["num_records"], SMOKE["max_turns"])
        t0 = time.time()
        run(state, out1, "smollm2", 300, SMOKE, num_records=3)
        (state / "regen.jsonl").unlink()  # the next call starts bare: only returned files travel
        for n in FILES:
            if (out1 / n).exists():
                shutil.copy(out1 / n, state / n)
        doc = run(state, out2, "smollm2", 300, SMOKE)
        with gzip.open(out2 / FILES[0], "rt") as f:
            ids = [json.loads(line)["id"] for line in f]
        c = doc["counts"]
        assert len(ids) == len(set(ids)) == c["written"] and c["written"] + c["dropped"] == 6 and c["remaining"] == 0, c
        assert len(doc["runs"]) == 2 and doc["runs"][1]["done_before"] == 3
        print(
            f"[smoke] ok: {c['written']} written, {c['dropped']} dropped, {c['new_tokens']} new tokens in "
            f"{time.time() - t0:.0f} s (CPU)",
            flush=True,
        )


@dataclasses.dataclass
class Prepare:
    """Write the prompt subset the GPU calls read (CPU; PRESET's records and turns)."""

    state: Path = ROOT / ".stage" / "regen"
    """the carried state: prompts.jsonl.gz, and the returned files of earlier calls"""


@dataclasses.dataclass
class Output(TargetOption, Prepare):
    out: Path | None = None
    """where the results go (default: --state)"""


@dataclasses.dataclass
class Run(Output):
    """One time-bounded, resumable regeneration call (GPU)."""

    time_limit: float = 480
    """seconds for this call, model loading included"""
    batch_size: int = PRESET["batch_size"]
    """conversations per batch"""


@dataclasses.dataclass
class Bench(NumRecordsOption, Output):
    """The hf and slots engines side by side on the first --num-records conversations."""

    num_records: int = 512  # enough to compare the engines, not the whole prepared set


@dataclasses.dataclass
class Finalize(Output):
    """Merge regenerated shards into regen.jsonl.gz (+ the loop-cut deloop.jsonl.gz)."""

    inputs: tuple[Path, ...] = ()
    """regenerated JSONL(.gz) files to merge, in order"""
    dropped: tuple[Path, ...] = ()
    """their regen.dropped.jsonl files"""


@dataclasses.dataclass
class Smoke:
    """CPU: prepare + two resumed calls, tiny."""


def main(cmd: Prepare | Smoke):
    if isinstance(cmd, Run):
        run(cmd.state, cmd.out or cmd.state, cmd.target, cmd.time_limit, {**PRESET, "batch_size": cmd.batch_size})
    elif isinstance(cmd, Finalize):
        finalize(list(cmd.inputs), list(cmd.dropped), cmd.out or cmd.state, cmd.target)
    elif isinstance(cmd, Bench):
        bench(cmd.state, cmd.out or cmd.state, cmd.target, cmd.num_records, PRESET)
    elif isinstance(cmd, Prepare):
        prepare(cmd.state, PRESET["num_records"], PRESET["max_turns"])
    else:
        smoke()


if __name__ == "__main__":
    main(
        tyro.extras.subcommand_cli_from_dict(
            {"prepare": Prepare, "run": Run, "bench": Bench, "finalize": Finalize, "smoke": Smoke}, description=__doc__
        )
    )
