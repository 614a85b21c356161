"""Run artefacts: run.json (config, versions, git commit, hardware, results), metrics.jsonl,
TensorBoard scalars; the checkpoint directory layout is core/checkpoint.py's. Only rank 0 writes."""

import dataclasses
import errno
import importlib.metadata as md
import json
import math
import os
import platform
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from core.distributed import all_sum

# --time-limit counts from here: the import of this module, before train.py has read its data, loaded the target
# or compiled anything (start-up is part of the limit)
STARTED = time.monotonic()


def process_seconds() -> float:
    """Seconds since this process started (Linux: its start time in /proc, so Python's and torch's imports count;
    elsewhere since this module's import): the clock of train.py's start-up line."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - STARTED


def os_why(e: OSError) -> str:
    """A failed write's OSError in words a user acts on."""
    return {
        errno.EROFS: "it is on a read-only file system",
        errno.EACCES: "no permission to write there",
        errno.EPERM: "no permission to write there",
        errno.ENOSPC: "no space left on the device",
    }.get(e.errno, e.strerror or str(e))


def probe_write(where: Path):
    """Create and remove a temporary file in the directory `where`: raises the OSError a write there would (read-only,
    no permission, ...) before a command spends minutes whose output it could not keep."""
    fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=where)
    os.close(fd)
    os.unlink(probe)


def git_commit(root: Path | None = None) -> str:
    """HEAD, and where the files differ from it the git tree of the working files as they are (tracked
    and untracked, not ignored): "<sha>+dirty tree <tree>". The device machine runs a copy of the working
    tree on top of an older HEAD, so only the tree names the code that ran: the commit that holds it is
    `git log --format='%H %T' | grep <tree>`."""
    root = root or Path(__file__).resolve().parents[1]
    git = lambda *a, **kw: subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, check=True, **kw)  # noqa: E731
    try:
        sha = git("rev-parse", "HEAD").stdout.strip()
        if not git("status", "--porcelain").stdout.strip():
            return sha
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    try:  # a throwaway index, so the repository's own is untouched
        with tempfile.TemporaryDirectory() as d:
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(d) / "index")}
            git("read-tree", "HEAD", env=env)
            git("add", "-A", env=env)
            return f"{sha}+dirty tree {git('write-tree', env=env).stdout.strip()}"
    except (OSError, subprocess.CalledProcessError):
        return sha + "+dirty"


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

    def start(self, meta: dict, resume: bool = False, resume_step: int | None = None, keep=None):
        """A new run.json and empty metrics.jsonl, or (resume) the run's own continued: run.json keeps the
        first start's record (its absence is an error: history is never deleted), metrics.jsonl keeps the
        rows `keep(row)` accepts (those up to the checkpoint resumed from: rows logged after it, before a
        kill, would otherwise appear twice) and TensorBoard hides its events after resume_step."""
        if not self.enabled:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "run.json"
        if resume:
            if not path.exists():
                raise FileNotFoundError(f"--resume: {path} is missing (metrics.jsonl kept as it is)")
            old = json.loads(path.read_text())
            meta = {**old, "resumed": old.get("resumed", []) + [meta]}
            if keep is not None:
                self._truncate_metrics(keep)
        else:
            (self.out / "metrics.jsonl").unlink(missing_ok=True)
        # "running" until finish() or fail() says how it ended: a run.json that still says so after the
        # process is gone was killed outright (kill -9, out of memory, a lost machine)
        meta.pop("error", None)
        self.meta = {**meta, "status": "running"}
        self._write()
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: no tensorboard, no tb/ (and ~0.3 s)

            # purge_step: events at steps >= it, written before a kill, are hidden from TensorBoard
            purge = resume_step + 1 if resume and resume_step is not None else None
            self.tb = SummaryWriter(str(self.out / "tb"), purge_step=purge)
        except ImportError:
            self.tb = None

    def _truncate_metrics(self, keep):
        """metrics.jsonl without the rows keep() rejects and without a partial last line (a kill mid-write);
        a damaged line elsewhere is kept as it is (not ours to judge). Rewritten atomically."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        raw = path.read_text(encoding="utf-8", errors="surrogateescape")
        lines = raw.splitlines(keepends=True)
        kept = []
        for i, line in enumerate(lines):
            try:
                row = json.loads(line)
            except ValueError:
                if i == len(lines) - 1 and not line.endswith("\n"):
                    continue  # cut off mid-write
                kept.append(line)
                continue
            if not isinstance(row, dict) or keep(row):
                kept.append(line if line.endswith("\n") else line + "\n")
        if kept != lines:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8", errors="surrogateescape")
            os.replace(tmp, path)

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

    def _write(self):
        (self.out / "run.json").write_text(json.dumps(self.meta, indent=1, default=str))

    def finish(self, results: dict, status: str = "finished"):
        """The run ended: "finished", or "stopped" (results["stopped_by"] says why; --resume continues it)."""
        if not self.enabled:
            return
        self.meta["status"] = status
        self.meta["results"] = results
        self.meta["peak_memory"] = peak_memory()
        self._write()
        if self.tb is not None:
            self.tb.close()

    def fail(self, error: str, status: str = "failed"):
        """The run ended with an expected failure (the message the user saw) or was interrupted; before start()
        run.json may still be an earlier run's, so nothing is written then."""
        if not (self.enabled and self.meta):
            return
        self.meta.update(status=status, error=error)
        self._write()
        if self.tb is not None:  # the run ends here: its last events are written (train.py may exit without teardown)
            self.tb.close()


# ---------------------------------------------------------------- throughput and MFU
# Dense bf16 tensor-core peak per GPU (FLOP/s, no sparsity), from the vendors' data sheets, by a
# substring of torch.cuda.get_device_name(). No entry, no MFU: a made-up peak is worse than none
# (CPUs have no comparable single figure, so CPU runs log no MFU).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
THROUGHPUT_WARMUP = 2  # steps of each invocation left out of the throughput (compiles, allocator warm-up)


def peak_flops(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


class Throughput:
    """Tokens per second over windows of training steps that start after THROUGHPUT_WARMUP steps
    and at every report (a log step, which waits for the device anyway); time spent in evaluation
    and checkpoints is excluded (pause/resume around them).
    real = tokens of the conversations; rows = what the rows hold, padding included.
    MFU (approximate, only where peak_flops knows the device): model FLOPs of the real tokens,
    6 * N_draft * K (forward + backward of the whole draft for each of the K TTT steps / depths /
    block slots; attention and the draft head's row selection ignored) + 2 * N_target (one frozen
    target forward; 0 when features come from a store), over the window's seconds and
    n_devices * peak; flops_per_token None (a family without that simple count): no MFU."""

    def __init__(self, flops_per_token: float | None, n_devices: int, peak: float | None):
        self.flops_per_token, self.n_devices, self.peak = flops_per_token, n_devices, peak
        self.steps_seen, self.t0, self.real, self.rows, self.steps = 0, None, 0, 0, 0
        self.total_real, self.total_rows = 0, 0  # every step of this invocation (packing efficiency)

    def step(self, real: int, rows: int, sync):
        self.total_real, self.total_rows = self.total_real + real, self.total_rows + rows
        self.steps_seen += 1
        if self.steps_seen < THROUGHPUT_WARMUP:
            return
        if self.steps_seen == THROUGHPUT_WARMUP:  # the window opens once the warm-up steps are done
            sync()
            self.t0, self.real, self.rows, self.steps = time.perf_counter(), 0, 0, 0
            return
        self.real, self.rows, self.steps = self.real + real, self.rows + rows, self.steps + 1

    def pause(self, sync):
        sync()  # the training work queued so far is counted, not hidden in the pause
        self._paused = time.perf_counter()

    def resume(self):
        if self.t0 is not None:
            self.t0 += time.perf_counter() - self._paused

    def report(self, global_sum) -> dict:
        """Throughput of the window since the last report (global over ranks through
        global_sum([real, rows]) -> summed), then a new window. {} during the warm-up."""
        if self.t0 is None or not self.steps:
            return {}
        dt = time.perf_counter() - self.t0
        real, rows = global_sum([self.real, self.rows])
        out = {"real_tokens_per_s": real / dt, "row_tokens_per_s": rows / dt, "step_seconds": dt / self.steps}
        if self.peak and self.flops_per_token:
            out["mfu"] = self.flops_per_token * real / dt / (self.n_devices * self.peak)
        self.t0, self.real, self.rows, self.steps = time.perf_counter(), 0, 0, 0
        return out


RUN_FILES = ("run.json", "metrics.jsonl", "tb", "ckpt")  # what a run writes into its dir (--overwrite deletes them)


def previous_run(out: Path) -> list[str]:
    """The files of an earlier run in `out` (empty if none)."""
    return [n + ("/" if (out / n).is_dir() else "") for n in RUN_FILES if (out / n).exists()]


def clear_previous_run(out: Path) -> list[str]:
    """--overwrite: delete the earlier run's files (nothing else in `out`)."""
    old = previous_run(out)
    for n in RUN_FILES:
        p = out / n
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()
    return old


DRAFT_ARCHITECTURES = ("Eagle", "Speculator", "DFlash", "DSpark")  # in a serving config's architectures


def output_kind(path: str | Path) -> str | None:
    """What a directory is when one of our commands (or a draft trainer) wrote it: 'a draft export ...', 'a
    training run ...', 'a checkpoint ...', 'a feature store ...', 'a gate.py run ...'; None for anything else.
    Each command refuses another's output where its own input or output goes, by name (a draft given as
    --target was a RuntimeError traceback from transformers; a store written into a run's directory mixed them)."""
    p = Path(path)
    if not p.is_dir():
        return None
    if (p / "store.json").is_file():
        return "a feature store (capture.py features --out)"
    if (p / "gate.json").is_file() or (p / "sample.json").is_file():
        return "a gate.py run directory (gate.py --out)"
    if (p / "run.json").is_file() or ((p / "ckpt" / "latest").is_file() and (p / "metrics.jsonl").is_file()):
        return "a training run (train.py --out)"
    if (p / "draft.safetensors").is_file():
        return "a training checkpoint (train.py's ckpt/step_N)"
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        cfg = None
    cfg = cfg if isinstance(cfg, dict) else {}
    if (p / ".nanospec-export").is_file() or "nanospec_export" in cfg:  # export.py's EXPORT_MARKER, its config key
        return "a draft export (export.py --out)"
    if "speculators_config" in cfg or any(
        a in str(x) for x in cfg.get("architectures") or [] for a in DRAFT_ARCHITECTURES
    ):
        return f"a draft model (config.json: architectures {cfg.get('architectures')})"
    return None


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far: a number that keeps growing after
    warm-up means recompiles (a new shape every step), the usual cause of a run that crawls."""
    from torch._dynamo.utils import counters  # lazy: torch._dynamo takes seconds to import (capture.py loads none)

    return int(counters["stats"]["unique_graphs"])


class Heartbeat:
    """Says so when a run goes quiet: a daemon thread prints one line when nothing was marked done
    (a training step, an evaluation batch) for `after` seconds, and again every `after` seconds while
    it stays quiet, naming the last thing done and the graphs torch.compile has made so far. A run that
    compiles or recompiles for minutes then shows it in its log instead of printing nothing. The
    first line of each quiet stretch also shows where the thread that made the Heartbeat is (its
    innermost frames): what it is waiting on, without a debugger."""

    def __init__(self, after: float, say=print, frames: int = 8):
        self.after, self.say, self.frames = after, say, frames
        self.owner = threading.get_ident()
        self.last = self.said = time.monotonic()
        self.what = "start-up"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="heartbeat")
        self._thread.start()

    def mark(self, what: str):
        self.last, self.what = time.monotonic(), what

    def _watch(self):
        while not self._stop.wait(min(self.after / 4, 5.0)):
            now = time.monotonic()
            quiet = now - self.last
            if quiet >= self.after and now - max(self.said, self.last) >= self.after:
                first = self.said < self.last  # the first line of this quiet stretch
                self.said = now
                where = self.where() if first and self.frames else ""
                self.say(
                    f"[slow] nothing finished for {quiet:.0f} s (last done: {self.what}); "
                    f"torch.compile graphs so far: {compiled_graphs()}{where}"
                )

    def where(self) -> str:
        frame = sys._current_frames().get(self.owner)
        if frame is None:
            return ""
        stack = traceback.extract_stack(frame)[-self.frames :]
        return "; now in:\n" + "".join(f"    {f.filename}:{f.lineno} {f.name}\n" for f in stack).rstrip()

    def close(self):
        self._stop.set()
        self._thread.join()


class StopRequest:
    """--time-limit, SIGTERM and SIGINT: whether to stop, with a checkpoint, after the current step. The first
    SIGTERM or Ctrl-C only raises a flag (a second one acts as before: SIGTERM kills, Ctrl-C raises
    KeyboardInterrupt); every rank must stop at the same step, so on several ranks the flags are summed at log
    steps (where the loop syncs anyway), on one rank read each step."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, time_limit: float, device: torch.device, world: int):
        self.deadline = STARTED + time_limit if time_limit else math.inf
        self.device, self.world = device, world
        self.signalled = ""  # the name of the first signal received
        self.previous = {}  # the handlers before ours (SIG_DFL where not set from Python); empty: not ours
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for s in self.SIGNALS:
                before = signal.signal(s, self.on_signal)
                self.previous[s] = signal.SIG_DFL if before is None else before

    def on_signal(self, signum, frame):
        self.signalled = self.signalled or signal.Signals(signum).name
        signal.signal(signum, self.previous[signum])
        # os.write, not print: a handler may run in the middle of a print on the main thread
        os.write(2, f"\n[stop] {self.signalled}: stopping after this step (send it again to stop now)\n".encode())

    def why(self, check_ranks: bool) -> str:
        """Why to stop now ('' = go on); with several ranks only where check_ranks (the same step on all)."""
        mine = self.signalled or ("--time-limit" if time.monotonic() >= self.deadline else "")
        if self.world == 1:
            return mine
        if not check_ranks:
            return ""
        flag = all_sum(torch.tensor([float(bool(mine))], device=self.device))
        return mine or ("another rank's stop" if flag.item() else "")

    def close(self):
        for s, before in self.previous.items():
            if signal.getsignal(s) == self.on_signal:
                signal.signal(s, before)
