"""Issue 35's wider probe: every option of every entry script at bad values, classified by what the user gets.

    python tools/probe_cli.py                          # all scripts (~45 min of one core with --jobs 1)
    python tools/probe_cli.py --only train export --jobs 2
    python tools/probe_cli.py --only gate --fields vllm_venv --list   # the cases, without running them

For train.py, capture.py features / regenerate / prompts, export.py, evaluate.py and gate.py it takes a small
good command line on a tiny random target (models/tiny.py, SmolLM2's tokenizer, as tests/conftest.py builds it)
and, one option at a time (the fields of each script's config dataclass), puts in: 0, -1 and 10**12 for
integers; those and nan, inf for floats; '' and 'nope' for names; for paths '', a missing path, an empty file, an
empty directory, a folder of a user's files, a read-only directory or file (chattr +i: the probe runs as root)
and each other command's real output (a run, a checkpoint, an export, a feature store, regenerate's and prompts'
files). Each case is one process with a timeout, forked from this one after the heavy imports (torch,
transformers, the scripts) so that a refused case costs a fraction of a second instead of 8 s; it runs the script
as __main__ with sys.argv set, as `python SCRIPT ARGS` would (--no-fork runs real subprocesses instead).

Outcome classes (one JSON line per case in --out, then a table):
  error      non-zero exit, the last line starts with 'error: ', no traceback
  traceback  'Traceback' in the output
  ok         exit 0 (read them: an option accepted and then ignored or misread is a silent wrong result)
  exit       non-zero exit with another last line (a gate verdict, an interruption, ...)
  hung       still running at --timeout
  destroyed  a file of the shared inputs (target, chats, the other commands' outputs, the user's folder) changed
             or vanished; the inputs are restored from a pristine copy before the next case
"""

import dataclasses
import hashlib
import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import time
import traceback
import typing
from collections import Counter, defaultdict
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")

HUGE = str(10**12)
MISSING = "<missing>"


@dataclasses.dataclass
class Args:
    out: str = "experiments/results/probe_cli/probe.jsonl"
    """one JSON line per case (appended to when --only or --fields picks a part)"""
    only: tuple[str, ...] = ()
    """scripts: train features regenerate prompts export evaluate gate (default all)"""
    fields: tuple[str, ...] = ()
    """only these options (underscored names)"""
    work: str = "/tmp/probe_cli"
    """the tiny target, chats and other commands' outputs (built once, reused), and one directory per case"""
    timeout: float = 60.0
    jobs: int = 1
    """cases run at once"""
    fork: bool = True
    """fork each case from this process (imports done); --no-fork: `python SCRIPT ...` subprocesses"""
    list: bool = False
    """print the cases and exit"""
    recheck: tuple[str, ...] = ()
    """run only the cases these result files classified other than error or usage (the fixes add refusals: a case
    refused before is refused after)"""
    table: tuple[str, ...] = ()
    """print the table of these result files (one JSON line per case) and exit"""


# ---------------------------------------------------------------- the shared inputs
def sh(*args, **kw):
    p = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise SystemExit(f"fixture command failed: {args}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def build_inputs(w: Path) -> dict[str, Path]:
    """The probe's inputs under w/inputs (kept between invocations), a pristine copy in w/pristine."""
    d = w / "inputs"
    f = {
        "target": d / "target",
        "chats": d / "chats.jsonl",
        "prompts_file": d / "eval_prompts.jsonl",
        "run": d / "run",
        "ckpt": d / "run" / "ckpt" / "step_2",
        "export": d / "export",
        "store": d / "store",
        "regen": d / "regen.jsonl",
        "selfinstruct": d / "selfinstruct.jsonl",
        "gate_dir": d / "gate",
        "sample": d / "gate" / "sample.json",
        "empty_file": d / "empty.jsonl",
        "empty_dir": d / "empty_dir",
        "user_dir": d / "user_dir",
        "ro_dir": d / "ro_dir",
        "ro_file": d / "ro_file.jsonl",
        "fake_venv": d / "fake_venv",
    }
    if (d / "DONE").exists():
        return f
    d.mkdir(parents=True, exist_ok=True)
    from data.datasets import load_records  # lazy: imports torch, only to build the inputs once (parent stays light)
    from models.target import load_tokenizer, resolve_target  # lazy: as load_records
    from models.tiny import tiny_llama  # lazy: as load_records

    if not f["target"].exists():
        tok = load_tokenizer(resolve_target("smollm2"))
        tiny_llama(vocab=len(tok), hidden=64, layers=4, heads=4, kv_heads=2).save_pretrained(f["target"])
        tok.save_pretrained(f["target"])
    with open(f["chats"], "w") as out:
        for rec in load_records("sharegpt", limit=60):
            msgs = [
                {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"][:200]}
                for t in rec["conversations"][:4]
            ]
            out.write(json.dumps({"messages": msgs}) + "\n")
    f["prompts_file"].write_text("".join(json.dumps({"prompt": f"Tell me about {x}."}) + "\n" for x in "abc"))
    f["empty_file"].write_text("")
    for p in ("empty_dir", "user_dir", "ro_dir"):
        f[p].mkdir(exist_ok=True)
    (f["user_dir"] / "notes.txt").write_text("a user's own file\n")
    f["ro_file"].write_text(f["chats"].read_text())
    # a vLLM venv stand-in: its python passes ensure_venv's import check and fails every job (no network here)
    (f["fake_venv"] / "bin").mkdir(parents=True, exist_ok=True)
    (f["fake_venv"] / "lib" / "python3" / "site-packages" / "vllm").mkdir(parents=True, exist_ok=True)
    (f["fake_venv"] / "pyvenv.cfg").write_text("home = /usr/bin\n")
    py = f["fake_venv"] / "bin" / "python"
    py.write_text('#!/bin/sh\n[ "$1" = "-c" ] && exit 0\necho "no vLLM in the probe" >&2\nexit 1\n')
    py.chmod(0o755)
    t, c = f["target"], f["chats"]
    small = "--num-records 12 --holdout 2 --max-len 64 --batch-size 2 --draft-vocab-size 512 --ttt-length 2".split()
    steps = {
        "run": ("train.py", "--target", t, "--data", c, "--out", f["run"], *small, "--steps", 2, "--no-progress"),
        "export": ("export.py", f["run"], "--out", f["export"]),
        "store": ("capture.py", "features", "--target", t, "--data", c, "--out", f["store"], "--num-records", 4),
        "regen": ("capture.py", "regenerate", "--target", t, "--data", c, "--out", f["regen"], "--num-records", 2),
        "selfinstruct": ("capture.py", "prompts", "--target", t, "--out", f["selfinstruct"], "--max-batches", 1),
    }
    for name, args in steps.items():
        if not f[name].exists():
            sh(*args, *(() if name in ("run", "export") else ("--max-len", 64) if name == "store" else
                        ("--max-new-tokens", 8, "--batch-size", 2)))  # fmt: skip
    gate = ("gate.py", "--target", t, "--data", c, "--out", f["gate_dir"], "--ckpt", f["export"])
    gate += ("--vllm-venv", f["fake_venv"], "--max-len", 128, "--response-tokens", 8, "--k", 2, "--min-trainable", 4)
    if not f["sample"].exists():
        subprocess.run([sys.executable, *map(str, gate)], cwd=ROOT, capture_output=True)
    assert f["sample"].exists(), "the gate fixture wrote no sample.json"
    for p in READ_ONLY:
        subprocess.run(["chattr", "+i", str(d / p)], check=True)
    (d / "DONE").write_text("")
    pristine = w / "pristine"
    shutil.rmtree(pristine, ignore_errors=True)
    shutil.copytree(d, pristine, symlinks=True)
    return f


def snapshot(d: Path) -> dict[str, str]:
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(d))] = hashlib.sha1(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[str(p.relative_to(d)) + "/"] = ""
    return out


READ_ONLY = ("ro_dir", "ro_file.jsonl")


def restore(w: Path, added: list[str], changed: list[str]):
    """Undo a case: what it added to the inputs is removed; if it changed any, they are copied back whole."""
    d = w / "inputs"
    if not changed:
        for rel in sorted(added, key=len):
            p = d / rel.rstrip("/")
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return
    for p in READ_ONLY:
        subprocess.run(["chattr", "-i", str(d / p)], capture_output=True)
    shutil.rmtree(d)
    shutil.copytree(w / "pristine", d, symlinks=True)
    for p in READ_ONLY:
        subprocess.run(["chattr", "+i", str(d / p)], check=True)


# ---------------------------------------------------------------- the cases
SCRIPTS = {
    "train": ("train.py", [], "train:TrainConfig"),
    "features": ("capture.py", ["features"], "capture:FeaturesConfig"),
    "regenerate": ("capture.py", ["regenerate"], "capture:RegenConfig"),
    "prompts": ("capture.py", ["prompts"], "capture:PromptsConfig"),
    "export": ("export.py", [], "export:ExportArgs"),
    "evaluate": ("evaluate.py", [], "evaluate:EvalArgs"),
    "gate": ("gate.py", [], "gate:GateConfig"),
}
PATH_IN = {"target", "data", "features", "init_draft", "config", "ckpt", "draft", "sample", "vllm_venv"}
PATH_OUT = {"out", "resume_file", "control", "store"}
TEXT = {"system", "worker_name", "user_prefix", "train_args"}
GATE_STAGE2 = {"strategy", "train_args", "max_steps", "chunk", "lr", "draft_vocab_size", "max_loss", "min_acc"}


def bases(f: dict[str, Path]) -> dict[str, dict]:
    t, c = str(f["target"]), str(f["chats"])
    io = dict(target=t, data=c)  # the tiny target and the chats: first in each command line
    gate = dict(k=2, scan_records=8, max_prompt_tokens=64, response_tokens=8, min_trainable=4, max_len=128)
    return {
        "train": dict(
            io,
            out="{case}/run",
            num_records=12,
            holdout=2,
            max_len=64,
            batch_size=2,
            draft_vocab_size=512,
            ttt_length=2,
            steps=2,
            warmup=1,
            eval_batch_size=2,
            progress=False,
        ),  # fmt: skip
        "features": dict(io, out="{case}/store", num_records=4, max_len=64),
        "regenerate": dict(
            io, out="{case}/regen.jsonl", num_records=2, max_new_tokens=4, max_prompt_len=128, batch_size=2
        ),
        "prompts": dict(
            target=t, out="{case}/prompts.jsonl", num_prompts=2, max_new_tokens=8, batch_size=2, max_batches=1
        ),
        "export": dict(ckpt=str(f["run"]), out="{case}/export"),
        "evaluate": dict(draft=str(f["run"]), data=(str(f["prompts_file"]),), num_prompts=1, max_new_tokens=8),
        "gate": dict(io, out="{case}/gate", ckpt=str(f["export"]), vllm_venv=str(f["fake_venv"]), **gate),
        "gate-train": dict(
            io, out="{case}/gate", vllm_venv=str(f["fake_venv"]), **gate, max_steps=2, chunk=1, draft_vocab_size=256
        ),
    }


def config_fields(spec: str) -> list[dataclasses.Field]:
    mod, name = spec.split(":")
    out = []
    for fld in dataclasses.fields(getattr(importlib.import_module(mod), name)):
        if dataclasses.is_dataclass(fld.default_factory if fld.default_factory is not dataclasses.MISSING else None):
            out += dataclasses.fields(fld.default_factory)  # train.py's deploy section: flags without a prefix
        else:
            out.append(fld)
    return out


def kind(fld: dataclasses.Field) -> str:
    tp = fld.type
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    args = typing.get_args(tp)
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if typing.get_origin(tp) is tuple:
        return "ints" if args[0] is int else "strs"
    if typing.get_origin(tp) is typing.Literal:
        return "literal"
    return "str"


def path_values(f: dict[str, Path], out: bool) -> list[tuple[str, str]]:
    """(label, value) for a path option; an output also gets the inputs it must never replace."""
    vals = [("empty", ""), ("missing", MISSING), ("empty_file", f["empty_file"]), ("empty_dir", f["empty_dir"])]
    vals += [("user_dir", f["user_dir"]), ("ro_dir", f["ro_dir"]), ("ro_file", f["ro_file"])]
    others = ("target", "chats", "run", "ckpt", "export", "store", "regen", "selfinstruct", "gate_dir", "sample")
    vals += [(o, f[o]) for o in others]
    if out:
        vals += [("ro_dir_new", f["ro_dir"] / "new")]
    return [(label, str(v)) for label, v in vals]


def values(fld: dataclasses.Field, f: dict[str, Path]) -> list[tuple[str, list[str] | None]]:
    """(label, argv words for the option's value, None = the flag alone) for one option."""
    k, name = kind(fld), fld.name
    if name in PATH_IN or name in PATH_OUT:
        vals = path_values(f, name in PATH_OUT)
        return [(label, [v]) for label, v in vals] + (
            [("two", [str(f["chats"]), str(f["chats"])])] if k == "strs" else []
        )
    if name in TEXT:
        return [("empty", [""]), ("nope", ["--nope"] if name == "train_args" else ["nope"])]
    if k == "bool":
        return [("flip", None)]
    if k == "int":
        return [("0", ["0"]), ("-1", ["-1"]), ("huge", [HUGE])]
    if k == "float":
        return [("0", ["0"]), ("-1", ["-1"]), ("huge", ["1e12"]), ("nan", ["nan"]), ("inf", ["inf"])]
    if k == "ints":
        return [("none", []), ("0", ["0"]), ("-1", ["-1"]), ("huge", [HUGE]), ("dup", ["1", "1"])]
    if k == "literal":
        return [("nope", ["nope"])]
    return [("empty", [""]), ("nope", ["nope"])]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def argv_of(base: dict, fields: dict[str, dataclasses.Field]) -> list[str]:
    pos, rest = [], []
    for name, v in base.items():
        if isinstance(v, bool):
            rest.append(flag(name) if v else "--no-" + name.replace("_", "-"))
            continue
        words = list(v) if isinstance(v, tuple) else [str(v)]
        if "Positional" in str(fields[name].type):
            pos += words
        else:
            rest += [flag(name), *words]
    return pos + rest


def cases(a: Args, f: dict[str, Path]) -> list[dict]:
    out, bs = [], bases(f)
    for script in a.only or SCRIPTS:
        path, sub, spec = SCRIPTS[script]
        fields = {fld.name: fld for fld in config_fields(spec)}
        for name, fld in fields.items():
            if a.fields and name not in a.fields:
                continue
            base = bs["gate-train" if script == "gate" and name in GATE_STAGE2 else script]
            for label, words in values(fld, f):
                cfg = dict(base)
                if words is None:  # a bool: the other way round from its default (or from the base)
                    cfg[name] = not cfg.get(name, fld.default)
                elif "Positional" in str(fld.type) or kind(fld) in ("ints", "strs"):
                    cfg[name] = tuple(words)
                else:
                    cfg[name] = words[0]
                if cfg.get(name) == MISSING or cfg.get(name) == (MISSING,):
                    cfg[name] = "{case}/missing" if kind(fld) != "strs" else ("{case}/missing",)
                argv = [path, *sub, *argv_of(cfg, fields)]
                out.append({"script": script, "field": name, "value": label, "argv": argv})
    return out


# ---------------------------------------------------------------- running them
def start(case: dict, d: Path, fork: bool) -> int:
    d.mkdir(parents=True, exist_ok=True)
    argv = [w.replace("{case}", str(d)) for w in case["argv"]]
    case["argv"] = argv
    log = open(d / "output.txt", "wb")
    if not fork:
        p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=log, stderr=log, start_new_session=True)
        return p.pid
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        log.close()
        return pid
    code = 1
    try:  # the child: `python SCRIPT ARGS`, as the interpreter would run it
        os.setsid()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.argv = argv
        try:
            runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


# --out given the same command's own earlier output: replacing or resuming it is what was asked
OWN_OUTPUT = {("export", "export"), ("gate", "gate_dir"), ("regenerate", "regen"), ("prompts", "selfinstruct")}
OWN_OUTPUT |= {("features", "store")}


def classify(case: dict, rc: int | None, text: str, changed: list[str]) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    case["last"] = lines[-1][:400] if lines else ""
    if changed and not (case["field"] == "out" and (case["script"], case["value"]) in OWN_OUTPUT):
        return "destroyed"
    if rc is None:
        return "hung"
    if "Traceback (most recent call last)" in text:
        return "traceback"
    if rc == 0:
        return "ok"
    if rc == 2 and "For full helptext" in text:
        return "usage"  # tyro's own refusal of the command line (a box naming the option), exit 2
    return "error" if case["last"].startswith("error: ") else "exit"


def sources() -> dict[str, float]:
    """The project's modules this process has imported, with their mtimes (a fork runs these, not the files)."""
    out = {}
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None) or ""
        if f.startswith(str(ROOT)) and "/.venv" not in f and os.path.exists(f):
            out[f] = os.path.getmtime(f)
    return out


def key(case: dict) -> tuple:
    return case["script"], case["field"], case["value"]


def run_all(a: Args, todo: list[dict], f: dict[str, Path]) -> list[dict]:
    """The cases not yet in --out (it is appended to: a rerun resumes). When a source file changes under a forking
    run, the children would mix the old imports with the new script: this process execs itself afresh."""
    w = Path(a.work)
    inputs = w / "inputs"
    before = snapshot(inputs)
    out = ROOT / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(x) for x in open(out)] if out.exists() else []
    seen = {key(r) for r in done}
    results, running, queue = done, {}, [(i, c) for i, c in enumerate(todo) if key(c) not in seen]
    imported = sources()
    with open(out, "a") as log:
        while queue or running:
            if a.fork and queue and not running and sources() != imported:
                print("[probe] a source file changed: restarting to import it", flush=True)
                os.execv(sys.executable, [sys.executable, *sys.argv])
            while queue and len(running) < a.jobs and (not a.fork or sources() == imported):
                i, case = queue.pop(0)
                d = w / "cases" / f"{case['script']}-{case['field']}-{case['value']}"
                shutil.rmtree(d, ignore_errors=True)
                running[start(case, d, a.fork)] = (case, d, time.time())
            time.sleep(0.05)
            for pid, (case, d, t0) in list(running.items()):
                done, status = os.waitpid(pid, os.WNOHANG)
                late = time.time() - t0 > a.timeout
                if not done and not late:
                    continue
                if not done:
                    os.killpg(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    rc = None
                else:
                    rc = os.waitstatus_to_exitcode(status)
                    try:
                        os.killpg(pid, signal.SIGKILL)  # anything it left running
                    except ProcessLookupError:
                        pass
                del running[pid]
                now = snapshot(inputs)
                changed = sorted(k for k in before if now.get(k) != before[k])
                case.update(rc=rc, seconds=round(time.time() - t0, 1), changed=changed[:20])
                added = sorted(set(now) - set(before))
                case["added"] = added[:20]
                text = (d / "output.txt").read_text(errors="replace")
                case["outcome"] = classify(case, rc, text, changed)
                if changed or added:
                    restore(w, added, changed)
                results.append(case)
                log.write(json.dumps(case) + "\n")
                log.flush()
                print(f"{case['outcome']:9} {case['seconds']:6.1f}s {case['script']} --{case['field']} {case['value']}")
                print(f"          {case['last'][:160]}", flush=True)
    return results


def table(results: list[dict]):
    classes = ["error", "usage", "ok", "exit", "traceback", "hung", "destroyed"]
    by = defaultdict(Counter)
    for r in results:
        by[r["script"]][r["outcome"]] += 1
    print(f"\n{'script':12}" + "".join(f"{c:>10}" for c in classes) + f"{'total':>8}")
    for s, n in by.items():
        print(f"{s:12}" + "".join(f"{n[c]:>10}" for c in classes) + f"{sum(n.values()):>8}")
    tot = Counter(r["outcome"] for r in results)
    print(f"{'all':12}" + "".join(f"{tot[c]:>10}" for c in classes) + f"{len(results):>8}")


def main(a: Args):
    if a.table:
        table([json.loads(x) for f in a.table for x in open(f)])
        return
    f = build_inputs(Path(a.work))
    todo = cases(a, f)
    if a.recheck:
        again = {key(r) for p in a.recheck for r in map(json.loads, open(p)) if r["outcome"] not in ("error", "usage")}
        todo = [c for c in todo if key(c) in again]
    if a.list:
        for c in todo:
            print(c["script"], c["field"], c["value"], " ".join(c["argv"]))
        print(len(todo), "cases")
        return
    if a.fork:  # the heavy imports once, before the forks
        for mod in ("train", "capture", "export", "evaluate", "gate"):
            importlib.import_module(mod)
    table(run_all(a, todo, f))


if __name__ == "__main__":
    main(tyro.cli(Args))
