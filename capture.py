"""Run the frozen target over a dataset, offline.

    torchrun --nproc_per_node=N capture.py features --target T --data D --out DIR
    python capture.py regenerate --target T --data D --out FILE.jsonl [--temperature 0.8]
    python capture.py prompts --target T --out FILE.jsonl --num-prompts N

features    Tokenizes D exactly as train.py does (same --num-records / --max-len, so sample id i
            is train.py's example i; train.py applies --holdout to the ids), runs the target and
            stores per sample input_ids, loss_mask, the aux-layer hidden states and the final
            (normed) hidden state in a FeatureStore (data/feature_store.py) in --dtype, from our
            target (--backend hf, the default, or compiled) or from vLLM (--backend vllm: one
            engine in its own venv, tools/vllm_features.py; the same store, keys and schema). Logits
            are not stored: train.py recomputes them with the frozen lm_head. Samples are packed
            into shards of ~--shard-mb by a plan that depends only on the sample lengths; rank r
            of W captures shards r, r+W, ...; a rerun skips shards already in the store.
            Train from it with `train.py --features DIR` (no target forward).
regenerate  The target writes new assistant turns: every assistant turn is regenerated from the
            conversation so far, whose earlier assistant turns are the regenerated ones. Greedy
            (--temperature 0) or sampled with --seed. Output: one JSON line per conversation
            {id, messages, ...} appended as batches finish (rerun to resume: done ids are
            skipped), FILE.dropped.jsonl for conversations the target could not continue, and
            FILE.provenance.json (model, settings, source, counts, dates, versions).
prompts     The target writes user prompts (Magpie-style self-instruct, data/selfinstruct.py): kept
            ones go to FILE.jsonl as conversations to answer with `regenerate --data FILE.jsonl`.

Exit status (each subcommand): 0 finished (regenerate: also stopped by --max-output-mb, as asked); 75 stopped
unfinished by --time-limit (sysexits.h's EX_TEMPFAIL, as train.py: rerun the same command to resume); 1 failed
(one `error:` line); 130 interrupted by Ctrl-C (rerun to resume). The provenance or capture_runs.jsonl says the same.
"""

import json
import math
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from data.chat import DataError, to_messages
from data.datasets import DEFAULT_DATA, SHAREGPT, build_examples, load_records
from data.feature_store import FeatureStore, StoreError, feature_schema, plan_shards, tokens_digest
from distributed import all_sum, barrier, destroy, init_distributed, pick_device
from features import BACKENDS, capture_examples, load_target, target_identity
from models.target import DEFAULT_TARGET, fingerprint, load_tokenizer, past_context, resolve_target, target_context
from runlog import git_commit, hardware, output_kind, run_metadata, versions
from tools.vllm_features import vllm_target

EXIT_STOPPED = 75  # stopped unfinished by --time-limit: rerun to resume (train.py's code for the same)
EXIT_INTERRUPTED = 130


# ====================================================================== features
@dataclass
class FeaturesConfig:
    """The target's features of --data into a FeatureStore for `train.py --features`. Exit 0 when the store is
    complete, 75 when --time-limit stopped it first (rerun to resume), 1 on an error."""

    target: str = DEFAULT_TARGET
    """HF causal-LM directory, a .gguf file, or 'smollm2'"""
    data: str = DEFAULT_DATA
    """as train.py --data"""
    num_records: int = 1200
    """as train.py --num-records (0 = all)"""
    max_len: int = 384
    """as train.py --max-len"""
    aux_layers: tuple[int, ...] = ()
    """as train.py --aux-layers (default [1, L//2-1, L-4])"""
    out: str = "runs/features"
    """FeatureStore directory (local or shared by several nodes)"""
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32: the target runs and features are stored in it"""
    shard_mb: int = 256
    """approximate shard size"""
    batch_tokens: int = 32768
    """padded tokens per target forward"""
    time_limit: float = 0
    """seconds; stop cleanly (after a shard) before exceeding it; rerun to resume (0 = none); exit 75 when it
    stops so, 0 when the store is complete"""
    backend: str = "hf"
    """target forward: hf (transformers; the reference) | compiled (models/fast_target.py) | vllm (a vLLM engine in
    its own venv, NANOSPEC_VLLM_VENV or .venv-vllm, created when missing; tools/vllm_features.py)"""
    device: str = "auto"


def check_out(out: Path, is_dir: bool):
    """--out before anything is loaded: a store directory (features) or an output file (regenerate,
    prompts) that can be written, as one error line (they were a PermissionError or an OSError from a
    mkdir deep in the run, after the target had loaded). Nothing of an existing --out is changed."""
    import errno
    import tempfile

    if not is_dir and out.is_dir():
        raise SystemExit(f"error: --out {out} is a directory; give a file name")
    if is_dir and out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file; the feature store is a directory")
    where = out if is_dir else out.parent
    while not where.exists() and where != where.parent:  # nothing is created here: a probe in the nearest
        where = where.parent  # existing directory, where the run's mkdir would write
    if not where.is_dir():
        raise SystemExit(f"error: --out {out}: {where} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=where)
        os.close(fd)
        os.unlink(probe)
        if not is_dir and out.exists():
            open(out, "ab").close()  # appending nothing: the file is writable, its bytes untouched
    except OSError as e:
        why = {
            errno.EROFS: "it is on a read-only file system",
            errno.EACCES: "no permission to write there",
            errno.EPERM: "no permission to write there",
            errno.ENOSPC: "no space left on that device",
        }.get(e.errno, e.strerror or str(e))
        raise SystemExit(f"error: --out {out}: cannot write there: {why}") from None


def check_inputs(target: str, data: str | None = None):
    """Another command's output given as --target or --data, one `error:` line before anything loads (a draft
    export as --target was a tokenizer error after seconds, a run as --data an error about its metrics.jsonl)."""
    if kind := output_kind(target):
        raise SystemExit(
            f"error: --target {target} is {kind}, not a target model (a Hugging Face model dir, a .gguf or 'smollm2')"
        )
    if data is not None and (kind := output_kind(data)):
        raise SystemExit(f"error: --data {data} is {kind}, not chats (a ShareGPT/messages-style file or directory)")


def check_store_out(out: Path):
    """features --out: a new or empty directory, or a feature store to resume or add to; nothing else (a store
    written into a training run, an export or a target model's directory mixed their files)."""
    if not out.is_dir() or (out / "store.json").exists():
        return
    if kind := output_kind(out):
        raise SystemExit(f"error: --out {out} is {kind}, not a feature store: give a new or empty directory")
    # (what a store's first write leaves before its store.json: shards/ and hidden temporary files)
    found = sorted(p.name for p in out.iterdir() if not p.name.startswith(".") and p.name != "shards")
    if found:
        shown = ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
        raise SystemExit(
            f"error: --out {out} holds files that are not a feature store's ({shown}): give a new or empty directory"
        )


def check_features(cfg: FeaturesConfig):
    """features: option values that cannot work, one `error:` line each, before anything loads or is written
    (--num-records -1 said the data file was empty; --shard-mb 0 wrote a shard per sample; --batch-tokens 0 and
    --max-len -5 ran; --aux-layers 1 1, which train.py refuses, was captured)."""
    if cfg.backend not in BACKENDS:
        raise SystemExit(f"error: --backend must be one of {', '.join(BACKENDS)}, got {cfg.backend!r}")
    for name, low, hint in (
        ("num_records", 0, " (0 = all)"),
        ("max_len", 2, ""),
        ("shard_mb", 1, ""),
        ("batch_tokens", max(cfg.max_len, 1), f" (one sample of --max-len {cfg.max_len})"),
    ):
        if (v := getattr(cfg, name)) < low:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least {low}{hint}, got {v}")
    if not (math.isfinite(cfg.time_limit) and cfg.time_limit >= 0):
        raise SystemExit(f"error: --time-limit must be a finite number at least 0 (0 = none), got {cfg.time_limit}")
    if len(set(cfg.aux_layers)) != len(cfg.aux_layers) or any(i < 0 for i in cfg.aux_layers):
        raise SystemExit(f"error: --aux-layers {' '.join(map(str, cfg.aux_layers))}: distinct layer indices, 0 or more")
    check_inputs(cfg.target, cfg.data)
    check_store_out(Path(cfg.out))


def features(cfg: FeaturesConfig) -> dict:
    check_features(cfg)
    check_out(Path(cfg.out), is_dir=True)
    kind, dtype = pick_device(cfg.device, cfg.dtype)
    t_start = time.time()
    rank, world, local = init_distributed(kind)
    device = torch.device(kind, local) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    target = None
    try:
        if rank == 0:
            resolve_target(cfg.target)  # a GGUF is converted once, by rank 0
        barrier()
        target_dir = resolve_target(cfg.target)
        check_context(target_dir, cfg.max_len, "--max-len")  # a stored row is one target forward
        tokenizer = load_tokenizer(target_dir)
        stats = Counter()
        records = load_records(cfg.data, cfg.num_records or None)
        if not records:  # an empty store would otherwise be marked complete
            raise DataError(f"{cfg.data}: no records to capture (the file is empty)")
        examples = build_examples(records, tokenizer, cfg.max_len, stats)
        target = load_target(
            cfg.backend, target_dir, list(cfg.aux_layers) or None, dtype, device, cfg.max_len, vllm_target
        )
        H = target.config.hidden_size
        bytes_per_token = (len(target.aux_layers) + 1) * H * dtype.itemsize + 4 + 1
        data = {
            "data": cfg.data,
            "num_records": cfg.num_records,
            "records": len(records),
            "max_len": cfg.max_len,
            "num_examples": len(examples),
            "tokens_sha": tokens_digest(examples),
            "stats": dict(stats),
        }
        schema = feature_schema(target_identity(target), target.aux_layers, H, dtype, data)
        schema["shard_tokens"] = max(1, cfg.shard_mb * 2**20 // bytes_per_token)
        store = FeatureStore(cfg.out, schema, writer=f"{socket.gethostname()}-rank{rank}")
        store.clean_temps()
        plan = plan_shards([len(e.input_ids) for e in examples], schema["shard_tokens"])
        mine = plan[rank::world]
        todo = [s for s in mine if s[0] not in store]
        say(
            f"[capture] {len(examples)} samples ({sum(len(e.input_ids) for e in examples)} tokens) in "
            f"{len(plan)} shards; {world} rank(s); rank 0 has {len(todo)}/{len(mine)} shards to do; "
            f"{dtype}, target {target_dir} ({cfg.backend})"
        )
        t0, tokens, nbytes, done, last = time.time(), 0, 0, 0, 0.0
        stopped = False
        for key, first, count in todo:
            if cfg.time_limit and time.time() - t_start + last > cfg.time_limit:
                stopped = True
                break
            ts = time.time()
            part = examples[first : first + count]
            tensors = capture_examples(target, part, cfg.batch_tokens, device)
            path = store.put(
                key,
                tensors,
                meta={"target_path": str(target_dir), "backend": cfg.backend},
                samples=[(first + j, len(e.input_ids)) for j, e in enumerate(part)],
            )
            n = int(tensors["input_ids"].numel())
            tokens, nbytes, done, last = tokens + n, nbytes + path.stat().st_size, done + 1, time.time() - ts
            say(f"[capture] rank 0: shard {done}/{len(todo)} {key}: {n} tokens, {n / last:.0f} tok/s")
        secs = time.time() - t0
        tot = all_sum(torch.tensor([tokens, nbytes, done, int(stopped)], dtype=torch.float64))
        rate = all_sum(torch.tensor([tokens / max(secs, 1e-9)], dtype=torch.float64))
        res = {
            "tokens": int(tot[0]),
            "bytes": int(tot[1]),
            "shards_written": int(tot[2]),
            "tokens_per_s": float(rate[0]),
            "bytes_per_token": float(tot[1] / max(tot[0], 1)),
            "seconds": secs,
            "complete": len(store.keys()) == len(plan),
            "stopped_by_time_limit": bool(tot[3]),
        }
        say(
            f"[capture] {res['tokens']} tokens in {secs:.1f} s: {res['tokens_per_s']:.0f} tok/s over {world} "
            f"rank(s), {res['bytes_per_token']:.0f} bytes/token; "
            f"store {cfg.out}: {len(store.keys())}/{len(plan)} shards"
            + ("" if res["complete"] else " (incomplete: rerun the same command to resume)")
        )
        if rank == 0:
            meta = run_metadata(cfg, world=world, device=device, extra={"results": res})
            with open(Path(cfg.out) / "capture_runs.jsonl", "a") as f:
                f.write(json.dumps(meta, default=str) + "\n")
            print(json.dumps({"capture": res}), flush=True)
        return res
    finally:
        if hasattr(target, "close"):  # --backend vllm: the engine process
            target.close()
        destroy()


# ====================================================================== regenerate
@dataclass
class RegenConfig:
    """The target writes new assistant turns for --data's conversations. Exit 0 when every conversation is done
    (or --max-output-mb stopped it, as asked), 75 when --time-limit stopped it first (rerun to resume), 1 on an
    error."""

    target: str = DEFAULT_TARGET
    """HF causal-LM directory, a .gguf file, or 'smollm2'"""
    data: str = SHAREGPT
    """'sharegpt', a .json/.jsonl(.gz)/.parquet file or directory (ShareGPT or messages style)"""
    out: str = "runs/regen/sharegpt.jsonl"
    """output JSONL (appended; rerun to resume)"""
    num_records: int = 0
    """records read from the data (0 = all)"""
    max_turns: int = 0
    """assistant turns regenerated per conversation; later turns are dropped (0 = all)"""
    max_new_tokens: int = 512
    max_prompt_len: int = 2048
    """a turn whose prompt is longer ends the conversation there (counted)"""
    temperature: float = 0.0
    """0 = greedy"""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off"""
    seed: int = 0
    batch_size: int = 64
    """--engine hf: conversations generated together (left-padded)"""
    engine: str = "auto"
    """slots: continuous batching on the compiled target's layers (models/generate.py; Llama / Qwen
    families) | hf: transformers' generate over batches of conversations | auto: slots on a GPU
    when the architecture is supported, else hf"""
    slots: int = 512
    """--engine slots: requests decoded together (each holds a KV cache of max_prompt_len +
    max_new_tokens positions)"""
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32"""
    time_limit: float = 0
    """seconds since start; stop cleanly before exceeding it (an unfinished batch is discarded; rerun to resume);
    exit 75 when it stops so"""
    max_output_mb: float = 0
    """stop cleanly once the output JSONL is larger (0 = no limit)"""
    device: str = "auto"


# settings that change what is generated: a resumed run must use the same ones
_SAME_ON_RESUME = (
    "target_fingerprint",
    "data",
    "max_turns",
    "max_new_tokens",
    "max_prompt_len",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "dtype",
)


def conversation_ids(records: list[dict]) -> list[str]:
    """The record's 'id' (or its index); a repeated id gets '#index' appended."""
    seen, out = set(), []
    for i, r in enumerate(records):
        rid = str(r["id"]) if r.get("id") is not None else str(i)
        if rid in seen:
            rid = f"{rid}#{i}"
        seen.add(rid)
        out.append(rid)
    return out


def reply_slots(messages: list[dict], max_turns: int = 0) -> list[list[dict]]:
    """The non-assistant messages before each assistant reply to generate. A reply is due wherever
    the original has an assistant turn after new user input, and after trailing user input;
    assistant turns with no new user input before them (leading or repeated) are dropped."""
    groups, cur = [], []
    for m in messages:
        if m["role"] != "assistant":
            cur.append(m)
        elif any(x["role"] == "user" for x in cur):
            groups.append(cur)
            cur = []
    if any(x["role"] == "user" for x in cur):
        groups.append(cur)
    return groups[:max_turns] if max_turns else groups


class _Deadline:
    """A generate() stopping criterion that ends every sequence once time is up."""

    def __init__(self, deadline: float | None):
        self.deadline, self.hit = deadline, False

    def __call__(self, input_ids, scores, **kw):
        self.hit = self.hit or (self.deadline is not None and time.time() > self.deadline)
        return torch.full((input_ids.shape[0],), self.hit, dtype=torch.bool, device=input_ids.device)


def stop_ids(model, tokenizer) -> list[int]:
    """The generation config's EOS ids (an HF model's, or the compiled target's directory's) and
    the tokenizer's."""
    gc = getattr(model, "generation_config", None)
    if gc is None:
        from transformers import GenerationConfig

        gc = (
            GenerationConfig.from_pretrained(model.path)
            if (Path(model.path) / "generation_config.json").exists()
            else GenerationConfig()
        )
    ids = gc.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_batch(
    model, tokenizer, prompts: list[list[int]], cfg: RegenConfig, stopper=None
) -> list[tuple[list[int], bool]]:
    """Left-padded batch generation. Returns per prompt (new token ids before the first stop
    token, whether max_new_tokens was hit without a stop token)."""
    from transformers import GenerationConfig, StoppingCriteriaList

    eos = stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p) :] = torch.tensor(p)
        mask[b, T - len(p) :] = 1
    kw = (
        dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
        if cfg.temperature > 0
        else dict(do_sample=False)
    )
    gc = GenerationConfig(max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=pad, **kw)
    dev = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(dev),
        attention_mask=mask.to(dev),
        generation_config=gc,
        stopping_criteria=StoppingCriteriaList([stopper]) if stopper else None,
    )
    res = []
    for row in out[:, T:].tolist():
        cut = next((j for j, t in enumerate(row) if t in eos), None)
        res.append((row[:cut] if cut is not None else row, cut is None and len(row) >= cfg.max_new_tokens))
    return res


def turn_prompt(tokenizer, st: dict, slot: list[dict], j: int, cfg: RegenConfig) -> list[int] | None:
    """Token ids of reply j's prompt (the conversation so far + slot j's new messages), or None
    (and st["failed"] set) when it is over max_prompt_len. st: one conversation's state."""
    msgs = st["messages"] + slot
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    p = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(p) > cfg.max_prompt_len:
        st["failed"] = ("prompt_too_long", j)
        return None
    st["pending"] = msgs
    return p


def take_reply(tokenizer, st: dict, j: int, new: list[int], hit: bool):
    """Reply j (token ids) joins the conversation; an empty one ends it."""
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    if not text:
        st["failed"] = ("empty_output", j)
        return
    st["messages"] = st.pop("pending") + [{"role": "assistant", "content": text}]
    st["new_tokens"] += len(new)
    st["hit_max"] += int(hit)


def new_state() -> dict:
    return {"messages": [], "failed": None, "new_tokens": 0, "hit_max": 0}


def conversation_result(cid: str, slots: list, st: dict) -> tuple[dict | None, dict | None]:
    """(record, None) for a conversation with at least one reply, else (None, dropped)."""
    if not slots:
        return None, {"id": cid, "reason": "no_user_turn", "turn": 0}
    if st["failed"] and st["failed"][1] == 0:
        return None, {"id": cid, "reason": st["failed"][0], "turn": 0}
    rec = {
        "id": cid,
        "messages": st["messages"],
        "turns": sum(m["role"] == "assistant" for m in st["messages"]),
        "new_tokens": st["new_tokens"],
        "hit_max_new_tokens": st["hit_max"],
    }
    if st["failed"]:  # kept up to the turn the target could not continue
        rec["cut"], rec["cut_at_turn"] = st["failed"]
    return rec, None


def regenerate_batch(model, tokenizer, convs: list[tuple[str, list[dict]]], cfg: RegenConfig, stopper=None):
    """--engine hf: regenerate every reply of a batch of conversations, turn by turn (all
    conversations' turn j in one generate call). Returns (records, dropped), or None if the
    stopper fired."""
    slots = [reply_slots(m, cfg.max_turns) for _, m in convs]
    state = [new_state() for _ in convs]
    for j in range(max(map(len, slots), default=0)):
        active, prompts = [], []
        for i, st in enumerate(state):
            if (
                j < len(slots[i])
                and not st["failed"]
                and (p := turn_prompt(tokenizer, st, slots[i][j], j, cfg)) is not None
            ):
                active.append(i)
                prompts.append(p)
        if not active:
            continue
        outs = generate_batch(model, tokenizer, prompts, cfg, stopper)
        if stopper is not None and stopper.hit:
            return None
        for i, (new, hit) in zip(active, outs):
            take_reply(tokenizer, state[i], j, new, hit)
    records, dropped = [], []
    for (cid, _), sl, st in zip(convs, slots, state):
        rec, drop = conversation_result(cid, sl, st)
        (records if rec else dropped).append(rec or drop)
    return records, dropped


def regenerate_slots(gen, tokenizer, convs: list[tuple[str, list[dict]]], cfg: RegenConfig, emit, stop):
    """--engine slots: every conversation's turns through one continuous-batching generator
    (models/generate.SlotGenerator). A conversation's next turn is queued ahead of new
    conversations as soon as its reply is back; emit(records, dropped) receives conversations
    as they complete. stop() is asked after every step; True abandons the conversations in
    flight (a rerun redoes them). Returns True if it ran to the end."""
    todo = iter(convs)
    live: dict[str, tuple[list, dict, list]] = {}  # cid -> (slots, state, [turn j])

    def advance(cid: str) -> tuple | None:
        """Queue the conversation's next turn and return None; with no turn left (or a prompt over
        max_prompt_len) it is finished: returns conversation_result's (record, dropped)."""
        slots, st, j = live[cid]
        while j[0] < len(slots) and not st["failed"]:
            p = turn_prompt(tokenizer, st, slots[j[0]], j[0], cfg)
            if p is not None:
                gen.add(cid, p, front=True)
                return
        live.pop(cid)
        return conversation_result(cid, slots, st)

    def start_more():
        recs, drops = [], []
        while len(gen.waiting) < gen.S:
            nxt = next(todo, None)
            if nxt is None:
                break
            cid, msgs = nxt
            live[cid] = (reply_slots(msgs, cfg.max_turns), new_state(), [0])
            if (res := advance(cid)) is not None:
                (recs if res[0] else drops).append(res[0] or res[1])
        return recs, drops

    emit(*start_more())
    while gen.busy():
        recs, drops = [], []
        for cid, new, hit in gen.step():
            slots, st, j = live[cid]
            take_reply(tokenizer, st, j[0], new, hit)
            j[0] += 1
            if (res := advance(cid)) is not None:
                (recs if res[0] else drops).append(res[0] or res[1])
        more = start_more()
        emit(recs + more[0], drops + more[1])
        if stop():
            return False
    return True


def _sidecars(out: Path) -> tuple[Path, Path]:
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(stem + ".dropped.jsonl"), out.with_name(stem + ".provenance.json")


def _provenance(out: Path, command: str) -> dict | None:
    """The provenance beside --out of an earlier `capture.py COMMAND` (None: no earlier run). Resuming
    repairs and rewrites --out and its .dropped.jsonl, so they must be this command's own: an existing
    --out or .dropped.jsonl without its provenance, or with another command's or a damaged one, is
    refused and left as it is."""
    dropped_path, prov_path = _sidecars(out)
    if not prov_path.exists():
        if found := [p for p in (out, dropped_path) if p.exists() and (not p.is_file() or p.stat().st_size)]:
            raise SystemExit(
                f"error: --out {out}: {found[0]} exists but was not written by capture.py {command} (no "
                f"{prov_path.name} beside it), so it is not resumed or changed: use another --out, or move it aside"
            )
        return None
    try:
        prov = json.loads(prov_path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"error: {prov_path} is damaged or unreadable ({type(e).__name__}: {e}); {out} is left as it is: "
            "use another --out, or move them aside"
        ) from None
    # regenerate records its "source" data; prompts counts the "batches" it sampled
    mine = {"regenerate": lambda p: "source" in p, "prompts": lambda p: "batches" in (p.get("counts") or {})}[command]
    if not (isinstance(prov, dict) and isinstance(prov.get("settings"), dict) and mine(prov)):
        raise SystemExit(
            f"error: --out {out}: {prov_path} is not the provenance of capture.py {command} output, so {out} is "
            "not resumed or changed: use another --out"
        )
    return prov


def _read_jsonl_repair(path: Path) -> list[dict]:
    """Lines of a JSONL this command appends to (_provenance checked that it is ours). A last line without
    its newline is a crash mid-write: cut off when it is not whole JSON, else kept and given its newline."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1
        try:
            json.loads(raw[keep:])
            whole = True
        except ValueError:
            whole = False
        if whole:
            with open(path, "ab") as f:
                f.write(b"\n")
            raw += b"\n"
        else:
            print(f"[regen] {path}: dropping a partial last line ({len(raw) - keep} bytes)", flush=True)
            with open(path, "r+b") as f:
                f.truncate(keep)
            raw = raw[:keep]
    rows = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:  # not a crash mid-write: the file was damaged or mixed; keep it as it is
            raise SystemExit(
                f"error: {path}:{n}: not a JSON line ({e.msg}); nothing was changed. Fix or remove that line "
                f"(or move the file aside to start over) and rerun to resume"
            ) from None
    return rows


def _append(path: Path, rows: list[dict]):
    if not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _counts(records: list[dict], dropped: list[dict], source_total: int) -> dict:
    c = Counter(f"dropped_{d['reason']}" for d in dropped)
    c.update(f"cut_{r['cut']}" for r in records if r.get("cut"))
    return {
        "source_conversations": source_total,
        "written": len(records),
        "dropped": len(dropped),
        "remaining": source_total - len(records) - len(dropped),
        "turns": sum(r["turns"] for r in records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "turns_hit_max_new_tokens": sum(r["hit_max_new_tokens"] for r in records),
        **dict(sorted(c.items())),
    }


def pick_engine(engine: str, target_dir: Path, device_kind: str) -> str:
    from models.fast_target import FAMILIES  # fast_target imports flex attention and dynamo (seconds): regenerate only

    if engine not in ("auto", "slots", "hf"):
        raise SystemExit(f"error: --engine must be auto, slots or hf, got {engine!r}")
    model_type = json.loads((target_dir / "config.json").read_text()).get("model_type")
    if engine == "slots" and model_type not in FAMILIES:
        raise SystemExit(
            f"error: --engine slots runs {', '.join(FAMILIES)} targets; this one is {model_type!r} (use --engine hf)"
        )
    if engine == "auto":
        return "slots" if device_kind == "cuda" and model_type in FAMILIES else "hf"
    return engine


def check_regen(cfg: RegenConfig):
    """Option values that cannot work, one `error:` line each, before the target or data load (--batch-size 0
    was a traceback mid-run, --max-new-tokens 0 wrote empty replies)."""
    at_least = {"batch_size": 1, "max_new_tokens": 1, "max_prompt_len": 1, "slots": 1, "num_records": 0}
    at_least |= {"max_turns": 0, "top_k": 0}
    for name, low in at_least.items():
        if (v := getattr(cfg, name)) < low:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least {low}, got {v}")
    if cfg.engine not in ("auto", "slots", "hf"):  # (was refused only after the target had loaded)
        raise SystemExit(f"error: --engine must be auto, slots or hf, got {cfg.engine!r}")
    for name, ok, rng in (
        ("temperature", lambda v: v >= 0, "at least 0 (0 = greedy)"),
        ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
        ("time_limit", lambda v: v >= 0, "at least 0 (0 = none)"),
        ("max_output_mb", lambda v: v >= 0, "at least 0 (0 = no limit)"),
    ):
        if not (math.isfinite(v := getattr(cfg, name)) and ok(v)):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a finite number {rng}, got {v}")


def check_context(target_dir: Path, tokens: int, what: str):
    """A generation length past the target's context, refused before it loads: the hf engine decoded past it for
    as long as asked, the slots engine sized every slot's KV cache by it."""
    if why := past_context(target_dir, tokens, what):
        raise SystemExit("error: " + why)


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


def regenerate(cfg: RegenConfig) -> dict:
    from transformers import AutoModelForCausalLM

    check_regen(cfg)
    check_inputs(cfg.target, cfg.data)
    check_out(Path(cfg.out), is_dir=False)
    t_start = time.time()
    deadline = t_start + cfg.time_limit if cfg.time_limit else None
    kind, dtype = pick_device(cfg.device, cfg.dtype)
    device = torch.device(kind)
    target_dir = resolve_target(cfg.target)
    check_context(target_dir, cfg.max_new_tokens, "--max-new-tokens")
    if (ctx := target_context(target_dir)) and cfg.max_prompt_len + cfg.max_new_tokens > ctx:
        # a prompt and its reply share the context: past it the target decodes positions it never saw
        if (fit := ctx - cfg.max_new_tokens) < 1:
            raise SystemExit(
                f"error: --max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the "
                f"target's context of {ctx} tokens"
            )
        print(
            f"[regen] prompts up to {fit} tokens: the target's context ({ctx}) less --max-new-tokens "
            f"({cfg.max_new_tokens}), under --max-prompt-len {cfg.max_prompt_len}; a longer turn ends its "
            "conversation there (prompt_too_long)",
            flush=True,
        )
        cfg = replace(cfg, max_prompt_len=fit)
    tokenizer = load_tokenizer(target_dir)
    records = load_records(cfg.data, cfg.num_records or None)
    if not records:  # e.g. a prompts file that an earlier step left empty: say so instead of "complete"
        raise DataError(f"{cfg.data}: no conversations to regenerate (the file is empty)")
    ids = conversation_ids(records)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dropped_path, prov_path = _sidecars(out)
    settings = {
        "target": cfg.target,
        "target_path": str(target_dir),
        "target_fingerprint": fingerprint(target_dir),
        **{
            k: getattr(cfg, k)
            for k in (
                "data",
                "num_records",
                "max_turns",
                "max_new_tokens",
                "max_prompt_len",
                "temperature",
                "top_p",
                "top_k",
                "seed",
                "batch_size",
                "max_output_mb",
                "engine",
                "slots",
            )
        },
        "dtype": str(dtype).removeprefix("torch."),
    }
    prov = _provenance(out, "regenerate")
    if prov is not None:
        diff = {
            k: (prov["settings"].get(k), settings[k]) for k in _SAME_ON_RESUME if prov["settings"].get(k) != settings[k]
        }
        if diff:
            raise SystemExit(f"error: {out} was generated with other settings {diff} (old, new): use another --out")
    done_records, done_dropped = _read_jsonl_repair(out), _read_jsonl_repair(dropped_path)
    out.touch()
    dropped_path.touch()
    done = {r["id"] for r in done_records} | {d["id"] for d in done_dropped}
    pending = [(cid, rec) for cid, rec in zip(ids, records) if cid not in done]
    print(
        f"[regen] {len(records)} conversations from {cfg.data}: {len(done)} done before, {len(pending)} to do; "
        f"target {target_dir} ({dtype}, {kind})",
        flush=True,
    )

    engine = settings["engine"] = pick_engine(cfg.engine, target_dir, kind)
    if engine == "slots":
        from models.fast_target import FastTarget  # (deferred: see pick_engine)

        model = FastTarget.from_pretrained(target_dir, dtype=dtype, device=device)
    else:
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    print(
        f"[regen] engine {engine}"
        + (f", {cfg.slots} slots" if engine == "slots" else f", batches of {cfg.batch_size}"),
        flush=True,
    )
    torch.manual_seed(cfg.seed + len(done))  # a resumed sampling run continues with a fresh stream
    runs = (prov or {}).get("runs", [])
    run = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": socket.gethostname(),
        "hardware": hardware(device),
        "versions": versions(),
        "git_commit": git_commit(),
        "done_before": len(done),
    }

    def write_provenance(status: str):
        run.update(
            status=status, seconds=round(time.time() - t_start, 1), updated=time.strftime("%Y-%m-%d %H:%M:%S %Z")
        )
        doc = {
            "output": out.name,
            "dropped": dropped_path.name,
            "model": {
                "spec": cfg.target,
                "path": str(target_dir),
                "name": getattr(model.config, "_name_or_path", ""),
                "fingerprint": settings["target_fingerprint"],
            },
            "source": {"data": cfg.data, "num_records": cfg.num_records, "conversations": len(records)},
            "settings": settings,
            "counts": _counts(done_records, done_dropped, len(records)),
            "runs": runs + [run],
        }
        tmp = prov_path.with_name(prov_path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
        os.replace(tmp, prov_path)
        return doc

    # conversations in dataset order, sorted by length inside windows of 8 batches (less padding;
    # a time-limited run still covers the dataset's head evenly)
    convs = []
    for rec_id, rec in pending:
        try:
            convs.append((rec_id, to_messages(rec)))
        except DataError as e:
            raise DataError(f"record {rec_id}: {e}") from e
    W = cfg.batch_size * 8
    ordered = []
    for w in range(0, len(convs), W):
        ordered += sorted(convs[w : w + W], key=lambda c: sum(len(m["content"]) for m in c[1][:2]))
    batches = [ordered[i : i + cfg.batch_size] for i in range(0, len(ordered), cfg.batch_size)]

    status, t0, new_tok, last = "complete", time.time(), 0, 0.0
    write_provenance("running")

    def progress(label: str, n_left: int):
        el = time.time() - t0
        c = write_provenance("running")["counts"]
        n_done = c["written"] + c["dropped"] - len(done)
        eta = el / max(n_done, 1) * n_left
        print(
            f"[regen] {label}: {c['written']} written, {c['dropped']} dropped, {c['remaining']} remaining; "
            f"{new_tok} new tokens, {new_tok / el:.0f} tok/s; {el:.0f} s, eta {eta:.0f} s",
            flush=True,
        )

    def over_size() -> bool:
        return bool(cfg.max_output_mb) and out.exists() and out.stat().st_size > cfg.max_output_mb * 1e6

    def record(recs: list[dict], drops: list[dict]):
        """Finished conversations: appended to the output (and the dropped file) at once."""
        nonlocal new_tok
        _append(out, recs)
        _append(dropped_path, drops)
        done_records.extend(recs)
        done_dropped.extend(drops)
        new_tok += sum(r["new_tokens"] for r in recs)

    if engine == "slots":
        from models.generate import Sampling, SlotGenerator  # (deferred: see pick_engine)

        gen = SlotGenerator(
            model,
            cfg.slots,
            cfg.max_prompt_len,
            cfg.max_new_tokens,
            stop_ids(model, tokenizer),
            Sampling(cfg.temperature, cfg.top_p, cfg.top_k),
            seed=cfg.seed + len(done),
        )
        last_print = [time.time()]

        def emit(recs, drops):
            record(recs, drops)
            if time.time() - last_print[0] > 30:
                last_print[0] = time.time()
                progress(f"step {gen.steps}", len(pending) - (len(done_records) + len(done_dropped) - len(done)))

        def stop() -> bool:
            nonlocal status
            if deadline is not None and time.time() > deadline:
                status = "stopped_by_time_limit"  # conversations in flight are dropped; a rerun redoes them
            elif over_size():
                status = "stopped_by_size_limit"
            return status != "complete"

        if not over_size():
            regenerate_slots(gen, tokenizer, ordered, cfg, emit, stop)
        else:
            status = "stopped_by_size_limit"
    for bi, batch in enumerate(batches if engine == "hf" else []):
        if deadline is not None and time.time() + last > deadline:
            status = "stopped_by_time_limit"
            break
        if over_size():
            status = "stopped_by_size_limit"
            break
        tb = time.time()
        res = regenerate_batch(model, tokenizer, batch, cfg, _Deadline(deadline))
        if res is None:
            status = "stopped_by_time_limit"  # the unfinished batch is discarded; a rerun redoes it
            break
        record(*res)
        last = time.time() - tb
        progress(f"batch {bi + 1}/{len(batches)}", max(0, len(convs) - (bi + 1) * cfg.batch_size))
    el = time.time() - t0
    run.update(generate_seconds=round(el, 2), new_tokens=new_tok, tokens_per_s=round(new_tok / max(el, 1e-9)))
    doc = write_provenance(status)
    print(f"[regen] {status}: {json.dumps(doc['counts'])}", flush=True)
    print(f"[regen] wrote {out}, {dropped_path.name}, {prov_path.name}", flush=True)
    return doc


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
    dropped_path, prov_path = _sidecars(out)
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
    prov = _provenance(out, "prompts")
    if prov is not None:
        diff = {
            k: (old, settings[k])
            for k in _PROMPTS_SAME_ON_RESUME
            # files written before --user-prefix existed had none
            if (old := prov["settings"].get(k, [] if k == "user_prefix" else None)) != settings[k]
        }
        if diff:
            raise SystemExit(f"error: {out} was written with other settings {diff} (old, new): use another --out")
    kept, dropped, partial = _whole_batches(_read_jsonl_repair(out), _read_jsonl_repair(dropped_path))
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
        _append(dropped_path, new_dropped)  # a crash between the two appends leaves a partial batch: redone
        _append(out, new_kept)
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
    """stop_ids without loading a model first: the directory's generation config and the tokenizer's EOS."""
    from types import SimpleNamespace

    return stop_ids(SimpleNamespace(path=str(target_dir)), tokenizer)


def exit_status(res: dict) -> int:
    """0: finished; EXIT_STOPPED: --time-limit stopped it unfinished (features: the store is incomplete; regenerate,
    prompts: their provenance's last run), so a script tells it from a finished run (both exited 0)."""
    if "complete" in res:  # features
        return 0 if res["complete"] else EXIT_STOPPED
    return EXIT_STOPPED if res["runs"][-1]["status"] == "stopped_by_time_limit" else 0


def main():
    import tyro

    cfg = tyro.extras.subcommand_cli_from_dict(
        {"features": FeaturesConfig, "regenerate": RegenConfig, "prompts": PromptsConfig}, description=__doc__
    )
    try:
        if isinstance(cfg, FeaturesConfig):
            res = features(cfg)
        elif isinstance(cfg, PromptsConfig):
            res = write_prompts(cfg)
        else:
            res = regenerate(cfg)
    except (DataError, FileNotFoundError, StoreError) as e:
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # what was written is whole: appended lines and shards are committed one by one
        print("\ninterrupted (SIGINT): rerun the same command to resume", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    if code := exit_status(res):
        raise SystemExit(code)


if __name__ == "__main__":
    main()
