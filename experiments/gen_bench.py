"""Generation speed of the slot engine (models/generate.py), back to back on one machine: eager
decode steps (plain attention), CUDA graphs (plain attention, one graph per cache bucket) and CUDA
graphs with flex attention (each slot reads its own length; the default on CUDA): the same first
user turns of the packaged ShareGPT chats, greedy, through SlotGenerator directly (what
`capture.py regenerate --engine slots` runs).

    python3 experiments/gen_bench.py --target /tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf --out rows.jsonl

Each row: new tokens/s, decode steps/s, the bytes one decode step reads (every weight once, plus
the K and V cache blocks each slot's attention reads) and the share of the GPU's memory bandwidth
that reaches; the later rows also say how many of their replies equal the first mode's (bf16: a
near-tie can round differently between two runs of different kernels, so not all need to).
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cli_options import DataOption, TargetOption  # noqa: E402
from core.prompts import stop_ids_for  # noqa: E402
from core.runlog import git_commit, hardware, versions  # noqa: E402
from data.datasets import load_records  # noqa: E402
from models.fast_target import FastTarget  # noqa: E402
from models.generate import SlotGenerator  # noqa: E402
from models.target import load_tokenizer, resolve_target  # noqa: E402

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}  # datasheet peaks (SXM)


@dataclass
class Args(DataOption, TargetOption):
    out: str = "experiments/results/gen_bench_h200.jsonl"
    requests: int = 2048
    """first user turns, each one request (more requests than slots keeps the slots full)"""
    slots: int = 512
    max_new_tokens: int = 512
    max_prompt_len: int = 512
    modes: tuple[str, ...] = ("eager", "graphs", "flex")
    """eager (plain attention, no graphs) | graphs (plain attention, CUDA graphs) | flex (flex attention,
    CUDA graphs)"""
    time_limit: float = 120
    """seconds per mode: stop taking finished requests after this (the rate counts what finished)"""
    device: str = "cuda"
    """cuda (bf16) | cpu (fp32: a smoke run; no graphs there)"""
    profile: int = 0
    """after the timed part of each mode, profile this many more decode steps (torch.profiler) and print the
    kernels and host ops that take the time (where a step goes: graph replay, sampling, prefill, syncs)"""


def first_turns(tokenizer, source: str, n: int, max_len: int) -> list[list[int]]:
    out = []
    for r in load_records(source, None):
        user = next(
            (m["content"] for m in r.get("messages") or [] if m.get("role") == "user" and m.get("content")), None
        )
        if not user:
            continue
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_len:
            out.append(ids)
        if len(out) == n:
            break
    return out


def sync(model):
    if model.lm_head.weight.is_cuda:
        torch.cuda.synchronize()


def profile_steps(gen: SlotGenerator, n: int, mode: str):
    """n more decode steps under torch.profiler: the ops and kernels that take the time, host and device."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        done = 0
        while gen.busy() and done < n:
            gen.step()
            done += 1  # a step() call decodes until a request finishes: sync_every decode steps or more
    print(f"[profile] {mode}: {done} step() calls", flush=True)
    # by device time (what the GPU runs), then by host time (what keeps the GPU waiting)
    sorts = (["self_cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]
    for sort in sorts:
        print(f"[profile] {mode}, sorted by {sort}", flush=True)
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)


def host_timers(gen: SlotGenerator) -> dict:
    """Wraps the generator's loop parts to sum the host seconds each takes (no sync added: the wait for the
    GPU shows up where the loop reads the device, in _harvest; _decode includes _graph_logits)."""
    acc: dict = {}
    for name in ("_fill", "_decode", "_graph_logits", "_harvest"):
        f = getattr(gen, name)

        def timed(*args, _f=f, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _f(*args, **kw)
            finally:
                acc[_name] = acc.get(_name, 0.0) + time.perf_counter() - t

        setattr(gen, name, timed)
    return acc


def run(model, prompts, eos, a: Args, mode: str) -> tuple[dict, dict]:
    graphs = mode != "eager" and model.lm_head.weight.is_cuda
    gen = SlotGenerator(
        model, a.slots, a.max_prompt_len, a.max_new_tokens, eos, cuda_graphs=graphs, flex=mode == "flex"
    )
    for i, p in enumerate(prompts):
        gen.add(i, p)
    # warm-up: the first buckets' graph captures (and cuBLAS set-up) happen here, not in the timing
    got, t_warm = {}, time.time()
    while gen.busy() and len(got) < a.slots // 4:
        got.update({k: t for k, t, _ in gen.step()})
    sync(model)
    warm_s, steps0, kv0, n0 = time.time() - t_warm, gen.steps, gen.kv_positions_read, sum(map(len, got.values()))
    host = host_timers(gen)
    t0 = time.time()
    while gen.busy() and time.time() - t0 < a.time_limit:
        got.update({k: t for k, t, _ in gen.step()})
    sync(model)
    sec = time.time() - t0
    host_s = {k: round(v, 2) for k, v in host.items()}
    new = sum(map(len, got.values())) - n0
    if a.profile and gen.busy():
        profile_steps(gen, a.profile, mode)
    c = model.config
    w_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes = (gen.kv_positions_read - kv0) * len(model.model.layers) * 2 * c.num_key_value_heads * c.head_dim * 2
    steps = gen.steps - steps0
    step_bytes = w_bytes + kv_bytes / max(steps, 1)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    row = {
        "what": "gen_bench",
        "mode": mode,
        "flex": gen.flex,  # False if the flex compile failed and the run fell back to plain attention
        "slots": a.slots,
        "requests_done": len(got),
        "new_tokens": new,
        "seconds": round(sec, 2),
        "tokens_per_s": round(new / sec),
        "steps_per_s": round(steps / sec, 1),
        "warmup_s": round(warm_s, 1),
        "graphs_captured": len(gen.graphs or {}),
        "bytes_per_step": round(step_bytes),
        "hbm_share": round(step_bytes * steps / sec / peak, 3) if peak else None,
        "host_s": host_s,  # of `seconds`, the host's time in each loop part (_harvest: waiting for the GPU)
    }
    return row, got


def main(a: Args):
    target_dir = resolve_target(a.target)
    tok = load_tokenizer(target_dir)
    eos = stop_ids_for(target_dir, tok)
    dev = torch.device(a.device)
    model = FastTarget.from_pretrained(
        target_dir, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev
    )
    prompts = first_turns(tok, a.data, a.requests, a.max_prompt_len)
    rows, outs = {}, {}
    meta = {"hardware": hardware(dev), "versions": versions(), "git_commit": git_commit()}
    for mode in a.modes:
        row, outs[mode] = run(model, prompts, eos, a, mode)
        ref = a.modes[0]  # the later modes against the first
        if mode != ref:
            common = outs[ref].keys() & outs[mode].keys()
            row[f"same_reply_as_{ref}"] = round(
                sum(outs[ref][k] == outs[mode][k] for k in common) / max(len(common), 1), 3
            )
            row[f"speedup_vs_{ref}"] = round(row["tokens_per_s"] / rows[ref]["tokens_per_s"], 2)
        row.update(
            meta, date=time.strftime("%Y-%m-%d"), command="python3 experiments/gen_bench.py " + " ".join(sys.argv[1:])
        )
        rows[mode] = row
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("hardware", "versions")}), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))
