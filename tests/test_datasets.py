import gzip
import hashlib
import json
import lzma
from collections import Counter
from pathlib import Path

import pytest

from core.train_config import TrainConfig
from data.benchmarks import load_prompts
from data.chat import DataError
from data.datasets import (
    DEFAULT_DATA,
    PACKAGED,
    GlobalBatches,
    build_examples,
    load_records,
    read_truncated_json_array,
    tokenize_workers,
)
from data.selfinstruct import BenchmarkGuard, benchmark_prompts


def test_truncated_json_array_recovers_complete_records(tmp_path):
    recs = [{"id": i, "conversations": [{"from": "human", "value": f"q{i}"}]} for i in range(5)]
    text = json.dumps(recs, indent=2)
    cut = text.index('"id": 4') - 5  # cut inside the last record
    p = tmp_path / "cut.json"
    p.write_text(text[:cut])
    assert read_truncated_json_array(p) == recs[:4]
    assert read_truncated_json_array(p, limit=2) == recs[:2]
    p.write_text(text)
    assert read_truncated_json_array(p) == recs


def test_packaged_sharegpt_reads():
    recs = load_records("sharegpt", limit=50)
    assert len(recs) == 50 and all("conversations" in r for r in recs)


def test_malformed_jsonl_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    p.write_text(good + "\n" + good + "\n{not json\n" + good + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:3: malformed JSON"):
        load_records(str(p))

    with gzip.open(tmp_path / "bad.jsonl.gz", "wt") as f:
        f.write(p.read_text())
    with pytest.raises(DataError, match=r"bad.jsonl.gz:3: malformed JSON"):
        load_records(str(tmp_path / "bad.jsonl.gz"))


def test_jsonl_and_parquet_load_the_same(tmp_path):
    import datasets  # optional and slow: Hugging Face datasets (~2 s to import), only to write Parquet

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(4)
    ]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    assert load_records(str(tmp_path / "c.jsonl")) == rows == load_records(str(tmp_path / "c.parquet"))


def test_jsonl_records_with_different_fields_load(tmp_path):
    """Self-instruct answers (id, batch, new_tokens, ...) concatenated with regenerated chats (id, turns,
    hit_max_new_tokens): valid JSON lines whose other fields differ load as they are, in file order
    (on the H200, 2026-12-01, `datasets` refused such a file as 'could not be read as JSON lines')."""
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [
        {"id": "si0-1", "batch": 0, "new_tokens": 5, "messages": chat},
        {"id": "x_0", "messages": chat, "turns": 1, "hit_max_new_tokens": 0},
        {"id": "x_1", "messages": chat, "turns": [1, 2]},
    ]
    with gzip.open(tmp_path / "mix.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    assert load_records(str(tmp_path / "mix.jsonl.gz")) == rows
    assert load_records(str(tmp_path / "mix.jsonl.gz"), limit=2) == rows[:2]


def test_missing_dataset_is_clear():
    with pytest.raises(FileNotFoundError, match="not found"):
        load_records("/nonexistent/chats.jsonl")


def test_bad_record_names_the_record(smollm2_tokenizer):
    with pytest.raises(DataError, match="record 1"):
        build_examples([{"messages": []}, {"text": "x"}], smollm2_tokenizer, 64)


def test_global_batches_deterministic_and_rank_split():
    gb = GlobalBatches(50, 8, seed=3)
    one = [gb.indices(s) for s in range(12)]
    assert [GlobalBatches(50, 8, seed=3).indices(s) for s in range(12)] == one
    for s in range(12):
        assert gb.indices(s, 0, 2) + gb.indices(s, 1, 2) == one[s]
    epoch0 = sum(one[:6], [])
    assert len(set(epoch0)) == 48  # no repeats within an epoch
    assert one[6] != one[0]  # next epoch reshuffles


@pytest.mark.parametrize("name,n", [("sharegpt-greedy", 16808), ("sharegpt-regen", 3390)])
def test_packaged_regenerated_chats(name, n):
    assert TrainConfig().data == DEFAULT_DATA == "sharegpt-greedy"
    recs = load_records(name)
    prov = json.loads((PACKAGED[name].parent / "regen.provenance.json").read_text())
    assert len(recs) == prov["counts"]["written"] == n == len({r["id"] for r in recs})
    assert all(r["messages"][-1]["role"] == "assistant" for r in recs)


def test_unsupported_format_is_named_not_malformed_json(tmp_path):
    """A CSV (or any other format) is not reported as 'malformed JSON': the error names the file,
    its format and the supported ones."""
    p = tmp_path / "chats.csv"
    p.write_text("role,content\nuser,hi\nassistant,hello\n")
    with pytest.raises(
        DataError,
        match=r"chats.csv: the format .csv is not supported; supported: .json, .jsonl, "
        r".json.gz, .jsonl.gz, .jsonl.xz, .parquet or a directory",
    ) as e:
        load_records(str(p))
    assert "malformed" not in str(e.value)
    with pytest.raises(DataError, match=r"\.tar\.gz is not supported"):
        (tmp_path / "chats.tar.gz").write_bytes(b"\x1f\x8b")
        load_records(str(tmp_path / "chats.tar.gz"))
    # a directory without a supported file says what it found
    with pytest.raises(DataError, match=r"no data files inside \(found \['chats.csv', 'chats.tar.gz'\]\); supported"):
        load_records(str(tmp_path))


def test_compressed_jsonl_and_directories_load(tmp_path):
    import datasets  # optional and slow: Hugging Face datasets (~2 s to import), only to write Parquet

    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(4)
    ]
    d = tmp_path / "d"
    d.mkdir()
    with gzip.open(d / "a.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[:2]))
    (d / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[2:3]))
    with lzma.open(d / "c.jsonl.xz", "wt") as f:  # the packaged data's compression
        f.write("".join(json.dumps(r) + "\n" for r in rows[3:]))
    (d / "README.md").write_text("ignored")
    assert load_records(str(d)) == rows
    datasets.Dataset.from_list(rows).to_parquet(str(d / "c.parquet"))
    with pytest.raises(DataError, match="mixes JSON and Parquet"):
        load_records(str(d))


def test_no_trainable_record_is_an_error_with_the_counts(smollm2_tokenizer):
    """Only empty assistant turns / no assistant / nothing within max_len: an error with the counts,
    not an empty dataset that fails later for another reason."""
    recs = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
    ]
    with pytest.raises(
        DataError,
        match=r"none of the 2 records has anything to train on .*'empty_assistant_turns': 1, "
        r"'skipped_empty_assistant': 1, 'skipped_no_assistant': 1",
    ):
        build_examples(recs, smollm2_tokenizer, 64)
    long = [{"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "fine"}]}]
    with pytest.raises(DataError, match="skipped_nothing_trainable_within_max_len': 1"):
        build_examples(long, smollm2_tokenizer, 64)


def test_benchmark_prompts_are_not_in_the_packaged_training_chats():
    """τ is measured on MT-Bench, HumanEval and GSM8K (and unseen ShareGPT prompts): none of their
    prompts (first 80 characters, whitespace and case normalised) may occur in a user turn of the
    regenerated training sets."""
    norm = lambda t: " ".join(t.split()).lower()
    for name in ("sharegpt-greedy", "sharegpt-regen"):
        blob = "\n".join(norm(m["content"]) for r in load_records(name) for m in r["messages"] if m["role"] == "user")
        for ds in ("mtbench", "humaneval", "gsm8k"):
            keys = [norm(t)[:80] for turns in load_prompts(ds, 0) for t in turns]
            assert len(keys) > 80 and not [k for k in keys if k in blob], (name, ds)
        # the ShareGPT prompts τ is measured on as "never trained on" (README, "The shipped draft")
        unseen = [
            norm(t)[:80]
            for turns in load_prompts(
                str(Path(__file__).resolve().parents[1] / "experiments/results/useful_draft/unseen_sharegpt.jsonl"), 0
            )
            for t in turns
        ]
        assert len(unseen) == 10 and not [k for k in unseen if k in blob], name


def test_parallel_tokenization_equals_serial(smollm2_tokenizer):
    """build_examples over a pool of processes: the same examples in the same order and the same counts;
    a bad record is reported by its index in the whole list, the first bad one in record order."""
    recs = load_records("sharegpt-greedy", 240)
    s1, s3 = Counter(), Counter()
    serial, parallel = (
        build_examples(recs, smollm2_tokenizer, 256, s1, workers=1),
        build_examples(recs, smollm2_tokenizer, 256, s3, workers=3),
    )
    assert len(serial) > 200 and s1["truncated"] > 0
    assert [(e.input_ids, e.loss_mask) for e in serial] == [(e.input_ids, e.loss_mask) for e in parallel]
    assert s1 == s3
    bad = [*recs[:150], {"text": "no messages"}, *recs[150:170], {"oops": 1}]
    with pytest.raises(DataError, match="record 150 "):
        build_examples(bad, smollm2_tokenizer, 256, workers=3)
    assert tokenize_workers(100) == 1 and tokenize_workers(10**6) <= 16


def test_committed_self_instruct_prompts_share_no_8_words_with_a_benchmark():
    """Every prompt the target wrote and the repository keeps for training (data/smollm2_domains,
    data/smollm2_selfinstruct) passed the benchmark guard when it was written; this reads them back
    against it, so a file added by hand or by another generator cannot carry a benchmark prompt in."""
    guard = BenchmarkGuard(benchmark_prompts())
    root = Path(__file__).resolve().parents[1] / "data"
    files = sorted(root.glob("smollm2_domains/prompts_*.jsonl.xz")) + [root / "smollm2_selfinstruct/prompts.jsonl.xz"]
    assert len(files) >= 10
    n = 0
    for f in files:
        with lzma.open(f, "rt", encoding="utf-8") as fh:
            for line in fh:
                user = json.loads(line)["messages"][0]["content"]
                assert not guard.hits(user), (f.name, user[:200])
                n += 1
    assert n > 100_000


def test_manifest_hashes_the_packaged_sources_content():
    """data/smollm2_domains/manifest.json names the packaged v3 and self-instruct files by the SHA256 of their JSONL
    (the files were recompressed from gzip to xz: the content, and so the hash, must not have changed)."""
    root = Path(__file__).resolve().parents[1] / "data"
    rows = {r["file"]: r for r in json.loads((root / "smollm2_domains/manifest.json").read_text())["sources"]}
    for name, path in [
        ("v3_sharegpt.jsonl.xz", "sharegpt_smollm2_greedy/regen.jsonl.xz"),
        ("selfinstruct_open.jsonl.xz", "smollm2_selfinstruct/answers.jsonl.xz"),
    ]:
        assert hashlib.sha256(lzma.open(root / path).read()).hexdigest() == rows[name]["sha256"], name
