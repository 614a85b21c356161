"""capture.py on a tiny random target: stored features are the target's; one rank == two
ranks; resume; offline training == online training; regenerate == HF greedy per turn."""

import json
import os
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from capture import FeaturesConfig, features
from core.capture_io import read_jsonl_repair
from core.regenerate import RegenConfig, _Deadline, regenerate, regenerate_batch, reply_slots
from core.train_config import TrainConfig
from data.chat import DataError
from data.feature_store import FeatureStore, open_feature_store
from models.target import Target, eos_ids, load_tokenizer
from tests.test_train_e2e import final_params, run_train, train_rows
from tests.tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[1]
CAP = ["--num-records", "60", "--max-len", "64", "--shard-mb", "1"]  # as run_train's data settings; 2 shards


def run_capture(args, nproc=0, check=True):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] if nproc else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, *launcher, "capture.py", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if check and p.returncode != 0:
        raise AssertionError(f"capture.py failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def features_cfg(target, data, out, **kw):
    return FeaturesConfig(
        target=str(target), data=str(data), out=str(out), num_records=60, max_len=64, shard_mb=1, **kw
    )


@pytest.fixture(scope="module")
def captured(tmp_path_factory, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = tmp_path_factory.mktemp("cap") / "one"
    res = features(features_cfg(target, data, out))
    return out, res


def test_defaults_match_train():
    """`capture.py features` and `train.py` must tokenize alike by default (sample ids line up)."""
    t, c = TrainConfig(), FeaturesConfig()
    for f in ("target", "data", "num_records", "max_len", "aux_layers"):
        assert getattr(c, f) == getattr(t, f), f
    assert {f.name for f in fields(RegenConfig)} >= {"target", "data", "num_records"}


def test_stored_features_are_the_targets(captured, tiny_run_inputs):
    out, res = captured
    store, examples = open_feature_store(out)
    assert res["complete"] and len(store.keys()) == 2 and res["tokens"] == sum(len(e.input_ids) for e in examples)
    target = Target.load(tiny_run_inputs[0])
    assert store.schema["aux_layers"] == target.aux_layers and store.schema["dtype"] == "float32"
    for e in examples[:3] + examples[-2:]:
        f = target(torch.tensor([e.input_ids]))
        got = store.read(e.ref)
        torch.testing.assert_close(got["aux_hidden"], f.aux_hidden[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["final_hidden"], f.final_hidden[0], rtol=1e-5, atol=1e-5)
        assert got["input_ids"].tolist() == e.input_ids and got["loss_mask"].tolist() == e.loss_mask
    assert res["bytes_per_token"] == pytest.approx((3 + 1) * 64 * 4 + 5, rel=0.05)


def test_two_ranks_store_the_same_tensors(tmp_path, captured, tiny_run_inputs):
    target, data = tiny_run_inputs
    one = FeatureStore(captured[0])
    p = run_capture(["features", "--target", target, "--data", data, "--out", tmp_path / "two", *CAP], nproc=2)
    assert "2 rank(s)" in p.stdout and "bytes/token" in p.stdout
    two = FeatureStore(tmp_path / "two")
    assert two.keys() == one.keys()
    assert {two.header(k)["writer"].rsplit("-", 1)[1] for k in two.keys()} == {"rank0", "rank1"}
    for k in one.keys():
        a, b = one.get(k)[0], two.get(k)[0]
        assert a.keys() == b.keys()
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=1e-6, atol=1e-6, msg=f"{k}/{n}")


def test_resume_skips_finished_shards(tmp_path, captured, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = tmp_path / "r"
    res = features(features_cfg(target, data, out, time_limit=1e-3))  # stops before the first shard
    assert res["stopped_by_time_limit"] and not res["complete"] and FeatureStore(out).keys() == []
    p = run_train(tmp_path / "early", target, data, 0, ["--steps", "1", "--features", out], check=False)
    assert p.returncode != 0 and "holds 0 of" in p.stderr and "Traceback" not in p.stderr
    assert features(features_cfg(target, data, out))["shards_written"] == 2
    store = FeatureStore(out)
    first, second = store.keys()
    mtime = store.path(first).stat().st_mtime_ns
    store.delete(second)
    res = features(features_cfg(target, data, out))
    assert res["shards_written"] == 1 and res["complete"]
    assert store.path(first).stat().st_mtime_ns == mtime  # untouched
    torch.testing.assert_close(store.get(second)[0], FeatureStore(captured[0]).get(second)[0], rtol=0, atol=0)
    # a different capture setting cannot resume into the same store
    with pytest.raises(Exception, match="different schema"):
        features(features_cfg(target, data, out, dtype="bf16"))


def test_offline_training_matches_online(tmp_path, captured, tiny_run_inputs):
    """Same data, seed and steps: training from the store gives the online loss curve."""
    target, data = tiny_run_inputs
    extra = ["--steps", "6", "--draft-vocab-size", "8192", "--eval-every", "3"]
    run_train(tmp_path / "online", target, data, 1, extra)
    run_train(tmp_path / "offline", target, "/no/data/needed", 1, [*extra, "--features", captured[0]])
    on, off = train_rows(tmp_path / "online"), train_rows(tmp_path / "offline")
    assert len(on) == len(off) == 6
    assert len({r["loss"] for r in on}) > 1 and all(r["loss"] > 0 for r in on)  # it trains on real rows
    for a, b in zip(on, off):
        for k in ("loss", "loss_0", "loss_2", "acc_0", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), (a["step"], k)
    evals = [
        [r for r in map(json.loads, open(d / "metrics.jsonl")) if r["split"] == "eval"]
        for d in (tmp_path / "online", tmp_path / "offline")
    ]
    assert len(evals[0]) == 3 and [r["loss_0"] for r in evals[0]] == pytest.approx(
        [r["loss_0"] for r in evals[1]], rel=1e-5
    )
    p1, p2 = final_params(tmp_path / "online"), final_params(tmp_path / "offline")
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def captured_256(tmp_path_factory, tiny_run_inputs):
    """The tiny chats captured at --max-len 256, where train.py packs two of them into some rows."""
    target, data = tiny_run_inputs
    out = tmp_path_factory.mktemp("cap") / "long"
    features(FeaturesConfig(target=str(target), data=str(data), out=str(out), num_records=60, max_len=256, shard_mb=1))
    return out


def test_offline_training_matches_online_packed(tmp_path, captured_256, tiny_run_inputs):
    """Packed rows: stored features (each captured alone) placed into the rows give the online packed curve,
    also with rows of padding added to the offline batches (--pack-row-multiple: what a GPU run does)."""
    target, data = tiny_run_inputs
    extra = ["--steps", "4", "--max-len", "256", "--pack", "on"]
    run_train(tmp_path / "online", target, data, 1, extra)
    run_train(
        tmp_path / "offline",
        target,
        "/no/data/needed",
        1,
        [*extra, "--features", captured_256, "--pack-row-multiple", "3"],
    )
    on, off = train_rows(tmp_path / "online"), train_rows(tmp_path / "offline")
    assert len(on) == len(off) == 4 and len({r["loss"] for r in on}) > 1
    for a, b in zip(on, off):
        for k in ("loss", "loss_0", "loss_2", "acc_0", "grad_norm"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
    packing = [json.loads((tmp_path / d / "run.json").read_text())["results"]["packing"] for d in ("online", "offline")]
    assert packing[0]["real_tokens"] == packing[1]["real_tokens"] and packing[0]["packed"] and packing[1]["packed"]
    assert packing[0]["efficiency"] > packing[1]["efficiency"] > 0  # the padding rows count as row tokens
    p1, p2 = final_params(tmp_path / "online"), final_params(tmp_path / "offline")
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-4, atol=1e-6, msg=k)
    # --max-len below the store's: rows grow to its longest conversation (said so); the same training
    p = run_train(
        tmp_path / "short", target, "/no/data/needed", 1, [*extra, "--features", captured_256, "--max-len", "64"]
    )
    assert "(> --max-len 64): rows of" in p.stdout
    short = json.loads((tmp_path / "short" / "run.json").read_text())["results"]["packing"]
    assert 64 < short["row_len"] <= 256 and short["real_tokens"] == packing[0]["real_tokens"]
    for a, b in zip(on, train_rows(tmp_path / "short")):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]


def test_offline_refuses_another_target(tmp_path, captured, tiny_run_inputs, smollm2_tokenizer):
    other = tmp_path / "other"
    tiny_llama(vocab=len(smollm2_tokenizer), hidden=64, layers=4, heads=4, kv_heads=2, seed=1).save_pretrained(other)
    smollm2_tokenizer.save_pretrained(other)
    p = run_train(tmp_path / "bad", other, "x", 0, ["--steps", "1", "--features", captured[0]], check=False)
    assert p.returncode != 0 and "captured from another target" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------- regenerate
def regen_cfg(target, data, out, **kw):
    base = dict(
        target=str(target),
        data=str(data),
        out=str(out),
        num_records=8,
        max_new_tokens=6,
        max_prompt_len=256,
        batch_size=3,
    )
    return RegenConfig(**{**base, **kw})


def hf_greedy(model, tokenizer, messages, max_new_tokens):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    eos = eos_ids(model, tokenizer)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0])[
        0, ids.shape[1] :
    ].tolist()
    cut = next((j for j, t in enumerate(out) if t in eos), len(out))
    return tokenizer.decode(out[:cut], skip_special_tokens=True).strip()


@pytest.mark.parametrize("engine", ["hf", "slots"])
def test_regenerate_is_hf_greedy_turn_by_turn(tmp_path, tiny_run_inputs, engine):
    from transformers import AutoModelForCausalLM  # heavy: nothing this file imports loads transformers

    target, data = tiny_run_inputs
    out = tmp_path / "regen.jsonl"
    doc = regenerate(regen_cfg(target, data, out, engine=engine, slots=3))
    assert doc["settings"]["engine"] == engine
    recs = sorted((json.loads(l) for l in open(out)), key=lambda r: int(r["id"]))
    assert doc["counts"]["written"] == len(recs) == 8 and doc["counts"]["remaining"] == 0
    model, tok = AutoModelForCausalLM.from_pretrained(target).eval(), load_tokenizer(target)
    source = [json.loads(l) for l in open(data)][:8]
    n_turns = 0
    for r in recs:
        src = source[int(r["id"])]["messages"]
        given = [m for m in r["messages"] if m["role"] != "assistant"]
        want = [m for g in reply_slots(src) for m in g]
        assert given == (want[: len(given)] if r.get("cut") else want)
        for i, m in enumerate(r["messages"]):
            if m["role"] == "assistant":
                # the context is the regenerated conversation so far
                assert m["content"] == hf_greedy(model, tok, r["messages"][:i], 6), (r["id"], i)
                n_turns += 1
    assert n_turns == doc["counts"]["turns"] > 8  # multi-turn
    prov = json.loads((tmp_path / "regen.provenance.json").read_text())
    assert prov["settings"]["temperature"] == 0 and prov["runs"][-1]["status"] == "complete"
    assert {"torch", "transformers"} <= set(prov["runs"][-1]["versions"]) and prov["source"]["conversations"] == 8


def test_regenerate_resumes(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = tmp_path / "r.jsonl"
    stopped = regenerate(regen_cfg(target, data, out, time_limit=1e-3))
    assert stopped["runs"][-1]["status"] == "stopped_by_time_limit" and stopped["counts"]["written"] == 0
    regenerate(regen_cfg(target, data, out, num_records=4))
    head = out.read_text()
    capped = regenerate(regen_cfg(target, data, out, max_output_mb=1e-6))  # already over: nothing more
    assert capped["runs"][-1]["status"] == "stopped_by_size_limit" and out.read_text() == head
    with open(out, "a") as f:
        f.write('{"id": "99", "messa')  # a crash mid-append
    doc = regenerate(regen_cfg(target, data, out))
    assert out.read_text().startswith(head)
    ids = [json.loads(l)["id"] for l in open(out)]
    assert sorted(ids, key=int) == [str(i) for i in range(8)]  # each once, the partial line gone
    assert doc["runs"][-1]["done_before"] == 4 and len(doc["runs"]) == 4
    # one uninterrupted run writes the same conversations (greedy)
    full = tmp_path / "full.jsonl"
    regenerate(regen_cfg(target, data, full))
    by_id = lambda p: {r["id"]: r["messages"] for r in map(json.loads, open(p))}
    assert by_id(out) == by_id(full)
    with pytest.raises(SystemExit, match="other settings"):
        regenerate(regen_cfg(target, data, out, temperature=0.8))


def test_slots_engine_resumes_without_loss_or_duplicates(tmp_path, tiny_run_inputs):
    """--engine slots writes conversations as they complete; a run stopped mid-way (here by the
    output-size guard, as a kill between appends would) keeps what it wrote, and the rerun
    writes each remaining conversation once: together, the hf engine's records."""
    target, data = tiny_run_inputs
    out, ref = tmp_path / "s.jsonl", tmp_path / "h.jsonl"
    part = regenerate(regen_cfg(target, data, out, engine="slots", slots=2, num_records=12, max_output_mb=1e-4))
    assert part["runs"][-1]["status"] == "stopped_by_size_limit" and 0 < part["counts"]["written"] < 12
    head = out.read_text()
    with open(out, "a") as f:
        f.write('{"id": "99", "messa')  # and a crash mid-append
    regenerate(regen_cfg(target, data, out, engine="slots", slots=2, num_records=12))
    assert out.read_text().startswith(head)
    regenerate(regen_cfg(target, data, ref, engine="hf", num_records=12))
    ids = [json.loads(l)["id"] for l in open(out)]
    assert sorted(ids, key=int) == [str(i) for i in range(12)]
    by_id = lambda p: {r["id"]: r["messages"] for r in map(json.loads, open(p))}
    assert by_id(out) == by_id(ref)


def test_sampling_is_seeded(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    runs = [tmp_path / f"{n}.jsonl" for n in ("a", "b", "c")]
    for p, seed in zip(runs, (1, 1, 2)):
        regenerate(regen_cfg(target, data, p, num_records=4, temperature=0.8, seed=seed))
    text = [p.read_text() for p in runs]
    assert text[0] == text[1] and text[0] != text[2]


def test_regenerate_counts_conversations_it_cannot_continue(tmp_path, tiny_run_inputs):
    target, _ = tiny_run_inputs
    long = "word " * 300
    chats = [
        {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
        {"id": "no_user", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]},
        {"id": "long_first", "messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "x"}]},
        {
            "id": "long_second",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": long},
                {"role": "assistant", "content": "y"},
            ],
        },
        {"id": "trailing_user", "conversations": [{"from": "gpt", "value": "lead"}, {"from": "human", "value": "q"}]},
    ]
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))
    out = tmp_path / "o.jsonl"
    doc = regenerate(regen_cfg(target, data, out, num_records=0, max_prompt_len=160))
    c = doc["counts"]
    assert (
        c["written"],
        c["dropped"],
        c["dropped_no_user_turn"],
        c["dropped_prompt_too_long"],
        c["cut_prompt_too_long"],
    ) == (3, 2, 1, 1, 1)
    recs = {r["id"]: r for r in map(json.loads, open(out))}
    assert set(recs) == {"ok", "long_second", "trailing_user"}
    assert recs["long_second"]["turns"] == 1 and recs["long_second"]["cut"] == "prompt_too_long"
    assert [m["role"] for m in recs["trailing_user"]["messages"]] == ["user", "assistant"]  # a reply to trailing input
    dropped = {d["id"]: d["reason"] for d in map(json.loads, open(tmp_path / "o.dropped.jsonl"))}
    assert dropped == {"no_user": "no_user_turn", "long_first": "prompt_too_long"}

    # a target that only says end-of-text: every conversation is dropped as empty, none kept
    from transformers import AutoModelForCausalLM  # heavy: nothing this file imports loads transformers

    mute = tmp_path / "mute"
    model = AutoModelForCausalLM.from_pretrained(target)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # all logits 0: greedy picks token 0, a special token
    model.save_pretrained(mute)
    for f in Path(target).iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            (mute / f.name).write_bytes(f.read_bytes())
    doc = regenerate(regen_cfg(mute, data, tmp_path / "m.jsonl", num_records=0, max_prompt_len=160))
    assert doc["counts"]["written"] == 0 and doc["counts"]["dropped_empty_output"] == 3

    # an empty input (a prompts file an earlier step left empty) is an error, not a "complete" run of nothing
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty.jsonl: no conversations to regenerate"):
        regenerate(regen_cfg(target, tmp_path / "empty.jsonl", tmp_path / "e.jsonl", num_records=0))


def test_deadline_discards_an_unfinished_batch(tiny_run_inputs):
    from transformers import AutoModelForCausalLM  # heavy: nothing this file imports loads transformers

    target, _ = tiny_run_inputs
    model, tok = AutoModelForCausalLM.from_pretrained(target).eval(), load_tokenizer(target)
    convs = [("a", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}])]
    cfg = regen_cfg(target, "x", "x")
    assert regenerate_batch(model, tok, convs, cfg, _Deadline(time.time() - 1)) is None
    assert regenerate_batch(model, tok, convs, cfg, _Deadline(None))[0][0]["turns"] == 1


def test_regen_output_repair_and_damaged_lines(tmp_path):
    """A partial last line (a crash mid-write) is cut off; a damaged line in the middle stops the
    resume with its file and line number and leaves the file untouched."""
    p = tmp_path / "regen.jsonl"
    p.write_text('{"id": 1}\n{"id": 2}\n{"id": 3, "mess')
    assert [r["id"] for r in read_jsonl_repair(p)] == [1, 2]
    assert p.read_text() == '{"id": 1}\n{"id": 2}\n'
    damaged = '{"id": 1}\n{"id": 2, oops\n{"id": 3}\n'
    p.write_text(damaged)
    with pytest.raises(SystemExit, match=r"regen.jsonl:2: not a JSON line"):
        read_jsonl_repair(p)
    assert p.read_text() == damaged
    assert read_jsonl_repair(tmp_path / "missing.jsonl") == []
