"""capture.py prompts: the target writes user prompts (Magpie-style self-instruct, data/selfinstruct.py) to a
JSONL of conversations for `capture.py regenerate --data` to answer; batches are written whole and a rerun
resumes."""

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch

from core.capture_io import append_rows, check_context, check_inputs, check_out, provenance, read_jsonl_repair, sidecars
from core.distributed import pick_device
from core.regenerate import (
    FINITE_OPTIONS,
    GenerationOptions,
    check_at_least,
    check_engine,
    check_finite,
    check_resume,
    end_run,
    generate_batch,
    load_target_model,
    pick_engine,
    write_json,
)
from core.runlog import git_commit, hardware, versions
from data.selfinstruct import BenchmarkGuard, benchmark_prompts, drop_reason, normalized, query_prefix
from models.target import eos_ids, fingerprint, load_tokenizer, resolve_target


def check_prompts(cfg: "PromptsConfig"):
    """capture.py prompts: the same up-front checks (--max-new-tokens -1 and --batch-size 0 were tracebacks)."""
    at_least = {"batch_size": 1, "max_new_tokens": 1, "num_prompts": 1, "max_batches": 0, "top_k": 0, "min_words": 0}
    check_at_least(cfg, at_least)
    if cfg.batch_size > MAX_PROMPT_BATCH:  # 10**12 sat allocating one batch, printing nothing more
        raise SystemExit(
            f"error: --batch-size must be at most {MAX_PROMPT_BATCH} (prompts sampled together, each with a cache of "
            f"--max-new-tokens positions), got {cfg.batch_size}"
        )
    check_engine(cfg.engine)
    check_finite(cfg, FINITE_OPTIONS)


# ====================================================================== prompts
@dataclass
class PromptsConfig(GenerationOptions):
    """The target writes user prompts itself (Magpie-style self-instruct, data/selfinstruct.py):
    its chat template up to a user turn's text, sampled until the turn ends. Output: one JSON line per
    kept prompt {id, messages: [user, empty assistant]} (answer them with `capture.py regenerate
    --data FILE`), FILE.dropped.jsonl (every dropped prompt with its reason and text) and
    FILE.provenance.json. Written in batches of --batch-size, each seeded by (--seed, batch index),
    so a rerun resumes after the last whole batch and writes what one uninterrupted run would. Exit 0 when
    --num-prompts are kept (or --max-batches ran), 75 when --time-limit stopped it first, 1 on an error."""

    max_new_tokens: int = 256
    """a prompt that has not ended its turn by then is dropped (no_end_of_turn)"""
    temperature: float = 1.0  # varied prompts need sampling (greedy writes one prompt per prefix)
    out: str = "runs/prompts/selfinstruct.jsonl"
    num_prompts: int = 1000
    """stop once at least this many prompts are kept (whole batches: the last one may add more)"""
    max_batches: int = 0
    """stop after this many batches in all, earlier runs' included (0 = until --num-prompts)"""
    system: str | None = None
    """an explicit system turn before the user's; default: what the chat template writes without one"""
    user_prefix: tuple[str, ...] = ()
    """steer the domain: each user prompt starts with one of these texts and the target writes the rest
    (prompt j of batch b takes number (b * batch_size + j) mod their count), e.g. 'Write a Python
    function that' for code; the kept prompt is the prefix plus what the target wrote"""
    min_words: int = 3
    batch_size: int = 64
    """prompts sampled together (one batch = one seed; on the slots engine, also the slots)"""


MAX_PROMPT_BATCH = 1 << 16


ALL_DROPPED_STOP = 512  # prompts: this many sampled in a row, none kept, stops the run (an error, not a hang)


_PROMPTS_SAME_ON_RESUME = (
    "target_fingerprint",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "system",
    "user_prefix",
    "min_words",
    "batch_size",
    "engine",
    "dtype",
)


def _whole_batches(kept: list[dict], dropped: list[dict]) -> tuple[list[dict], list[dict], bool]:
    """The lines of batches written whole (a batch's kept and dropped lines number its batch_n);
    True if a partly written batch was left out (a crash between or inside its two appends)."""
    n = Counter(r["batch"] for r in kept + dropped)
    size = {r["batch"]: r["batch_n"] for r in kept + dropped}
    whole = {b for b, c in n.items() if c == size[b]}
    return [r for r in kept if r["batch"] in whole], [r for r in dropped if r["batch"] in whole], len(whole) < len(n)


def _rewrite(path: Path, rows: list[dict]):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)


def _resume_whole_batches(out: Path, dropped_path: Path) -> tuple[list[dict], list[dict]]:
    """The kept and dropped lines earlier runs wrote, whole batches only (the files rewritten without a partly
    written one)."""
    kept, dropped, partial = _whole_batches(read_jsonl_repair(out), read_jsonl_repair(dropped_path))
    if partial:  # its lines go; the batch is written again, the same (its seed is its index)
        print(f"[prompts] {out}: a partly written batch is redone", flush=True)
        _rewrite(out, kept)
        _rewrite(dropped_path, dropped)
    out.touch()
    dropped_path.touch()
    return kept, dropped


def _prompts_settings(cfg: PromptsConfig, target_dir: Path, engine: str, dtype: torch.dtype, prefix: str) -> dict:
    """The provenance's settings; prefix: the query prefix's text."""
    return {
        "target": cfg.target,
        "target_fingerprint": fingerprint(target_dir),
        **{k: getattr(cfg, k) for k in _PROMPTS_SAME_ON_RESUME[1:]},
        "user_prefix": list(cfg.user_prefix),  # as JSON reads it back on resume
        "engine": engine,
        "dtype": str(dtype).removeprefix("torch."),
        "prefix": prefix,
    }


def _drop_reason_for(cfg: PromptsConfig, tokenizer, kept: list[dict]):
    """drop_reason(text, ids, hit) -> None (keep) or why a new prompt is dropped; it remembers the prompts kept
    (those of earlier runs too) to drop repeats."""
    seen = {normalized(r["messages"][0]["content"]) for r in kept}
    guard = BenchmarkGuard(benchmark_prompts())
    special = [t for t in tokenizer.all_special_tokens if t]
    return lambda text, ids, hit: drop_reason(text, ids, hit, special, seen, guard, cfg.min_words)


def _starts(cfg: PromptsConfig, tokenizer, prefix: list[int]) -> tuple[list[str], list[list[int]]]:
    """(the --user-prefix texts, or [""]; each one's start: the query prefix + its token ids)."""
    user_texts = [u.strip() for u in cfg.user_prefix] or [""]
    if any(not u for u in user_texts) and cfg.user_prefix:
        raise SystemExit("error: --user-prefix: an empty prefix (give none to leave the domain open)")
    starts = [prefix + (tokenizer(u, add_special_tokens=False)["input_ids"] if u else []) for u in user_texts]
    return user_texts, starts


def _slot_generator(model, cfg: PromptsConfig, max_start: int, eos: list[int]):
    """--engine slots: a SlotGenerator of --batch-size slots (one batch at a time)."""
    from models.generate import Sampling, SlotGenerator  # lazy: flex attention and dynamo (seconds), --engine slots

    return SlotGenerator(
        model,
        cfg.batch_size,
        max_start,
        cfg.max_new_tokens,
        eos,
        Sampling(cfg.temperature, cfg.top_p, cfg.top_k),
    )


def _sample_batch(cfg: PromptsConfig, model, gen, tokenizer, starts: list[list[int]], batch: int):
    """Batch `batch`, seeded by (--seed, its index): (pick: the start each prompt j takes, per prompt (new token
    ids, whether max_new_tokens was hit)). gen: the SlotGenerator, None on the hf engine."""
    seed = cfg.seed * 1_000_003 + batch
    pick = [(batch * cfg.batch_size + j) % len(starts) for j in range(cfg.batch_size)]
    if gen is not None:
        gen.gen.manual_seed(seed)
        for j in range(cfg.batch_size):
            gen.add(j, starts[pick[j]])
        res = {}
        while gen.busy():
            res.update({j: (new, hit) for j, new, hit in gen.step()})
        res = [res[j] for j in range(cfg.batch_size)]
    else:
        torch.manual_seed(seed)
        res = generate_batch(model, tokenizer, [starts[i] for i in pick], cfg)
    return pick, res


def _judge_batch(cfg: PromptsConfig, tokenizer, user_texts: list[str], why_drop, batch: int, pick, res):
    """Batch `batch`'s sampled prompts as (kept rows, dropped rows); why_drop: _drop_reason_for's."""
    new_kept, new_dropped = [], []
    for j, (ids, hit) in enumerate(res):
        up = user_texts[pick[j]]
        text = (up + tokenizer.decode(ids, skip_special_tokens=False)).strip()
        row = {"id": f"si{cfg.seed}-{batch:05d}-{j:04d}", "batch": batch, "batch_n": cfg.batch_size}
        row["new_tokens"] = len(ids)
        why = why_drop(text, ids, hit)
        if why is None:
            new_kept.append(
                {**row, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]}
            )
        else:
            new_dropped.append({**row, "reason": why, "text": text})
    return new_kept, new_dropped


class _PromptsRun:
    """One prompts run's output: the JSONL and its dropped file (earlier runs' whole batches, then this run's)
    and the provenance, rewritten after every batch."""

    def __init__(self, cfg: PromptsConfig, target_dir: Path, settings: dict, prov: dict | None, t_start: float):
        self.cfg, self.target_dir, self.settings, self.t_start = cfg, target_dir, settings, t_start
        self.out = Path(cfg.out)
        self.dropped_path, self.prov_path = sidecars(self.out)
        self.kept, self.dropped = _resume_whole_batches(self.out, self.dropped_path)
        self.batch = 1 + max((r["batch"] for r in self.kept + self.dropped), default=-1)  # the next batch's index
        self.runs = (prov or {}).get("runs", [])  # earlier runs' entries
        self.run, self.status, self.t0, self.new_tok = {}, "complete", 0.0, 0
        self.unkept = []  # the prompts dropped since the last one kept

    def start(self, device: torch.device):
        """This run's provenance entry, before the first batch."""
        self.run = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "hardware": hardware(device),
            "versions": versions(),
        }
        self.run.update(git_commit=git_commit(), batches_before=self.batch)

    def write_provenance(self, status: str) -> dict:
        c = Counter(f"dropped_{d['reason']}" for d in self.dropped)
        self.run.update(status=status, seconds=round(time.time() - self.t_start, 1))
        doc = {
            "output": self.out.name,
            "dropped": self.dropped_path.name,
            "model": {
                "spec": self.cfg.target,
                "path": str(self.target_dir),
                "fingerprint": self.settings["target_fingerprint"],
            },
            "settings": self.settings,
            "counts": {
                "batches": self.batch,
                "kept": len(self.kept),
                "dropped": len(self.dropped),
                "new_tokens": sum(r["new_tokens"] for r in self.kept + self.dropped),
                **dict(sorted(c.items())),
            },
            "runs": self.runs + [self.run],
        }
        write_json(self.prov_path, doc)
        return doc

    def add_batch(self, new_kept: list[dict], new_dropped: list[dict], res: list):
        """A sampled batch's rows, appended to the files (res: its (ids, hit) per prompt)."""
        append_rows(self.dropped_path, new_dropped)  # a crash between the two appends leaves a partial batch: redone
        append_rows(self.out, new_kept)
        self.kept += new_kept
        self.dropped += new_dropped
        self.unkept = [] if new_kept else self.unkept + new_dropped
        self.new_tok += sum(len(ids) for ids, _ in res)
        self.batch += 1

    def progress(self):
        c = self.write_provenance("running")["counts"]
        el = time.time() - self.t0
        print(
            f"[prompts] batch {self.batch}: {c['kept']} kept, {c['dropped']} dropped; "
            f"{self.new_tok / el:.0f} tok/s, {el:.0f} s",
            flush=True,
        )

    def finish(self) -> dict:
        """The final provenance and closing line; an error when every recent prompt was dropped."""
        end_run(self.run, self.t0, self.new_tok)
        doc = self.write_provenance(self.status)
        out, dropped, prov = self.out, self.dropped_path.name, self.prov_path.name
        print(f"[prompts] {self.status}: {json.dumps(doc['counts'])}; wrote {out}, {dropped}, {prov}")
        if self.status == "stopped_all_dropped":
            why = dict(Counter(d["reason"] for d in self.unkept).most_common())
            raise SystemExit(
                f"error: the last {len(self.unkept)} prompts sampled were all dropped ({why}), so --num-prompts "
                f"{self.cfg.num_prompts} would never be reached ({len(self.kept)} kept in {out}): let more through "
                "(--temperature above 0 for new prompts, a larger --max-new-tokens, a smaller --min-words) or cap "
                "--max-batches"
            )
        return doc


def _run_batches(r: _PromptsRun, sample, judge):
    """Batches until --num-prompts are kept or --max-batches ran, or a stop (r.status says which).
    sample(batch) -> (pick, res): _sample_batch's; judge(batch, pick, res) -> (kept rows, dropped rows)."""
    cfg, last = r.cfg, 0.0  # last: seconds the last batch took
    while len(r.kept) < cfg.num_prompts and not (cfg.max_batches and r.batch >= cfg.max_batches):
        if len(r.unkept) >= ALL_DROPPED_STOP:  # e.g. --temperature 0 (the same prompts again), a --min-words no
            r.status = "stopped_all_dropped"  # prompt reaches: this loop never ended
            break
        if cfg.time_limit and time.time() + last > r.t_start + cfg.time_limit:
            r.status = "stopped_by_time_limit"
            break
        tb = time.time()
        pick, res = sample(r.batch)
        r.add_batch(*judge(r.batch, pick, res), res)
        last = time.time() - tb
        r.progress()


def write_prompts(cfg: PromptsConfig) -> dict:
    check_prompts(cfg)
    check_inputs(cfg.target)
    check_out(Path(cfg.out), is_dir=False)
    t_start = time.time()
    kind, dtype = pick_device(cfg.device, cfg.dtype)
    device = torch.device(kind)
    target_dir = resolve_target(cfg.target)
    check_context(target_dir, cfg.max_new_tokens, "--max-new-tokens")
    tokenizer = load_tokenizer(target_dir)
    prefix = query_prefix(tokenizer, cfg.system)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engine = pick_engine(cfg.engine, target_dir, kind)
    settings = _prompts_settings(cfg, target_dir, engine, dtype, tokenizer.decode(prefix))
    prov = provenance(out, "prompts")
    # files written before --user-prefix existed had none
    check_resume(prov, settings, _PROMPTS_SAME_ON_RESUME, out, "written", {"user_prefix": []})
    r = _PromptsRun(cfg, target_dir, settings, prov, t_start)
    why_drop = _drop_reason_for(cfg, tokenizer, r.kept)
    eos = stop_ids_for(target_dir, tokenizer)
    user_texts, starts = _starts(cfg, tokenizer, prefix)
    model = load_target_model(engine, target_dir, dtype, device)
    gen = _slot_generator(model, cfg, max(map(len, starts)), eos) if engine == "slots" else None
    print(
        f"[prompts] {len(r.kept)} kept, {len(r.dropped)} dropped before; target {target_dir} ({dtype}, {kind}), "
        f"engine {engine}, batches of {cfg.batch_size}; prefix {settings['prefix']!r}",
        flush=True,
    )
    r.start(device)
    r.t0 = time.time()
    sample = partial(_sample_batch, cfg, model, gen, tokenizer, starts)
    _run_batches(r, sample, partial(_judge_batch, cfg, tokenizer, user_texts, why_drop))
    return r.finish()


def stop_ids_for(target_dir: Path, tokenizer) -> list[int]:
    """models.target.eos_ids without loading a model: the directory's generation config and the tokenizer's EOS."""
    return eos_ids(SimpleNamespace(path=str(target_dir)), tokenizer)
