"""Devices and process groups: what train.py, capture.py and core/disagg/ share.

Under torchrun (RANK set) init_distributed() joins the process group (NCCL on GPU, gloo on CPU);
without it everything here is a no-op, so the same code runs one process.
"""

import os
import sys

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def pick_device(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """(device kind, dtype) of --device auto|cpu|cuda and --dtype auto|<DTYPES>; other values are one error
    line (--dtype other was a KeyError traceback; --device cuda without a GPU failed deep in the run)."""
    if device not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"error: --device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device here")
    if dtype != "auto" and dtype not in DTYPES:
        raise SystemExit(f"error: --dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    kind = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    # bf16 on GPU; fp32 on CPU, where bf16 matmuls are emulated and ~30x slower
    return kind, DTYPES["bf16" if kind == "cuda" else "fp32"] if dtype == "auto" else DTYPES[dtype]


def init_distributed(device_kind: str):
    """(rank, world, local rank); (0, 1, 0) outside torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, 0
    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank, world, local = dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))
    if device_kind == "cpu":  # share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    return rank, world, local


def all_sum(x: torch.Tensor) -> torch.Tensor:
    """x summed over all ranks, in place."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


def all_min(x: torch.Tensor) -> torch.Tensor:
    """x's smallest value over all ranks, in place: a figure each rank measured that all must agree on (the
    token budget a GPU's memory allows: one rank's larger budget would split the data differently)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
    return x


def barrier():
    if dist.is_initialized():
        dist.barrier()


def destroy():
    """Leave the process group (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_without_teardown(code) -> None:
    """End a torchrun rank now, with `code` (a SystemExit's: None, an exit status or an error message), skipping
    the interpreter's teardown. Once FSDP2 has sharded a module, gloo's threads outlive destroy_process_group()
    (two ranks, torch 2.13: its run-loop threads are still there after it and a gc; after a plain all_reduce they
    are gone; DTensor's caches keep the mesh), and the C++ teardown at exit can then destroy them still joinable:
    "terminate called without an active exception", SIGABRT, and torchrun reports a finished run as failed (a
    2-rank CI test, once, 2026-12-06). Every file of the run is closed by then (RunLog.finish / fail); only the
    output streams need flushing."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
