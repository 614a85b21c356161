"""capture.py regenerate: the target writes new assistant turns for a dataset's conversations (every assistant
turn regenerated from the conversation so far, whose earlier assistant turns are the regenerated ones), appended to
a JSONL as batches finish and resumed by a rerun (capture.py's docstring says what is written and the exit codes).
Two engines: transformers' generate over batches (`hf`) and continuous batching on the compiled target
(`slots`, models/generate.py)."""

import json
import math
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from core.capture_io import append_rows, check_context, check_inputs, check_out, provenance, read_jsonl_repair, sidecars
from core.cli_options import DataOption, DeviceOption, DtypeOption, NumRecordsOption, SamplingOptions, TargetOption
from core.distributed import pick_device
from core.runlog import git_commit, hardware, versions
from data.chat import DataError, to_messages
from data.datasets import SHAREGPT, load_records
from models.target import eos_ids, fingerprint, load_tokenizer, resolve_target, target_context


# ====================================================================== the options both commands share
@dataclass
class GenerationOptions(DeviceOption, DtypeOption, SamplingOptions, TargetOption):
    """What the target generates with and where: capture.py regenerate (RegenConfig) and prompts
    (core/prompts.PromptsConfig) take these flags alike (--target, the sampling options, --dtype and --device are
    core/cli_options.py's groups)."""

    max_new_tokens: int = 512
    engine: str = "auto"
    """slots: continuous batching on the compiled target's layers (models/generate.py; Llama / Qwen
    families) | hf: transformers' generate over batches | auto: slots on a GPU when the architecture is
    supported, else hf"""
    time_limit: float = 0
    """seconds since start; stop cleanly there (prompts: before a batch that would pass it; regenerate: the
    unfinished batch is discarded); rerun to resume; exit 75 when it stops so (0 = none)"""


# ====================================================================== regenerate
@dataclass
class RegenConfig(NumRecordsOption, DataOption, GenerationOptions):
    """The target writes new assistant turns for --data's conversations. Exit 0 when every conversation is done
    (or --max-output-mb stopped it, as asked), 75 when --time-limit stopped it first (rerun to resume), 1 on an
    error."""

    data: str = SHAREGPT  # the original answers are the ones to replace
    """'sharegpt', a .json/.jsonl(.gz)/.parquet file or directory (ShareGPT or messages style)"""
    out: str = "runs/regen/sharegpt.jsonl"
    """output JSONL (appended; rerun to resume)"""
    max_turns: int = 0
    """assistant turns regenerated per conversation; later turns are dropped (0 = all)"""
    max_prompt_len: int = 2048
    """a turn whose prompt is longer ends the conversation there (counted)"""
    batch_size: int = 64
    """--engine hf: conversations generated together (left-padded)"""
    slots: int = 512
    """--engine slots: requests decoded together (each holds a KV cache of max_prompt_len +
    max_new_tokens positions)"""
    max_output_mb: float = 0
    """stop cleanly once the output JSONL is larger (0 = no limit)"""


# settings that change what is generated: a resumed run must use the same ones
_GENERATION = ("max_turns", "max_new_tokens", "max_prompt_len", "temperature", "top_p", "top_k", "seed")
_SAME_ON_RESUME = ("target_fingerprint", "data", *_GENERATION, "dtype")
# the options the provenance's settings record (in this order, after the target's entries)
_RECORDED = ("data", "num_records", *_GENERATION, "batch_size", "max_output_mb", "engine", "slots")

# the finite options both capture commands check: (option, ok(value), the range in words)
FINITE_OPTIONS = (
    ("temperature", lambda v: v >= 0, "at least 0 (0 = greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("time_limit", lambda v: v >= 0, "at least 0 (0 = none)"),
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


@torch.no_grad()
def generate_batch(
    model, tokenizer, prompts: list[list[int]], cfg: RegenConfig, stopper=None
) -> list[tuple[list[int], bool]]:
    """Left-padded batch generation. Returns per prompt (new token ids before the first stop
    token, whether max_new_tokens was hit without a stop token)."""
    from transformers import GenerationConfig, StoppingCriteriaList  # lazy: transformers (~1.5 s to import)

    eos = eos_ids(model, tokenizer)
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


def check_engine(engine: str):
    if engine not in ("auto", "slots", "hf"):
        raise SystemExit(f"error: --engine must be auto, slots or hf, got {engine!r}")


def pick_engine(engine: str, target_dir: Path, device_kind: str) -> str:
    from models.fast_target import FAMILIES  # fast_target imports flex attention and dynamo (seconds): regenerate only

    check_engine(engine)
    model_type = json.loads((target_dir / "config.json").read_text()).get("model_type")
    if engine == "slots" and model_type not in FAMILIES:
        raise SystemExit(
            f"error: --engine slots runs {', '.join(FAMILIES)} targets; this one is {model_type!r} (use --engine hf)"
        )
    if engine == "auto":
        return "slots" if device_kind == "cuda" and model_type in FAMILIES else "hf"
    return engine


def load_target_model(engine: str, target_dir: Path, dtype: torch.dtype, device: torch.device):
    """The target for `engine`: FastTarget (slots) or transformers' model (hf), in eval mode on device."""
    if engine == "slots":
        from models.fast_target import FastTarget  # (deferred: see pick_engine)

        return FastTarget.from_pretrained(target_dir, dtype=dtype, device=device)
    from transformers import AutoModelForCausalLM  # lazy: transformers (~1.5 s to import)

    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()


def check_at_least(cfg, at_least: dict[str, int]):
    """One `error:` line for the first option below its least value."""
    for name, low in at_least.items():
        if (v := getattr(cfg, name)) < low:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least {low}, got {v}")


def check_finite(cfg, rules):
    """rules: (option, ok(value), the range in words); NaN and infinity are refused too."""
    for name, ok, rng in rules:
        if not (math.isfinite(v := getattr(cfg, name)) and ok(v)):
            raise SystemExit(f"error: --{name.replace('_', '-')} must be a finite number {rng}, got {v}")


def check_regen(cfg: RegenConfig):
    """Option values that cannot work, one `error:` line each, before the target or data load (--batch-size 0
    was a traceback mid-run, --max-new-tokens 0 wrote empty replies)."""
    at_least = {"batch_size": 1, "max_new_tokens": 1, "max_prompt_len": 1, "slots": 1, "num_records": 0}
    at_least |= {"max_turns": 0, "top_k": 0}
    check_at_least(cfg, at_least)
    check_engine(cfg.engine)  # (was refused only after the target had loaded)
    check_finite(cfg, FINITE_OPTIONS + (("max_output_mb", lambda v: v >= 0, "at least 0 (0 = no limit)"),))


def check_resume(prov: dict | None, settings: dict, keys, out: Path, verb: str, defaults: dict | None = None):
    """A rerun onto an output (prov: its provenance, None when new) must use the same settings `keys`; defaults:
    what an older file that lacks a key had."""
    if prov is not None:
        diff = {
            k: (old, settings[k])
            for k in keys
            if (old := prov["settings"].get(k, (defaults or {}).get(k))) != settings[k]
        }
        if diff:
            raise SystemExit(f"error: {out} was {verb} with other settings {diff} (old, new): use another --out")


def write_json(path: Path, doc: dict):
    """path replaced by doc in one step (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


def end_run(run: dict, t0: float, new_tok: int):
    """The run's generation time and speed, measured from t0, into its provenance entry."""
    el = time.time() - t0
    run.update(generate_seconds=round(el, 2), new_tokens=new_tok, tokens_per_s=round(new_tok / max(el, 1e-9)))


def _fit_prompt_len(cfg: RegenConfig, target_dir: Path) -> RegenConfig:
    """cfg, its max_prompt_len lowered to what the target's context leaves beside max_new_tokens."""
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
    return cfg


def _regen_settings(cfg: RegenConfig, target_dir: Path, dtype: torch.dtype) -> dict:
    """The provenance's settings ("engine" is cfg.engine until the engine is picked)."""
    return {
        "target": cfg.target,
        "target_path": str(target_dir),
        "target_fingerprint": fingerprint(target_dir),
        **{k: getattr(cfg, k) for k in _RECORDED},
        "dtype": str(dtype).removeprefix("torch."),
    }


def _ordered_conversations(pending: list[tuple[str, dict]], batch_size: int) -> list[tuple[str, list[dict]]]:
    """(id, messages) of the pending records."""
    # conversations in dataset order, sorted by length inside windows of 8 batches (less padding;
    # a time-limited run still covers the dataset's head evenly)
    convs = []
    for rec_id, rec in pending:
        try:
            convs.append((rec_id, to_messages(rec)))
        except DataError as e:
            raise DataError(f"record {rec_id}: {e}") from e
    W = batch_size * 8
    ordered = []
    for w in range(0, len(convs), W):
        ordered += sorted(convs[w : w + W], key=lambda c: sum(len(m["content"]) for m in c[1][:2]))
    return ordered


class _RegenRun:
    """One regenerate run's output: the JSONL and its dropped file (every conversation finished, earlier runs'
    included, resumed from what they hold) and the provenance, rewritten as conversations finish."""

    def __init__(self, cfg: RegenConfig, target_dir: Path, settings: dict, prov: dict | None, n_source: int, t_start):
        self.cfg, self.target_dir, self.settings, self.n_source = cfg, target_dir, settings, n_source
        self.t_start = t_start  # when the command started
        self.out = Path(cfg.out)
        self.dropped_path, self.prov_path = sidecars(self.out)
        self.runs = (prov or {}).get("runs", [])  # earlier runs' entries
        self.done_records, self.done_dropped = read_jsonl_repair(self.out), read_jsonl_repair(self.dropped_path)
        self.out.touch()
        self.dropped_path.touch()
        self.done = {r["id"] for r in self.done_records} | {d["id"] for d in self.done_dropped}  # before this run
        self.run, self.model_name, self.status, self.t0, self.new_tok = {}, "", "complete", 0.0, 0

    def start(self, device: torch.device, model):
        """This run's provenance entry, before any conversation is generated."""
        self.model_name = getattr(model.config, "_name_or_path", "")
        self.run = {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": socket.gethostname(),
            "hardware": hardware(device),
            "versions": versions(),
            "git_commit": git_commit(),
            "done_before": len(self.done),
        }

    def write_provenance(self, status: str) -> dict:
        self.run.update(
            status=status, seconds=round(time.time() - self.t_start, 1), updated=time.strftime("%Y-%m-%d %H:%M:%S %Z")
        )
        cfg = self.cfg
        doc = {
            "output": self.out.name,
            "dropped": self.dropped_path.name,
            "model": {
                "spec": cfg.target,
                "path": str(self.target_dir),
                "name": self.model_name,
                "fingerprint": self.settings["target_fingerprint"],
            },
            "source": {"data": cfg.data, "num_records": cfg.num_records, "conversations": self.n_source},
            "settings": self.settings,
            "counts": _counts(self.done_records, self.done_dropped, self.n_source),
            "runs": self.runs + [self.run],
        }
        write_json(self.prov_path, doc)
        return doc

    def progress(self, label: str, n_left: int):
        el = time.time() - self.t0
        c = self.write_provenance("running")["counts"]
        n_done = c["written"] + c["dropped"] - len(self.done)
        eta = el / max(n_done, 1) * n_left
        print(
            f"[regen] {label}: {c['written']} written, {c['dropped']} dropped, {c['remaining']} remaining; "
            f"{self.new_tok} new tokens, {self.new_tok / el:.0f} tok/s; {el:.0f} s, eta {eta:.0f} s",
            flush=True,
        )

    def over_size(self) -> bool:
        return (
            bool(self.cfg.max_output_mb)
            and self.out.exists()
            and self.out.stat().st_size > self.cfg.max_output_mb * 1e6
        )

    def record(self, recs: list[dict], drops: list[dict]):
        """Finished conversations: appended to the output (and the dropped file) at once."""
        append_rows(self.out, recs)
        append_rows(self.dropped_path, drops)
        self.done_records.extend(recs)
        self.done_dropped.extend(drops)
        self.new_tok += sum(r["new_tokens"] for r in recs)

    def finish(self) -> dict:
        """The final provenance (status: why the run ended) and the closing lines."""
        end_run(self.run, self.t0, self.new_tok)
        doc = self.write_provenance(self.status)
        print(f"[regen] {self.status}: {json.dumps(doc['counts'])}", flush=True)
        print(f"[regen] wrote {self.out}, {self.dropped_path.name}, {self.prov_path.name}", flush=True)
        return doc


def _regenerate_on_slots(r: _RegenRun, model, tokenizer, ordered: list, n_pending: int, deadline: float | None):
    """--engine slots: the ordered conversations through regenerate_slots, until done or a limit stops it
    (r.status says which)."""
    from models.generate import Sampling, SlotGenerator  # (deferred: see pick_engine)

    cfg = r.cfg
    gen = SlotGenerator(
        model,
        cfg.slots,
        cfg.max_prompt_len,
        cfg.max_new_tokens,
        eos_ids(model, tokenizer),
        Sampling(cfg.temperature, cfg.top_p, cfg.top_k),
        seed=cfg.seed + len(r.done),
    )
    last_print = [time.time()]

    def emit(recs, drops):
        r.record(recs, drops)
        if time.time() - last_print[0] > 30:
            last_print[0] = time.time()
            r.progress(f"step {gen.steps}", n_pending - (len(r.done_records) + len(r.done_dropped) - len(r.done)))

    def stop() -> bool:
        if deadline is not None and time.time() > deadline:
            r.status = "stopped_by_time_limit"  # conversations in flight are dropped; a rerun redoes them
        elif r.over_size():
            r.status = "stopped_by_size_limit"
        return r.status != "complete"

    if not r.over_size():
        regenerate_slots(gen, tokenizer, ordered, cfg, emit, stop)
    else:
        r.status = "stopped_by_size_limit"


def _regenerate_in_batches(r: _RegenRun, model, tokenizer, ordered: list, deadline: float | None):
    """--engine hf: the ordered conversations in batches of --batch-size through regenerate_batch, until done or
    a limit stops it (r.status says which)."""
    bs = r.cfg.batch_size
    batches = [ordered[i : i + bs] for i in range(0, len(ordered), bs)]
    last = 0.0  # seconds the last batch took
    for bi, batch in enumerate(batches):
        if deadline is not None and time.time() + last > deadline:
            r.status = "stopped_by_time_limit"
            break
        if r.over_size():
            r.status = "stopped_by_size_limit"
            break
        tb = time.time()
        res = regenerate_batch(model, tokenizer, batch, r.cfg, _Deadline(deadline))
        if res is None:
            r.status = "stopped_by_time_limit"  # the unfinished batch is discarded; a rerun redoes it
            break
        r.record(*res)
        last = time.time() - tb
        r.progress(f"batch {bi + 1}/{len(batches)}", max(0, len(ordered) - (bi + 1) * bs))


def regenerate(cfg: RegenConfig) -> dict:
    check_regen(cfg)
    check_inputs(cfg.target, cfg.data)
    check_out(Path(cfg.out), is_dir=False)
    t_start = time.time()
    deadline = t_start + cfg.time_limit if cfg.time_limit else None
    kind, dtype = pick_device(cfg.device, cfg.dtype)
    device = torch.device(kind)
    target_dir = resolve_target(cfg.target)
    cfg = _fit_prompt_len(cfg, target_dir)
    tokenizer = load_tokenizer(target_dir)
    records = load_records(cfg.data, cfg.num_records or None)
    if not records:  # e.g. a prompts file that an earlier step left empty: say so instead of "complete"
        raise DataError(f"{cfg.data}: no conversations to regenerate (the file is empty)")
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = _regen_settings(cfg, target_dir, dtype)
    prov = provenance(out, "regenerate")
    check_resume(prov, settings, _SAME_ON_RESUME, out, "generated")
    r = _RegenRun(cfg, target_dir, settings, prov, len(records), t_start)
    pending = [(cid, rec) for cid, rec in zip(conversation_ids(records), records) if cid not in r.done]
    print(
        f"[regen] {len(records)} conversations from {cfg.data}: {len(r.done)} done before, {len(pending)} to do; "
        f"target {target_dir} ({dtype}, {kind})",
        flush=True,
    )

    engine = settings["engine"] = pick_engine(cfg.engine, target_dir, kind)
    model = load_target_model(engine, target_dir, dtype, device)
    print(
        f"[regen] engine {engine}"
        + (f", {cfg.slots} slots" if engine == "slots" else f", batches of {cfg.batch_size}"),
        flush=True,
    )
    torch.manual_seed(cfg.seed + len(r.done))  # a resumed sampling run continues with a fresh stream
    r.start(device, model)
    ordered = _ordered_conversations(pending, cfg.batch_size)
    r.t0 = time.time()
    r.write_provenance("running")
    if engine == "slots":
        _regenerate_on_slots(r, model, tokenizer, ordered, len(pending), deadline)
    else:
        _regenerate_in_batches(r, model, tokenizer, ordered, deadline)
    return r.finish()
