"""capture.py prompts: the target writes user prompts (Magpie-style self-instruct, data/selfinstruct.py) to a
JSONL of conversations for `capture.py regenerate --data` to answer; batches are written whole and a rerun
resumes."""

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from core.capture_io import append_rows, check_context, check_inputs, check_out, provenance, read_jsonl_repair, sidecars
from core.distributed import pick_device
from core.regenerate import generate_batch, pick_engine
from core.runlog import git_commit, hardware, versions
from models.target import DEFAULT_TARGET, eos_ids, fingerprint, load_tokenizer, resolve_target


def check_prompts(cfg: "PromptsConfig"):
    """capture.py prompts: the same up-front checks (--max-new-tokens -1 and --batch-size 0 were tracebacks)."""
    at_least = {"batch_size": 1, "max_new_tokens": 1, "num_prompts": 1, "max_batches": 0, "top_k": 0, "min_words": 0}
    for name, low in at_least.items():
        if (v := getattr(cfg, name)) < low:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least {low}, got {v}")
    if cfg.batch_size > MAX_PROMPT_BATCH:  # 10**12 sat allocating one batch, printing nothing more
        raise SystemExit(
            f"error: --batch-size must be at most {MAX_PROMPT_BATCH} (prompts sampled together, each with a cache of "
            f"--max-new-tokens positions), got {cfg.batch_size}"
        )
    if cfg.engine not in ("auto", "slots", "hf"):
        raise SystemExit(f"error: --engine must be auto, slots or hf, got {cfg.engine!r}")
    for name, ok, rng in (
        ("temperature", lambda v: v >= 0, "at least 0 (0 = greedy)"),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("time_limit", lambda v: v >= 0, "at least 0 (0 = none)"),
    ):
        if not (math.isfinite(v := getattr(cfg, name)) and ok(v)):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a finite number {rng}, got {v}")


# ====================================================================== prompts
@dataclass
class PromptsConfig:
    """The target writes user prompts itself (Magpie-style self-instruct, data/selfinstruct.py):
    its chat template up to a user turn's text, sampled until the turn ends. Output: one JSON line per
    kept prompt {id, messages: [user, empty assistant]} (answer them with `capture.py regenerate
    --data FILE`), FILE.dropped.jsonl (every dropped prompt with its reason and text) and
    FILE.provenance.json. Written in batches of --batch-size, each seeded by (--seed, batch index),
    so a rerun resumes after the last whole batch and writes what one uninterrupted run would. Exit 0 when
    --num-prompts are kept (or --max-batches ran), 75 when --time-limit stopped it first, 1 on an error."""

    target: str = DEFAULT_TARGET
    """HF causal-LM directory, a .gguf file, or 'smollm2'"""
    out: str = "runs/prompts/selfinstruct.jsonl"
    num_prompts: int = 1000
    """stop once at least this many prompts are kept (whole batches: the last one may add more)"""
    max_batches: int = 0
    """stop after this many batches in all, earlier runs' included (0 = until --num-prompts)"""
    max_new_tokens: int = 256
    """a prompt that has not ended its turn by then is dropped (no_end_of_turn)"""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    system: str | None = None
    """an explicit system turn before the user's; default: what the chat template writes without one"""
    user_prefix: tuple[str, ...] = ()
    """steer the domain: each user prompt starts with one of these texts and the target writes the rest
    (prompt j of batch b takes number (b * batch_size + j) mod their count), e.g. 'Write a Python
    function that' for code; the kept prompt is the prefix plus what the target wrote"""
    min_words: int = 3
    batch_size: int = 64
    """prompts sampled together (one batch = one seed; on the slots engine, also the slots)"""
    engine: str = "auto"
    """slots (models/generate.py) | hf (transformers' generate) | auto: slots on a GPU where supported"""
    dtype: str = "auto"
    device: str = "auto"
    time_limit: float = 0
    """seconds; stop cleanly before a batch would pass it (0 = none); exit 75 when it stops so"""


MAX_PROMPT_BATCH = 1 << 16


ALL_DROPPED_STOP = 512  # prompts: this many sampled in a row, none kept, stops the run (an error, not a hang)


_PROMPTS_SAME_ON_RESUME = ("target_fingerprint", "max_new_tokens", "temperature", "top_p", "top_k", "seed")


_PROMPTS_SAME_ON_RESUME += ("system", "user_prefix", "min_words", "batch_size", "engine", "dtype")


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


def write_prompts(cfg: PromptsConfig) -> dict:
    from transformers import AutoModelForCausalLM

    from data.selfinstruct import BenchmarkGuard, benchmark_prompts, drop_reason, normalized, query_prefix

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
    dropped_path, prov_path = sidecars(out)
    engine = pick_engine(cfg.engine, target_dir, kind)
    settings = {
        "target": cfg.target,
        "target_fingerprint": fingerprint(target_dir),
        **{k: getattr(cfg, k) for k in _PROMPTS_SAME_ON_RESUME[1:]},
        "user_prefix": list(cfg.user_prefix),  # as JSON reads it back on resume
        "engine": engine,
        "dtype": str(dtype).removeprefix("torch."),
        "prefix": tokenizer.decode(prefix),
    }
    prov = provenance(out, "prompts")
    if prov is not None:
        diff = {
            k: (old, settings[k])
            for k in _PROMPTS_SAME_ON_RESUME
            # files written before --user-prefix existed had none
            if (old := prov["settings"].get(k, [] if k == "user_prefix" else None)) != settings[k]
        }
        if diff:
            raise SystemExit(f"error: {out} was written with other settings {diff} (old, new): use another --out")
    kept, dropped, partial = _whole_batches(read_jsonl_repair(out), read_jsonl_repair(dropped_path))
    if partial:  # its lines go; the batch is written again, the same (its seed is its index)
        print(f"[prompts] {out}: a partly written batch is redone", flush=True)
        _rewrite(out, kept)
        _rewrite(dropped_path, dropped)
    out.touch()
    dropped_path.touch()
    seen = {normalized(r["messages"][0]["content"]) for r in kept}
    guard = BenchmarkGuard(benchmark_prompts())
    special = [t for t in tokenizer.all_special_tokens if t]
    eos = stop_ids_for(target_dir, tokenizer)
    user_texts = [u.strip() for u in cfg.user_prefix] or [""]
    if any(not u for u in user_texts) and cfg.user_prefix:
        raise SystemExit("error: --user-prefix: an empty prefix (give none to leave the domain open)")
    starts = [prefix + (tokenizer(u, add_special_tokens=False)["input_ids"] if u else []) for u in user_texts]
    if engine == "slots":
        from models.fast_target import FastTarget
        from models.generate import Sampling, SlotGenerator

        model = FastTarget.from_pretrained(target_dir, dtype=dtype, device=device)
        gen = SlotGenerator(
            model,
            cfg.batch_size,
            max(map(len, starts)),
            cfg.max_new_tokens,
            eos,
            Sampling(cfg.temperature, cfg.top_p, cfg.top_k),
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    batch = 1 + max((r["batch"] for r in kept + dropped), default=-1)
    print(
        f"[prompts] {len(kept)} kept, {len(dropped)} dropped before; target {target_dir} ({dtype}, {kind}), "
        f"engine {engine}, batches of {cfg.batch_size}; prefix {settings['prefix']!r}",
        flush=True,
    )
    runs = (prov or {}).get("runs", [])
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "hardware": hardware(device), "versions": versions()}
    run.update(git_commit=git_commit(), batches_before=batch)

    def write_provenance(status: str) -> dict:
        c = Counter(f"dropped_{d['reason']}" for d in dropped)
        run.update(status=status, seconds=round(time.time() - t_start, 1))
        doc = {
            "output": out.name,
            "dropped": dropped_path.name,
            "model": {"spec": cfg.target, "path": str(target_dir), "fingerprint": settings["target_fingerprint"]},
            "settings": settings,
            "counts": {
                "batches": batch,
                "kept": len(kept),
                "dropped": len(dropped),
                "new_tokens": sum(r["new_tokens"] for r in kept + dropped),
                **dict(sorted(c.items())),
            },
            "runs": runs + [run],
        }
        tmp = prov_path.with_name(prov_path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
        os.replace(tmp, prov_path)
        return doc

    status, last, t0, new_tok, unkept = "complete", 0.0, time.time(), 0, []
    while len(kept) < cfg.num_prompts and not (cfg.max_batches and batch >= cfg.max_batches):
        if len(unkept) >= ALL_DROPPED_STOP:  # e.g. --temperature 0 (the same prompts again), a --min-words no
            status = "stopped_all_dropped"  # prompt reaches: this loop never ended
            break
        if cfg.time_limit and time.time() + last > t_start + cfg.time_limit:
            status = "stopped_by_time_limit"
            break
        tb, seed = time.time(), cfg.seed * 1_000_003 + batch
        pick = [(batch * cfg.batch_size + j) % len(starts) for j in range(cfg.batch_size)]
        if engine == "slots":
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
        new_kept, new_dropped = [], []
        for j, (ids, hit) in enumerate(res):
            up = user_texts[pick[j]]
            text = (up + tokenizer.decode(ids, skip_special_tokens=False)).strip()
            row = {"id": f"si{cfg.seed}-{batch:05d}-{j:04d}", "batch": batch, "batch_n": cfg.batch_size}
            row["new_tokens"] = len(ids)
            why = drop_reason(text, ids, hit, special, seen, guard, cfg.min_words)
            if why is None:
                new_kept.append(
                    {**row, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]}
                )
            else:
                new_dropped.append({**row, "reason": why, "text": text})
        append_rows(dropped_path, new_dropped)  # a crash between the two appends leaves a partial batch: redone
        append_rows(out, new_kept)
        kept += new_kept
        dropped += new_dropped
        unkept = [] if new_kept else unkept + new_dropped
        new_tok += sum(len(ids) for ids, _ in res)
        batch += 1
        last = time.time() - tb
        c = write_provenance("running")["counts"]
        el = time.time() - t0
        print(
            f"[prompts] batch {batch}: {c['kept']} kept, {c['dropped']} dropped; {new_tok / el:.0f} tok/s, {el:.0f} s",
            flush=True,
        )
    el = time.time() - t0
    run.update(generate_seconds=round(el, 2), new_tokens=new_tok, tokens_per_s=round(new_tok / max(el, 1e-9)))
    doc = write_provenance(status)
    print(f"[prompts] {status}: {json.dumps(doc['counts'])}; wrote {out}, {dropped_path.name}, {prov_path.name}")
    if status == "stopped_all_dropped":
        why = dict(Counter(d["reason"] for d in unkept).most_common())
        raise SystemExit(
            f"error: the last {len(unkept)} prompts sampled were all dropped ({why}), so --num-prompts "
            f"{cfg.num_prompts} would never be reached ({len(kept)} kept in {out}): let more through (--temperature "
            "above 0 for new prompts, a larger --max-new-tokens, a smaller --min-words) or cap --max-batches"
        )
    return doc


def stop_ids_for(target_dir: Path, tokenizer) -> list[int]:
    """models.target.eos_ids without loading a model: the directory's generation config and the tokenizer's EOS."""
    from types import SimpleNamespace

    return eos_ids(SimpleNamespace(path=str(target_dir)), tokenizer)
