"""What capture.py's subcommands share: the checks on --target, --data and --out before anything loads, and
the resumable JSONL output of `regenerate` (core/regenerate.py) and `prompts` (core/prompts.py): the sidecars
beside it, the provenance that proves it is the command's own, the repair of a line cut by a crash, and appends
that reach the disk."""

import json
import os
from pathlib import Path

from core.runlog import os_why, output_kind, probe_write
from models.target import past_context


def check_out(out: Path, is_dir: bool):
    """--out before anything is loaded: a store directory (features) or an output file (regenerate,
    prompts) that can be written, as one error line (they were a PermissionError or an OSError from a
    mkdir deep in the run, after the target had loaded). Nothing of an existing --out is changed."""

    if not is_dir and out.is_dir():
        raise SystemExit(f"error: --out {out} is a directory; give a file name")
    if is_dir and out.exists() and not out.is_dir():
        raise SystemExit(f"error: --out {out} is a file; the feature store is a directory")
    where = out if is_dir else out.parent
    while not where.exists() and where != where.parent:  # nothing is created here: a probe in the nearest
        where = where.parent  # existing directory, where the run's mkdir would write
    if not where.is_dir():
        raise SystemExit(f"error: --out {out}: {where} is a file, not a directory")
    try:
        probe_write(where)
        if not is_dir and out.exists():
            open(out, "ab").close()  # appending nothing: the file is writable, its bytes untouched
    except OSError as e:
        raise SystemExit(f"error: --out {out}: cannot write there: {os_why(e)}") from None


def check_inputs(target: str, data: str | None = None):
    """Another command's output given as --target or --data, one `error:` line before anything loads (a draft
    export as --target was a tokenizer error after seconds, a run as --data an error about its metrics.jsonl)."""
    if kind := output_kind(target):
        raise SystemExit(
            f"error: --target {target} is {kind}, not a target model (a Hugging Face model dir, a .gguf or 'smollm2')"
        )
    if data is not None and (kind := output_kind(data)):
        raise SystemExit(f"error: --data {data} is {kind}, not chats (a ShareGPT/messages-style file or directory)")


def check_context(target_dir: Path, tokens: int, what: str):
    """A generation length past the target's context, refused before it loads: the hf engine decoded past it for
    as long as asked, the slots engine sized every slot's KV cache by it."""
    if why := past_context(target_dir, tokens, what):
        raise SystemExit("error: " + why)


def sidecars(out: Path) -> tuple[Path, Path]:
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(stem + ".dropped.jsonl"), out.with_name(stem + ".provenance.json")


def provenance(out: Path, command: str) -> dict | None:
    """The provenance beside --out of an earlier `capture.py COMMAND` (None: no earlier run). Resuming
    repairs and rewrites --out and its .dropped.jsonl, so they must be this command's own: an existing
    --out or .dropped.jsonl without its provenance, or with another command's or a damaged one, is
    refused and left as it is."""
    dropped_path, prov_path = sidecars(out)
    if not prov_path.exists():
        if found := [p for p in (out, dropped_path) if p.exists() and (not p.is_file() or p.stat().st_size)]:
            raise SystemExit(
                f"error: --out {out}: {found[0]} exists but was not written by capture.py {command} (no "
                f"{prov_path.name} beside it), so it is not resumed or changed: use another --out, or move it aside"
            )
        return None
    try:
        prov = json.loads(prov_path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(
            f"error: {prov_path} is damaged or unreadable ({type(e).__name__}: {e}); {out} is left as it is: "
            "use another --out, or move them aside"
        ) from None
    # regenerate records its "source" data; prompts counts the "batches" it sampled
    mine = {"regenerate": lambda p: "source" in p, "prompts": lambda p: "batches" in (p.get("counts") or {})}[command]
    if not (isinstance(prov, dict) and isinstance(prov.get("settings"), dict) and mine(prov)):
        raise SystemExit(
            f"error: --out {out}: {prov_path} is not the provenance of capture.py {command} output, so {out} is "
            "not resumed or changed: use another --out"
        )
    return prov


def read_jsonl_repair(path: Path) -> list[dict]:
    """Lines of a JSONL this command appends to (provenance checked that it is ours). A last line without
    its newline is a crash mid-write: cut off when it is not whole JSON, else kept and given its newline."""
    if not path.exists():
        return []
    raw = path.read_bytes()
    if raw and not raw.endswith(b"\n"):
        keep = raw.rfind(b"\n") + 1
        try:
            json.loads(raw[keep:])
            whole = True
        except ValueError:
            whole = False
        if whole:
            with open(path, "ab") as f:
                f.write(b"\n")
            raw += b"\n"
        else:
            print(f"[regen] {path}: dropping a partial last line ({len(raw) - keep} bytes)", flush=True)
            with open(path, "r+b") as f:
                f.truncate(keep)
            raw = raw[:keep]
    rows = []
    for n, line in enumerate(raw.decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:  # not a crash mid-write: the file was damaged or mixed; keep it as it is
            raise SystemExit(
                f"error: {path}:{n}: not a JSON line ({e.msg}); nothing was changed. Fix or remove that line "
                f"(or move the file aside to start over) and rerun to resume"
            ) from None
    return rows


def append_rows(path: Path, rows: list[dict]):
    if not rows:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())
