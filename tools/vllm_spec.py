"""Serve prompts through vLLM with an EAGLE-3 draft and report the engine's own acceptance
counters. Runs inside the vLLM virtualenv (stdlib + vllm only; no nanospec imports):

    .venv-vllm/bin/python tools/vllm_spec.py job.json result.json

job.json: {"target": dir, "draft": serving dir or null (no speculation), "k": K,
           "prompts": [[token ids], ...], "max_tokens": N, "dtype": "float32",
           "max_model_len": 2048, "batch": true}
result.json: {"outputs": [[token ids], ...], "metrics": {"num_drafts", "num_draft_tokens",
              "num_accepted_tokens", "accepted_per_pos": [...]}, "vllm_version", "seconds"}
With "batch": false the prompts run one at a time (per-prompt counters in "per_prompt").
"""
import json
import os
import sys
import time


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
        k: ([x - y for x, y in zip(a[k], b[k] + [0] * len(a[k]))] if isinstance(a[k], list) else a[k] - b[k])
        for k in a
    }


def main(job_path: str, result_path: str):
    job = json.load(open(job_path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: plenty for a few prompts
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    kw = {}
    if job.get("draft"):
        kw["speculative_config"] = {"method": "eagle3", "model": job["draft"], "num_speculative_tokens": int(job["k"])}
    llm = LLM(
        model=job["target"], dtype=job.get("dtype", "float32"), max_model_len=int(job.get("max_model_len", 2048)),
        enforce_eager=True, disable_log_stats=False, seed=0, **kw,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), ignore_eos=bool(job.get("ignore_eos", False)))
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
    json.dump(result, open(result_path, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
