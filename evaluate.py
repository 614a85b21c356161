"""Acceptance evaluation: speculative decoding of the target with a draft (any family), in plain PyTorch.

    python evaluate.py runs/default                       # chain K=3 on MT-Bench, HumanEval, GSM8K
    python evaluate.py runs/default -k 7 --tree-topk 4 --tree-depth 5 --ngram --data mtbench

DRAFT is a training checkpoint (ckpt/step_N), a run dir (its latest checkpoint) or an exported
serving dir, of any family: EAGLE-3 drafts chain (-k) and tree (--tree-topk); P-EAGLE drafts its
K tokens in one parallel forward; DFlash, Domino and DSpark draft one block of K per step (K is the
draft's; -k k <= K verifies the first k of them, --tree-* do not apply). Prints per dataset τ (tokens
per target verification forward), the per-position acceptance rates, the draft cost per verification
step relative to a target forward c and the expected speed-up τ / (1 + c) (batch 1; core/speculative.py says
what is timed), and the baselines (plain decoding: τ = 1; n-gram prompt lookup with --ngram), and ends
with one JSON line. Every output is checked equal to plain greedy decoding of the
target when --check-greedy is set (costs one more decode per prompt).

Datasets (packaged): mtbench (80 questions x 2 turns; the second turn follows the model's own
first answer), humaneval (164 code prompts), gsm8k (1319 questions); or a JSONL file whose lines
hold "prompt", "turns" or "messages". Prompts are rendered with the target's chat template.
"""

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import torch
import tyro

from core.batched_chain import batched_generate
from core.distributed import DTYPES
from core.runlog import git_commit, hardware, output_kind, probe_write, versions
from core.speculative import NgramProposer, SpecStats, TargetRunner, proposer_for, speculative_generate
from core.vllm_spec import VllmError, run_job
from data.benchmarks import DATASETS, load_prompts
from data.chat import DataError, render
from data.vocab import coverage_rows
from export import ExportError, export, find_checkpoint, open_draft, target_mismatch, vllm_method
from models.families import FAMILIES
from models.proposer import Proposer
from models.target import eos_ids, load_tokenizer, resolve_target, target_context


def assert_greedy(target: TargetRunner, name: str, prompt: list[int], out: list[int], max_new: int, eos):
    """Raise unless `out` equals plain greedy decoding of the target after `prompt`."""
    ref, _ = speculative_generate(target, Proposer(), prompt, max_new, eos)
    if ref != out:
        i = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        raise AssertionError(f"{name}: output differs from greedy decoding at token {i}")


def split_halves(turns: list, convs: list[list[str]]) -> list[float]:
    """τ of the even- and of the odd-numbered conversations (turns: every conversation's turns in order,
    as run_dataset returns them): how far apart two halves of one set land is the noise a difference
    between two drafts on that set has to beat. Split by conversation, not turn: MT-Bench's second
    turns accept differently from its first."""
    halves, conv = [SpecStats(), SpecStats()], [c for c, turns_c in enumerate(convs) for _ in turns_c]
    for c, (_, _, s) in zip(conv, turns, strict=True):
        halves[c % 2].add(s)
    return [round(h.summary()["tau"], 4) for h in halves if h.summary()["target_forwards"]]


def run_dataset(
    target: TargetRunner, proposer: Proposer, tokenizer, convs: list[list[str]], max_new: int, eos, check_greedy=False
):
    """All turns of all conversations through one proposer. Returns (stats, seconds, turns)
    with turns = [(prompt ids, output ids, SpecStats)] (to replay the prompts elsewhere)."""
    st, t0, turns_out = SpecStats(), time.time(), []
    for turns in convs:
        msgs = []
        for user in turns:
            msgs.append({"role": "user", "content": user})
            prompt = render(tokenizer, msgs)
            out, s = speculative_generate(target, proposer, prompt, max_new, eos)
            if check_greedy:
                assert_greedy(target, proposer.name, prompt, out, max_new, eos)
            turns_out.append((prompt, out, s))
            st.add(s)
            text = tokenizer.decode(out, skip_special_tokens=True)
            msgs.append({"role": "assistant", "content": text})
    return st, time.time() - t0, turns_out


def run_dataset_batched(
    target: TargetRunner, proposer, tokenizer, convs: list[list[str]], max_new: int, eos, batch: int, check_greedy=False
):
    """run_dataset for a proposer that `batches` (EAGLE-3 chains, P-EAGLE, DFlash / DSpark / Domino blocks), `batch`
    conversations decoded at once (core/batched_chain.py); turn t of every conversation in a group runs in one batch."""
    st, t0, by_conv = SpecStats(), time.time(), [[] for _ in convs]
    for g in range(0, len(convs), batch):
        group = list(range(g, min(g + batch, len(convs))))
        msgs = {c: [] for c in group}
        for t in range(max(len(convs[c]) for c in group)):
            live = [c for c in group if t < len(convs[c])]
            prompts = []
            for c in live:
                msgs[c].append({"role": "user", "content": convs[c][t]})
                prompts.append(render(tokenizer, msgs[c]))
            rows, aux_layers = proposer.rows(), proposer.draft.config.aux_layers
            outs = batched_generate(target.model, rows, aux_layers, prompts, proposer.depth, max_new, eos)
            for c, prompt, (out, s) in zip(live, prompts, outs):
                if check_greedy:
                    assert_greedy(target, f"{proposer.name} (batched)", prompt, out, max_new, eos)
                by_conv[c].append((prompt, out, s))
                st.add(s)
                msgs[c].append({"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)})
    return st, time.time() - t0, [x for turns in by_conv for x in turns]


def vllm_agreement(
    draft_path: str,
    target_dir,
    k: int,
    turns: list[tuple[str, list[int], list[int], SpecStats]],
    max_new: int,
    out_dir: Path,
    family: str = "eagle3",
) -> dict:
    """Replay our prompts in vLLM (fp32, greedy, K drafts, one prompt at a time) and compare its
    vllm:spec_decode_* counters with ours, per dataset."""
    served = Path(draft_path)
    if not (served / "model.safetensors").exists():
        served = export(
            find_checkpoint(draft_path),
            out_dir / "export-vllm-fp32",
            engine="vllm",
            dtype="fp32",
            target=str(target_dir),
        )
    method, extra = vllm_method(family)
    job = {
        "target": str(target_dir),
        "draft": str(served),
        "k": k,
        "prompts": [p for _, p, _, _ in turns],
        "max_tokens": max_new,
        "dtype": "float32",
        "max_model_len": min(4096, target_context(target_dir) or 4096),  # vLLM refuses more than the target's
        "batch": False,
        "method": method,
        "speculative_extra": extra,
    }
    res = run_job(job, timeout=3600, log_path=out_dir / f"vllm_k{k}.log")
    agg: dict[str, dict] = {}
    for (ds, _, ours, st), theirs, m in zip(turns, res["outputs"], res["per_prompt"]):
        a = agg.setdefault(ds, {"ours": SpecStats(), "vllm": SpecStats(), "same_output": 0, "turns": 0})
        a["ours"].add(st)
        a["vllm"].add(
            SpecStats(
                drafts=m["num_drafts"],
                draft_tokens=m["num_draft_tokens"],
                accepted=m["num_accepted_tokens"],
                accepted_per_pos=m["accepted_per_pos"],
            )
        )
        a["same_output"] += int(ours == theirs)
        a["turns"] += 1
    out = {}
    for ds, a in agg.items():
        o, v = a["ours"].summary(), a["vllm"].summary()
        out[ds] = {
            "tau_ours": o["tau"],
            "tau_vllm": v["tau"],
            "rel_diff": abs(o["tau"] - v["tau"]) / o["tau"],
            "acceptance_per_pos_ours": o["acceptance_per_pos"],
            "acceptance_per_pos_vllm": v["acceptance_per_pos"],
            "identical_outputs": f"{a['same_output']}/{a['turns']}",
            "vllm_seconds": round(res["seconds"], 1),
        }
    return out


@dataclass
class EvalArgs:
    draft: tyro.conf.Positional[str]
    """training checkpoint, run dir, or exported serving dir"""
    target: str = ""
    """target (HF dir, .gguf or 'smollm2'); default: the one recorded with the draft"""
    data: tuple[str, ...] = DATASETS
    """datasets: mtbench humaneval gsm8k, or JSONL files of prompts"""
    num_prompts: int = 8
    """conversations per dataset (0 = all)"""
    max_new_tokens: int = 128
    k: Annotated[tuple[int, ...], tyro.conf.arg(aliases=("-k",))] = ()
    """draft tokens verified per step, several values: one run each (default: chains of 3 for EAGLE-3, the trained K
    for the families that draft a fixed K per forward, P-EAGLE / DFlash / Domino / DSpark; for those each value must
    be at most K: the first k of the K drafted are verified)"""
    tree_topk: int = 0
    """tree drafting: keep the top-k nodes per depth (0 = no tree run)"""
    tree_depth: int = 5
    min_survival: tuple[float, ...] = ()
    """DSpark drafts only: also decode with the confidence head's cut at each of these prefix-survival thresholds
    (a block is cut where the product of its confidences c_1..c_k drops below it: fewer tokens verified, the same
    greedy output), one run each, one conversation at a time, at every -k"""
    ngram: bool = False
    """also measure the draft-free n-gram (prompt lookup) baseline with the first K"""
    check_greedy: bool = False
    """assert every output equals plain greedy decoding (one more decode per prompt)"""
    dtype: str = "fp32"
    """fp32 (CPU) | bf16"""
    device: str = "cpu"
    """where target and draft decode (batch 1): cpu | cuda (verification keeps the outputs greedy-exact on
    either; near-ties can resolve differently between devices, so compare τ measured on one device)"""
    threads: int = 0
    """torch threads (0 = torch's default)"""
    batch: int = 1
    """EAGLE-3 chains, P-EAGLE and DFlash / DSpark / Domino blocks: decode this many conversations at once
    (core/batched_chain.py; same tokens and counters per conversation up to float rounding of the batched matmuls);
    EAGLE-3 trees, a DSpark confidence cut and n-gram lookup run one at a time"""
    vllm: bool = False
    """replay every chain run's prompts in vLLM (draft exported fp32, greedy, same K) and compare
    its acceptance counters with ours (needs the vLLM venv; core/vllm_spec.py creates it)"""
    out: str = ""
    """append the result JSON line to this file"""
    resume_file: str = ""
    """after each dataset, save the results so far here; a later run with the same draft weights and
    settings takes the datasets found there instead of decoding them again (a sweep's evaluation cut
    off by a time limit keeps its finished benchmarks)"""


def resume_key(a: EvalArgs, draft: torch.nn.Module, target_dir) -> dict:
    """What decides the results: the draft's weights (digest), the target and every decoding setting."""
    h = hashlib.sha256()
    for name, t in sorted(draft.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    keep = (
        "num_prompts",
        "max_new_tokens",
        "k",
        "tree_topk",
        "tree_depth",
        "min_survival",
        "ngram",
        "check_greedy",
        "dtype",
        "device",
        "batch",
    )
    return {
        "draft_sha256": h.hexdigest(),
        "target": str(target_dir),
        **{f: list(v) if isinstance(v := getattr(a, f), tuple) else v for f in keep},
    }


def read_resume_file(path: Path) -> dict | None:
    """A --resume-file this command wrote ({key, results}), None where there is none yet. Any other file
    is refused before anything loads: it was replaced by this run's results (a chats file given here by
    mistake was lost). The file is written whole (a temporary renamed), so a damaged one is not ours either."""
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        saved, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "no 'key' and 'results'"
    if not isinstance(saved, dict) or "key" not in saved or not isinstance(saved.get("results"), dict):
        raise SystemExit(
            f"error: --resume-file {path} is not a results file evaluate.py wrote ({why}); it would be replaced: "
            "give a new file name"
        )
    return saved


def _is_result_line(line: bytes) -> bool:
    try:
        r = json.loads(line)
    except ValueError:
        return False
    return isinstance(r, dict) and "draft" in r and isinstance(r.get("results"), dict)


def check_out(out: Path):
    """--out is appended to after minutes of decoding: one it cannot be is refused now (it was a
    PermissionError traceback at the end), and so is a file of other lines than evaluate.py's results."""
    if out.is_dir():
        raise SystemExit(f"error: --out {out} is a directory; give a file name")
    if (prov := out.with_name(out.stem + ".provenance.json")).exists():  # capture.py's output, even an empty one
        raise SystemExit(
            f"error: --out {out} is capture.py's output (its {prov.name} beside it), and --out is appended to: "
            "give a new file name, or one that earlier evaluate.py runs wrote"
        )
    if out.is_file():  # appended to: only a file of this command's result lines (a run's metrics.jsonl took one)
        try:
            with open(out, "rb") as f:
                for n, line in enumerate(f, 1):
                    if line.strip() and not _is_result_line(line):
                        raise SystemExit(
                            f"error: --out {out}:{n} is not a result line of evaluate.py, and --out is appended to: "
                            "give a new file name, or one that earlier evaluate.py runs wrote"
                        )
        except OSError as e:
            raise SystemExit(f"error: --out {out}: cannot read it ({e.strerror or e})") from None
    check_writable("--out", out)


def check_writable(flag: str, path: Path):
    """A file written after minutes of decoding (--out appended to, --resume-file replaced through a temporary
    beside it) that cannot be is refused now: they were tracebacks at the end (a --resume-file in a directory
    that did not exist lost the decoding). Nothing is created: a probe file in the nearest existing directory."""
    where = path.parent
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        if path.is_file():
            open(path, "a").close()  # appending nothing: writable, its lines untouched
        probe_write(where)
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: cannot write there ({e.strerror or e})") from None


def load_resumed(path: Path, key: dict) -> dict:
    """{dataset: results} saved under the same key, else {} (the file is then rewritten)."""
    saved = read_resume_file(path)
    if saved is None:
        return {}
    if saved.get("key") != key:
        print(f"[resume] {path} holds another draft or other settings: decoding every dataset again", flush=True)
        return {}
    return saved["results"]


def check_args(a: EvalArgs):
    """Option values that cannot work, one `error:` line each, before anything is loaded (-k 0 used to run
    K = 3, --max-new-tokens 0 printed nan%, --num-prompts -1 meant all but one)."""
    at_least = {"num_prompts": 0, "max_new_tokens": 1, "tree_topk": 0, "tree_depth": 1, "threads": 0, "batch": 1}
    for name, low in at_least.items():
        if (v := getattr(a, name)) < low:
            hint = " (0 = all)" if name == "num_prompts" else ""
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least {low}{hint}, got {v}")
    if bad := [k for k in a.k if k < 1]:
        raise SystemExit(f"error: -k takes draft tokens per step, at least 1 each, got {' '.join(map(str, bad))}")
    for flag, given in (("-k", a.k), ("--data", a.data)):  # -k 1 1 decoded every prompt twice to the same result
        if dup := sorted({str(v) for v in given if given.count(v) > 1}):
            raise SystemExit(f"error: {flag} names {', '.join(dup)} more than once (each value is one run)")
    for flag, k in [("-k", k) for k in a.k] + [("--tree-depth", a.tree_depth)] * bool(a.tree_topk):
        if k > a.max_new_tokens:  # -k 100000 drafted 100000 tokens a step, one forward each: it looked hung
            raise SystemExit(
                f"error: {flag} {k} drafts more tokens a step than --max-new-tokens {a.max_new_tokens} lets be verified"
            )
    if bad := [v for v in a.min_survival if not 0 < v <= 1]:  # 0 is the run without a cut; above 1 cuts everything
        raise SystemExit(f"error: --min-survival takes thresholds in (0, 1], got {' '.join(map(str, bad))}")
    if dup := sorted({str(v) for v in a.min_survival if a.min_survival.count(v) > 1}):
        raise SystemExit(f"error: --min-survival names {', '.join(dup)} more than once (each value is one run)")
    if a.tree_depth != EvalArgs.tree_depth and not a.tree_topk:  # read by the tree run only: it was ignored
        raise SystemExit("error: --tree-depth applies to the tree run: pass --tree-topk N too")
    if a.threads > 1024:  # 10**12 was an overflow traceback from torch
        raise SystemExit(
            f"error: --threads must be at most 1024 (this machine has {os.cpu_count()} cores), got {a.threads}"
        )
    if a.dtype not in ("fp32", "bf16"):
        raise SystemExit(f"error: --dtype must be fp32 or bf16, got {a.dtype!r}")
    kind, _, index = a.device.partition(":")  # --device tpu was a RuntimeError traceback after the models loaded
    if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
        raise SystemExit(f"error: --device must be cpu, cuda or cuda:N, got {a.device!r}")
    if a.target and (what := output_kind(a.target)):  # was a RuntimeError traceback from transformers
        raise SystemExit(f"error: --target {a.target} is {what}, not a target model (the draft is the first argument)")


def load_models(a: EvalArgs):
    """The draft (and what its export recorded), the target's directory, model and tokenizer, on a.device in
    a.dtype; every refusal a one-line SystemExit."""
    from transformers import AutoModelForCausalLM  # lazy: transformers (~1.5 s) stays out of evaluate.py --help

    dtype = DTYPES[a.dtype]
    try:
        draft, recorded = open_draft(a.draft)
    except (ExportError, FileNotFoundError) as e:
        raise SystemExit(f"error: cannot load the draft: {e}") from None
    try:
        target_dir = resolve_target(a.target or recorded.get("target") or "smollm2")
    except (DataError, FileNotFoundError) as e:  # TargetError is a DataError: a broken target dir or file
        raise SystemExit(f"error: cannot load the target: {e}") from None
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {a.device}: no CUDA device here")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval().to(a.device)
    ctx = getattr(model.config, "max_position_embeddings", None)
    if ctx and a.max_new_tokens >= ctx:  # decoded past the context for minutes (garbage there), before any output
        raise SystemExit(
            f"error: --max-new-tokens {a.max_new_tokens} does not fit the target's context of {ctx} tokens "
            f"(max_position_embeddings in {target_dir / 'config.json'})"
        )
    tok = load_tokenizer(target_dir)
    if why := target_mismatch(draft.config, model.config.to_dict(), tok, recorded):
        raise SystemExit(f"error: draft {a.draft} does not fit target {target_dir}: {'; '.join(why)} (wrong --target?)")
    draft.to(device=a.device, dtype=dtype)
    return draft, target_dir, model, tok


def build_proposers(a: EvalArgs, draft, model) -> list:
    """The draft's proposers for each -k (chains; the tree with --tree-topk), then n-gram lookup (--ngram)."""
    if FAMILIES[draft.family].decode_depth:
        proposers = [proposer_for(draft, model, depth=k) for k in a.k or (3,)]
        if a.tree_topk:
            if a.tree_topk > (
                V := getattr(draft.config, "draft_vocab_size", a.tree_topk)
            ):  # a RuntimeError from topk after the models loaded
                raise SystemExit(f"error: --tree-topk {a.tree_topk} is more than the draft's vocabulary of {V}")
            proposers.append(proposer_for(draft, model, depth=a.tree_depth, topk=a.tree_topk))
    else:  # the K the draft was trained for, one proposal per step (the first k of them verified)
        try:
            proposers = [proposer_for(draft, model, depth=k) for k in a.k or (None,)]
        except ValueError as e:
            raise SystemExit(f"error: -k {' '.join(map(str, a.k))}: {e}") from None
    if a.min_survival and not hasattr(proposers[0], "min_survival"):  # only DSpark's proposer has a confidence head
        raise SystemExit(f"error: --min-survival applies to dspark drafts (a confidence head), not {draft.family}")
    for v in a.min_survival:  # the same proposals cut by the confidence head (models/dspark.py DSparkProposer)
        for k in a.k or (None,):
            p = proposer_for(draft, model, depth=k)
            p.min_survival = v  # renames it: dspark-block7-cut0.2
            proposers.append(p)
    if a.ngram:
        proposers.append(NgramProposer(proposers[0].depth))
    return proposers


def evaluate_set(a: EvalArgs, ds: str, convs, proposers, target, tok, eos, draft, replay: dict) -> dict:
    """Every proposer over one prompt set: its summary row per proposer name (printed as it finishes), the
    draft vocabulary's coverage of the outputs under "coverage"; chain outputs appended to replay[K]."""
    rows, turns = {}, []
    for p in proposers:
        if a.batch > 1 and p.batches:  # EAGLE-3 chains (models/proposer.py Proposer.batches)
            st, sec, turns = run_dataset_batched(target, p, tok, convs, a.max_new_tokens, eos, a.batch, a.check_greedy)
        else:
            st, sec, turns = run_dataset(target, p, tok, convs, a.max_new_tokens, eos, a.check_greedy)
        if p.needs_aux and getattr(p, "topk", 1) == 1:  # chains and parallel / block proposals replay in vLLM
            replay.setdefault(p.depth, []).extend((ds, pr, out, s) for pr, out, s in turns)
        s = st.summary()
        s["seconds"] = round(sec, 1)
        s["tau_halves"] = split_halves(turns, convs)
        if p.needs_aux:  # the draft's proposers: tokens verified per step, tree width
            s["k"], s["topk"] = p.depth, getattr(p, "topk", 1)
        rows[p.name] = s
        acc = " ".join(f"{x:.2f}" for x in s["acceptance_per_pos"])
        cost = (
            f", draft cost {s['draft_cost']:.3f} target forwards/step, speed-up {s['expected_speedup']:.2f}"
            if s["draft_cost"] is not None
            else ""
        )
        extra = (
            f" (vLLM-style, proposing steps only: {s['tau_proposed_steps']:.3f})"
            if isinstance(p, NgramProposer)
            else ""
        )
        print(
            f"[{ds}] {p.name:<16} tau={s['tau']:.3f}{extra}  accept/pos=[{acc}]  {s['new_tokens']} tokens, "
            f"{s['target_forwards']} target forwards, {sec:.0f}s{cost}; halves {s['tau_halves']}",
            flush=True,
        )
    print(f"[{ds}] {'plain decoding':<16} tau=1.000 (by definition: one token per target forward)", flush=True)
    if isinstance(getattr(draft, "t2d", None), torch.Tensor):  # a token outside the draft vocab is never proposed
        ks = sorted({k for k in a.k if k})
        cov = coverage_rows([out for _, out, _ in turns], draft.t2d.cpu(), windows=ks)
        whole = "".join(f"; all next {k} inside at {100 * cov[f'window_{k}']:.1f}% of positions" for k in ks)
        print(
            f"[{ds}] draft vocabulary covers {100 * cov['coverage']:.1f}% of the target's output tokens{whole}",
            flush=True,
        )
        return {"rows": rows, "coverage": cov, "ks": ks}
    return {"rows": rows}


def replay_in_vllm(a: EvalArgs, replay: dict, target_dir, draft, result: dict) -> None:
    """--vllm: every chain's turns replayed in vLLM; result["vllm"]["chainK"] its agreement per set."""
    result["vllm"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k, turns in replay.items():
            print(
                f"[vllm] chain{k}: replaying {len(turns)} turns in vLLM (its start takes minutes on a CPU)", flush=True
            )
            try:
                agree = vllm_agreement(a.draft, target_dir, k, turns, a.max_new_tokens, Path(tmp), draft.family)
            except VllmError as e:  # was a traceback, after every dataset had been decoded: print those first
                print(json.dumps(result), flush=True)
                raise SystemExit(f"error: --vllm: the replay in vLLM failed: {e}") from None
            result["vllm"][f"chain{k}"] = agree
            for ds, r in agree.items():
                print(
                    f"[{ds}] chain{k} tau ours {r['tau_ours']:.3f} vs vLLM {r['tau_vllm']:.3f} "
                    f"({100 * r['rel_diff']:.1f}% apart), identical outputs {r['identical_outputs']}",
                    flush=True,
                )


def main(a: EvalArgs) -> dict:
    check_args(a)
    try:  # every prompt set read before the models load: a bad file is one line now, not a traceback later
        prompt_sets = {name: load_prompts(name, a.num_prompts) for name in a.data}
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    if a.resume_file:
        read_resume_file(Path(a.resume_file))
        check_writable("--resume-file", Path(a.resume_file))
    if a.out:
        check_out(Path(a.out))
    if a.threads:
        torch.set_num_threads(a.threads)
    draft, target_dir, model, tok = load_models(a)
    target = TargetRunner(model, draft.config.aux_layers)
    eos = eos_ids(model, tok)
    proposers = build_proposers(a, draft, model)
    result = {
        "draft": str(a.draft),
        "target": str(target_dir),
        "max_new_tokens": a.max_new_tokens,
        "num_prompts": a.num_prompts,
        "dtype": a.dtype,
        "device": a.device,
        "batch": a.batch,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(a.device),
        "results": {},
    }
    replay: dict[int, list] = {}  # K -> [(dataset, prompt, output, stats)]
    if a.resume_file and a.vllm:
        raise SystemExit(
            "error: --resume-file with --vllm: the vLLM replay needs every dataset's outputs; drop one of them"
        )
    key = resume_key(a, draft, target_dir) if a.resume_file else {}
    resumed = load_resumed(Path(a.resume_file), key) if a.resume_file else {}
    for name in a.data:
        ds = Path(name).stem if Path(name).suffix else name
        if ds in resumed:
            result["results"][ds] = resumed[ds]
            print(
                f"[{ds}] taken from {a.resume_file}: "
                + ", ".join(f"{n} tau={r['tau']:.3f}" for n, r in resumed[ds].items()),
                flush=True,
            )
            continue
        done = evaluate_set(a, ds, prompt_sets[name], proposers, target, tok, eos, draft, replay)
        result["results"][ds] = done["rows"]
        if "coverage" in done:
            cov = done["coverage"]
            result.setdefault("draft_vocab_coverage", {})[ds] = cov["coverage"]
            result.setdefault("draft_vocab_windows", {})[ds] = {str(k): cov[f"window_{k}"] for k in done["ks"]}
        if a.resume_file:  # write then rename: a kill mid-write leaves the previous file whole
            Path(a.resume_file).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(a.resume_file + ".tmp")
            tmp.write_text(json.dumps({"key": key, "results": result["results"]}))
            tmp.replace(a.resume_file)
    if a.vllm:
        replay_in_vllm(a, replay, target_dir, draft, result)
    line = json.dumps(result)
    print(line)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return result


if __name__ == "__main__":
    main(tyro.cli(EvalArgs))
