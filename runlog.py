"""Run artefacts: run.json (config, versions, git commit, hardware, results), metrics.jsonl,
and TensorBoard scalars. Only rank 0 writes."""
import dataclasses
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch


def git_commit() -> str:
    root = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware(device) -> dict:
    hw = {"host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                hw["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.device(device).type == "cuda":
        hw["gpu"] = torch.cuda.get_device_name(device)
        hw["gpu_count"] = torch.cuda.device_count()
    return hw


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "triton", "transformers", "datasets", "safetensors", "tyro"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def peak_memory() -> dict:
    """Peak memory of this process so far: the CUDA caching allocator's max allocated bytes (when
    CUDA was used) and the peak resident set size (host)."""
    import resource

    out = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux reports KiB
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    return out


def run_metadata(cfg, world: int, device, extra: dict | None = None) -> dict:
    return {
        "config": dataclasses.asdict(cfg),
        "git_commit": git_commit(),
        "versions": versions(),
        "hardware": hardware(device),
        "world_size": world,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        **(extra or {}),
    }


class RunLog:
    def __init__(self, out: Path, enabled: bool = True):
        self.out, self.enabled, self.tb, self.meta = Path(out), enabled, None, {}

    def start(self, meta: dict, resume: bool = False):
        if not self.enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "run.json"
        if resume and path.exists():  # keep the history of the first start
            old = json.loads(path.read_text())
            meta = {**old, "resumed": old.get("resumed", []) + [meta]}
        else:
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
        self.meta = meta
        path.write_text(json.dumps(meta, indent=1, default=str))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tb"))
        except ImportError:
            self.tb = None

    def write(self, row: dict):
        if not self.enabled:
            return
        row = {"time": time.time(), **row}
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None:
            split = row.get("split", "train")
            for k, v in row.items():
                if isinstance(v, (int, float)) and k not in ("step", "time"):
                    self.tb.add_scalar(f"{split}/{k}", v, row.get("step", 0))

    def finish(self, results: dict):
        if not self.enabled:
            return
        self.meta["results"] = results
        self.meta["peak_memory"] = peak_memory()
        (self.out / "run.json").write_text(json.dumps(self.meta, indent=1, default=str))
        if self.tb is not None:
            self.tb.close()
