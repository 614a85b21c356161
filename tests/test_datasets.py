import json

import pytest

from data.chat import DataError
from data.datasets import GlobalBatches, build_examples, load_records, read_truncated_json_array


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


def test_jsonl_and_parquet_load_the_same(tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(4)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "c.parquet"))
    assert load_records(str(tmp_path / "c.jsonl")) == rows == load_records(str(tmp_path / "c.parquet"))


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


def test_packaged_regenerated_chats_are_the_default():
    import json

    from data.datasets import REGEN_FILE, SHAREGPT_REGEN
    from train import TrainConfig

    assert TrainConfig().data == SHAREGPT_REGEN
    recs = load_records(SHAREGPT_REGEN)
    prov = json.loads((REGEN_FILE.parent / "regen.provenance.json").read_text())
    assert len(recs) == prov["counts"]["written"] == 3390
    assert all(r["messages"][-1]["role"] == "assistant" for r in recs)
