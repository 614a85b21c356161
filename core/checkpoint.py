"""A training run's checkpoints: the directory layout (<out>/ckpt/step_N, complete or absent, and ckpt/latest naming
the newest), the training state written beside the draft (`save`), restored for --resume (`restore`: the newest
intact checkpoint) and --init-draft's weights (`init_from`). core/trainer.py calls these; export.py writes the same
layout for an imported draft (write_checkpoint, with no training state).

One checkpoint directory: draft.safetensors (the full, unsharded draft), config.json ({strategy, draft, target}),
train_state.pt ({optim, sched, step, rng: one entry per rank, world})."""

import errno
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from core.distributed import barrier

STATE_KEYS = {"optim", "sched", "step", "rng", "world"}  # what train_state.pt holds


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read back."""


def checkpoints(out: Path) -> list[Path]:
    """Complete checkpoint dirs of `out`, the one ckpt/latest names first, then the others newest first."""
    ck = out / "ckpt"
    if not ck.is_dir():
        return []
    steps = sorted(
        (d for d in ck.glob("step_*") if d.is_dir() and d.name[5:].isdigit()), key=lambda d: -int(d.name[5:])
    )
    latest = ck / "latest"
    try:
        named = ck / latest.read_text().strip() if latest.exists() else None
    except OSError:
        named = None
    return ([named] if named in steps else []) + [d for d in steps if d != named]


def write_checkpoint(ck: Path, name: str, draft_sd: dict, meta: dict, extra=None) -> Path:
    """A training checkpoint as train.py writes it and export.py --import-from mimics: ck/<name>.tmp
    holding draft.safetensors and config.json (meta: {strategy, draft, target, ...}), plus whatever
    extra(tmp) writes (train.py: train_state.pt), renamed to ck/<name> when complete (a checkpoint
    directory is complete or absent), then ck/latest replaced atomically. A failed write removes the
    partial directory and latest.tmp, leaves earlier checkpoints as they were, and re-raises."""
    d, latest_tmp = ck / name, ck / "latest.tmp"
    tmp = d.with_name(d.name + ".tmp")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in draft_sd.items()}, tmp / "draft.safetensors")
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))
        if extra is not None:
            extra(tmp)
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)
        latest_tmp.write_text(d.name)
        os.replace(latest_tmp, ck / "latest")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        latest_tmp.unlink(missing_ok=True)
        raise
    return d


def save(out: Path, step: int, draft, opt, sched, meta: dict, rank: int, world: int, device: torch.device):
    """ckpt/step_N of a run on `world` ranks (a collective: every rank calls it). The draft and optimizer state
    gathered whole to the CPU (FSDP2 shards included), every rank's RNG state, written by rank 0; a failed write
    (disk full, ...) is one CheckpointError naming it, with the earlier checkpoints kept."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(draft, opt, options=opts)
    rng = {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device.type == "cuda" else None}
    rngs = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if rank == 0:
        state = {"optim": optim_sd, "sched": sched.state_dict(), "step": step, "rng": rngs, "world": world}
        _write(out, step, model_sd, meta, state)
    barrier()


def _write(out: Path, step: int, model_sd: dict, meta: dict, state: dict):
    ck = out / "ckpt"
    d = ck / f"step_{step}"
    try:
        write_checkpoint(ck, d.name, model_sd, meta, lambda tmp: torch.save(state, tmp / "train_state.pt"))
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError ("file write failed")
        why = "no space left on the device" if getattr(e, "errno", None) == errno.ENOSPC else f"{type(e).__name__}: {e}"
        try:
            free = f"; {shutil.disk_usage(ck).free / 2**20:.0f} MiB free there"
        except OSError:
            free = ""
        kept = [c.name for c in checkpoints(out)]
        raise CheckpointError(
            f"cannot write checkpoint {d} ({why}{free}); removed the partial {d.name}.tmp; "
            + (
                f"earlier checkpoints kept: {', '.join(kept)} (continue with --resume)"
                if kept
                else "no earlier checkpoint"
            )
        ) from None


def _newest_intact(out: Path, say) -> tuple[Path, dict, dict]:
    """(dir, train_state, draft tensors) of the latest checkpoint of `out`; if its files are damaged (truncated,
    corrupted), of the newest intact earlier one, saying so."""
    found = checkpoints(out)
    if not found:
        raise CheckpointError(f"--resume: no checkpoint in {out / 'ckpt'}")
    damaged = []
    for d in found:
        try:
            f = d / "train_state.pt"
            state = torch.load(f, weights_only=False)
            if not isinstance(state, dict) or not STATE_KEYS <= state.keys():
                raise ValueError("not a train_state (keys missing)")
            f = d / "draft.safetensors"
            model_sd = load_file(f)
        except Exception as e:  # any unreadable file: truncated zip, bad safetensors header, missing file, ...
            why = str(e).splitlines()[0][:200] if str(e) else ""
            damaged.append(f"{f} ({type(e).__name__}{': ' + why if why else ''})")
            say(f"[resume] {f} is damaged or unreadable ({type(e).__name__}{': ' + why if why else ''})")
            continue
        if damaged:
            say(f"[resume] falling back to the previous intact checkpoint {d} (the later one(s) are left as they are)")
        return d, state, model_sd
    raise CheckpointError(f"--resume: no intact checkpoint in {out / 'ckpt'}: " + "; ".join(damaged))


def restore(out: Path, draft, opt, sched, rank: int, world: int, device: torch.device, say) -> int:
    """--resume: the newest intact checkpoint of `out` loaded into the draft, optimizer and schedule (and this
    rank's RNG state when the world size is the one it was written with); returns its step."""
    d, state, model_sd = _newest_intact(out, say)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    try:
        set_state_dict(draft, opt, model_state_dict=model_sd, optim_state_dict=state["optim"], options=opts)
        sched.load_state_dict(state["sched"])
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"--resume: checkpoint {d} does not fit this draft (was it written with other options, "
            f"e.g. --strategy, --ttt-length, --draft-vocab-size?): {str(e).splitlines()[0][:300]}"
        ) from None
    if state["world"] == world:  # per-rank RNG streams only line up with the same world size
        rng = state["rng"][rank]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"])
    say(f"[resume] {d} at step {state['step']}")
    return state["step"]


def init_from(draft, d: Path, strategy: str, say):
    """--init-draft: a checkpoint's (or a dir's draft.safetensors') tensors, its d2t/t2d too, loaded into the freshly
    built draft, refusing a draft of another family or config."""
    if not (d / "draft.safetensors").exists():
        found = checkpoints(d)
        if not found:
            raise CheckpointError(f"--init-draft {d}: no draft.safetensors and no checkpoint in {d / 'ckpt'}")
        d = found[0]
    try:
        meta = json.loads((d / "config.json").read_text())
        sd = load_file(d / "draft.safetensors")
    except Exception as e:  # missing or damaged file
        raise CheckpointError(f"--init-draft {d}: unreadable ({type(e).__name__}: {str(e)[:200]})") from None
    ours, theirs = draft.config.to_dict(), meta.get("draft", {})
    differ = sorted(k for k in {*ours, *theirs} if ours.get(k) != theirs.get(k))
    if meta.get("strategy") != strategy or differ:
        raise CheckpointError(
            f"--init-draft {d}: a {meta.get('strategy')} draft whose config differs from the {strategy} "
            f"draft these flags build in {differ} (theirs {[theirs.get(k) for k in differ]}, "
            f"ours {[ours.get(k) for k in differ]})"
        )
    draft.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    say(f"[draft] initialised from {d}")
