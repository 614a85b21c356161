"""Chat datasets: loading (packaged ShareGPT, JSON / JSONL / Parquet through `datasets`),
tokenization into Examples, a held-out split, and deterministic global batches.
"""

import gzip
import json
import lzma
import multiprocessing as mp
import os
import zlib
from collections import Counter
from pathlib import Path

import torch

from data.assets import asset_path
from data.chat import DataError, Example, check_template, to_messages, tokenize_chat

SHAREGPT = "sharegpt"  # the packaged ShareGPT V3 file (original human/ChatGPT answers)
# The same prompts with every assistant turn rewritten by SmolLM2-135M-Instruct itself (capture.py
# regenerate on an H200; settings and counts in its provenance JSON): the training default (v1 here, v3
# below since), since a draft learns best from text its target would actually produce.
SHAREGPT_REGEN = "sharegpt-regen"  # v1: 3,390 chats, sampled at temperature 0.8, HF generate
REGEN_FILE = Path(__file__).resolve().parent / "sharegpt_smollm2_regen" / "regen.jsonl.xz"
# v3, the default: 16,808 chats (up to 3 replies each), greedy, the slot engine (models/generate.py);
# data/sharegpt_smollm2_greedy/README.md says why greedy
SHAREGPT_GREEDY = "sharegpt-greedy"
GREEDY_FILE = Path(__file__).resolve().parent / "sharegpt_smollm2_greedy" / "regen.jsonl.xz"
PACKAGED = {SHAREGPT_GREEDY: GREEDY_FILE, SHAREGPT_REGEN: REGEN_FILE}
DEFAULT_DATA = SHAREGPT_GREEDY


def read_truncated_json_array(path: Path, limit: int | None = None) -> list[dict]:
    """Records of a JSON array file that may be cut off mid-record (the packaged ShareGPT is):
    decode record by record and stop at the first incomplete one."""
    text = path.read_text(encoding="utf-8", errors="replace")
    dec, records = json.JSONDecoder(), []
    i = text.index("[") + 1
    n = len(text)
    while limit is None or len(records) < limit:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        records.append(obj)
    return records


# Compressed text: .gz (what the GPU machine's generators write: fast) and .xz (the packaged data: ~40%
# smaller than gzip -9, and every device call carries the whole repository)
OPENERS = {
    ".gz": (gzip.open, "gzip", (EOFError, gzip.BadGzipFile, zlib.error)),
    ".xz": (lzma.open, "xz", (EOFError, lzma.LZMAError)),
}
PLAIN = (open, "", ())


def text_lines(path: Path):
    """(line number, line) of a text file, decompressing .gz and .xz: a byte that is not UTF-8 or a compressed
    stream that is cut off or damaged is a DataError naming the file and line (they were a UnicodeDecodeError or
    an EOFError from deep inside the reader). Each line is decoded alone so that the line number is exact."""
    opener, kind, broken = OPENERS.get(path.suffix.lower(), PLAIN)
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(
                        f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                        "line); convert the file to UTF-8"
                    ) from None
                yield lineno, line
    except broken as e:
        raise DataError(f"{path}: the {kind} data is cut off or damaged after line {lineno} ({e})") from None


def json_line_error(e: json.JSONDecodeError, line: str) -> str:
    """Where a JSON line is malformed. The line is parsed without its newline: with it, a line cut off
    mid-record failed at 'line 2 column 1', i.e. every such message said column 1."""
    where = "the end of the line: cut off?" if e.pos >= len(line) else f"column {e.colno}"
    return f"malformed JSON line ({e.msg.removesuffix(' at')} at {where})"  # 'Unterminated string starting at'


def json_object_line(path: Path, lineno: int, line: str, not_object: str) -> dict | None:
    """The JSON object on one line of a JSON-lines file (a line of `text_lines`), None for a blank line. A malformed
    line or one that holds no object is a DataError naming the file and line (`not_object`, then the type found)."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: {json_line_error(e, line)}") from None
    if not isinstance(rec, dict):
        raise DataError(f"{path}:{lineno}: {not_object} {type(rec).__name__}")
    return rec


def _find_bad_json_line(path: Path) -> str:
    """Why `datasets` could not read a .json(.gz) file: one JSON document (e.g. an array of records) is
    parsed whole, so the line and column are the document's; JSON lines one by one."""
    text = "".join(line for _, line in text_lines(path))
    first = next((x for x in text.splitlines() if x.strip()), "")
    try:
        is_lines = isinstance(json.loads(first), dict) and first.strip() != text.strip()
    except json.JSONDecodeError:
        is_lines = False
    if not is_lines:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}:{e.lineno}: malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"
        if isinstance(doc, list) and (bad := next((r for r in doc if not isinstance(r, dict)), None)) is not None:
            return f"{path}: expected a JSON array of objects, got a {type(bad).__name__} in it"
        return f"{path}: could not be read as JSON lines or a JSON array"
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                return f"{path}:{lineno}: {json_line_error(e, line)}"
            if not isinstance(rec, dict):
                return f"{path}:{lineno}: expected a JSON object per line, got {type(rec).__name__}"
    return f"{path}: could not be read as JSON lines or a JSON array"


# What load_records reads: name endings -> loader (JSON lines with the standard library, the rest
# through `datasets`). JSON files hold one JSON array of records or one record per line; .gz and .xz
# ones are decompressed on the fly (JSON lines .xz only: the standard library reads them).
FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".json.gz": "json",
    ".jsonl.gz": "json",
    ".jsonl.xz": "json",
    ".parquet": "parquet",
}
JSONL = tuple(end for end in FORMATS if end.startswith(".jsonl"))  # read with the standard library
SUPPORTED = ", ".join(FORMATS) + " or a directory of such files"


def data_format(path: Path) -> str | None:
    """'json' | 'parquet' for a file load_records reads, else None (by its name's ending)."""
    name = path.name.lower()
    return next((kind for end, kind in FORMATS.items() if name.endswith(end)), None)


def read_jsonl(files: list[Path], limit: int | None = None) -> list[dict]:
    """JSON lines read with the standard library: records may differ in their other fields (a
    self-instruct file beside a regenerated one; `datasets` infers one Arrow schema and fails on
    that), a bad line is named by file and line number, and the GPU box needs no `datasets`."""
    out = []
    for path in files:
        for lineno, line in text_lines(path):
            if limit is not None and len(out) >= limit:
                return out
            rec = json_object_line(path, lineno, line, "expected a JSON object per line, got")
            if rec is not None:
                out.append(rec)
    return out


def load_records(source: str, limit: int | None = None) -> list[dict]:
    """'sharegpt', 'sharegpt-greedy', 'sharegpt-regen', or a .json(.gz) / .jsonl(.gz, .xz) / .parquet file (or
    a directory of them)."""
    if source == SHAREGPT:
        return read_truncated_json_array(asset_path("sharegpt"), limit)
    path = PACKAGED.get(source) or Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"dataset '{source}' not found (use 'sharegpt', {', '.join(map(repr, PACKAGED))} or a path: {SUPPORTED})"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and data_format(p))
        if not files:
            found = sorted(p.name for p in path.iterdir())
            raise DataError(
                f"{path}: no data files inside (found {found[:5]}{' ...' if len(found) > 5 else ''}); "
                f"supported: {SUPPORTED}"
            )
    else:
        files = [path]
        if data_format(path) is None:
            ext = "".join(path.suffixes[-2:]) if path.suffix in OPENERS else path.suffix
            raise DataError(
                f"{path}: the format {ext or '(no extension)'} is not supported; supported: {SUPPORTED} "
                "(records with a 'messages' [{role, content}] or 'conversations' [{from, value}] list)"
            )
    kinds = {data_format(f) for f in files}
    if len(kinds) > 1:
        raise DataError(f"{path} mixes JSON and Parquet files; put them in separate directories")
    if all(f.name.lower().endswith(JSONL) for f in files):
        return read_jsonl(files, limit)
    import datasets  # optional: Hugging Face datasets (slow import, not on the GPU box), for JSON / Parquet only

    datasets.disable_progress_bars()
    kind = kinds.pop()
    try:
        ds = datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train")
    except Exception as e:  # datasets wraps JSON errors deep inside arrow; say where the bad line is
        if kind == "json":
            bad = [_find_bad_json_line(f) for f in files]
            raise DataError("; ".join(b for b in bad if "malformed" in b or "expected" in b) or bad[0]) from e
        raise DataError(f"{path}: cannot load as {kind}: {e}") from e
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    return ds.to_list()


# Records below this tokenize in-process; above it a pool of processes shares them (rendering the chat
# template and placing the loss mask is pure Python: ~4 ms a conversation, over a minute for the 16.8k
# default chats, paid at every start of train.py / capture.py).
PARALLEL_MIN = 4000
_WORKER: dict = {}


def tokenize_workers(n_records: int) -> int:
    """Processes build_examples uses for n_records: one per 2,000 records, up to the CPUs this
    process may run on (at most 16); 1 below PARALLEL_MIN."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 1 if n_records < PARALLEL_MIN else max(1, min(cpus, 16, n_records // 2000))


def _tokenize(records, first: int, tokenizer, max_len: int) -> tuple[list[Example], Counter]:
    """Examples of records[i] (numbered first + i in errors) and the counts of what was skipped."""
    stats, out = Counter(), []
    for idx, rec in enumerate(records, first):
        try:
            messages = to_messages(rec)
        except DataError as e:
            raise DataError(f"record {idx} (id {rec.get('id', '?')}): {e}") from e
        ex = tokenize_chat(tokenizer, messages, max_len, stats)
        if ex is not None:
            out.append(ex)
    return out, stats


def _init_worker(tokenizer, max_len: int):
    _WORKER.update(tokenizer=tokenizer, max_len=max_len)


def _tokenize_chunk(job):
    first, records = job
    return _tokenize(records, first, _WORKER["tokenizer"], _WORKER["max_len"])


def build_examples(
    records: list[dict], tokenizer, max_len: int, stats: Counter | None = None, workers: int | None = None
) -> list[Example]:
    """Tokenize records; bad or untrainable records are counted in `stats`, never silently. workers
    (default tokenize_workers(len(records))) > 1: chunks in a pool of forked processes, the same
    examples in the same order, and a bad record's error is the first one in record order."""
    check_template(tokenizer)
    stats = Counter() if stats is None else stats
    workers = tokenize_workers(len(records)) if workers is None else workers
    if workers > 1:
        records = list(records)
        step = -(-len(records) // (4 * workers))  # 4 chunks a worker: the slow chats even out
        jobs = [(i, records[i : i + step]) for i in range(0, len(records), step)]
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
        with ctx.Pool(workers, _init_worker, (tokenizer, max_len)) as pool:
            parts = list(pool.imap(_tokenize_chunk, jobs))  # in order: the first bad record's chunk raises first
    else:
        parts = [_tokenize(records, 0, tokenizer, max_len)]
    out = []
    for examples, counts in parts:
        out += examples
        stats.update(counts)
    if records and not out:
        raise DataError(
            f"none of the {len(records)} records has anything to train on (max_len {max_len}): "
            f"{dict(sorted(stats.items()))}"
        )
    return out


def split_holdout(examples: list[Example], holdout: int) -> tuple[list[Example], list[Example]]:
    """The last `holdout` examples are held out (fixed, independent of the training seed)."""
    if holdout >= len(examples):
        raise DataError(f"only {len(examples)} usable examples, cannot hold out {holdout}")
    return examples[: len(examples) - holdout], examples[len(examples) - holdout :]


def collate(examples: list[Example], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids/loss_mask/attention_mask [B, T_max]."""
    T = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), T), dtype=torch.long)
    attn = torch.zeros((len(examples), T), dtype=torch.long)
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        ids[b, :n] = torch.tensor(e.input_ids)
        mask[b, :n] = torch.tensor(e.loss_mask)
        attn[b, :n] = 1
    return {"input_ids": ids, "loss_mask": mask, "attention_mask": attn}


def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """Epoch `epoch`'s order of n examples, seeded by (seed, epoch): GlobalBatches and TokenBatches."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


class GlobalBatches:
    """Deterministic global batches: epoch e is a permutation seeded by (seed, e); step s of the
    run is batch s % per_epoch of epoch s // per_epoch. The data position is thus just the step,
    so resume and any number of ranks see exactly the same samples. Rank r of W takes the r-th
    contiguous slice of each global batch."""

    def __init__(self, n: int, global_batch: int, seed: int):
        if global_batch > n:
            raise DataError(f"global batch {global_batch} is larger than the dataset ({n} examples)")
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.per_epoch = n // global_batch
        self._perm_epoch, self._perm = -1, None

    def indices(self, step: int, rank: int = 0, world: int = 1) -> list[int]:
        if self.global_batch % world:
            raise ValueError(f"global batch {self.global_batch} is not divisible by {world} ranks")
        epoch, i = divmod(step, self.per_epoch)
        if epoch != self._perm_epoch:
            self._perm, self._perm_epoch = epoch_permutation(self.n, self.seed, epoch), epoch
        batch = self._perm[i * self.global_batch : (i + 1) * self.global_batch]
        local = self.global_batch // world
        return batch[rank * local : (rank + 1) * local]

    def first(self, step: int, rank: int = 0, world: int = 1) -> int:
        """How many examples of the step the ranks before `rank` hold (as TokenBatches.first)."""
        return rank * (self.global_batch // world)
