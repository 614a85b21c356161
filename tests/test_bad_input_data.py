"""Bad inputs fail at once with a message naming the file and the cause: a damaged target
directory or a file that is not GGUF, a data file of an unsupported format, malformed or
untrainable chats, feature-store bytes damaged in place. Through train.py they are an
`error: ...` exit (non-zero, no traceback) and no input file is changed or removed."""

import errno
import gzip
import json
import lzma
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

import capture
import evaluate
import gate
import models.target as target_mod
from capture import FeaturesConfig, features
from core.config import cli
from core.train_config import TrainConfig
from data.benchmarks import load_prompts
from data.chat import DataError, to_messages
from data.datasets import load_records
from data.feature_store import FeatureStore
from models.target import Target, TargetError, load_tokenizer, resolve_target
from tests.test_train_e2e import run_train
from tests.tiny import tiny_llama

GOOD = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]}


def _target_with_config(src: Path, dst: Path, config_text: str) -> Path:
    """A copy of target directory `src` (its files symlinked) whose config.json is `config_text`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f.resolve())
    (dst / "config.json").write_text(config_text)
    return dst


BROKEN_CONFIGS = {
    "invalid_json": ('{"model_type": "llama", "hidden_size": 64,', r"config.json is not valid JSON \("),
    "no_model_type": (json.dumps({"hidden_size": 64, "num_hidden_layers": 4}), r"config.json has no 'model_type'"),
    "unknown_model_type": (
        json.dumps({"model_type": "lama"}),
        r"config.json: model_type 'lama' is not known to transformers",
    ),
    "not_an_object": ("[1, 2]", r"config.json holds a JSON list, not an object"),
}


# ---------------------------------------------------------------- the target loader
@pytest.mark.parametrize("case", sorted(BROKEN_CONFIGS))
def test_broken_config_json_is_named(tmp_path, case):
    text, message = BROKEN_CONFIGS[case]
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(TargetError, match=message) as e:
        resolve_target(str(tmp_path))
    assert str(tmp_path / "config.json") in str(e.value) and isinstance(e.value, DataError)


def test_missing_config_json_is_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        resolve_target(str(tmp_path))


def test_non_gguf_file_fails_before_converting(tmp_path, monkeypatch, capsys):
    """A file named .gguf that is not GGUF (magic bytes b'GGUF') fails at once: no '[target]
    converting ... ~30 s', no transformers load, nothing written to the cache."""
    monkeypatch.setattr(target_mod, "CACHE_DIR", tmp_path / "cache")
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04" + bytes(4096))  # e.g. a zip renamed
    t0 = time.time()
    with pytest.raises(
        TargetError, match=rf"target file {fake} is not a GGUF file: it starts with b'PK\\x03\\x04', not b'GGUF'"
    ):
        resolve_target(str(fake))
    assert time.time() - t0 < 1 and "converting" not in capsys.readouterr().out
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(TargetError, match=r"empty.gguf is not a GGUF file: it starts with b''"):
        resolve_target(str(tmp_path / "empty.gguf"))
    (tmp_path / "model.bin").write_bytes(b"GGUF")
    with pytest.raises(TargetError, match="is not a .gguf file"):
        resolve_target(str(tmp_path / "model.bin"))
    assert not (tmp_path / "cache").exists()


def test_damaged_gguf_conversion_is_named_and_leaves_no_temp(tmp_path, monkeypatch):
    """GGUF magic but no usable content: the conversion fails with a TargetError naming the
    file, and its temporary directory is removed (the cache holds no half-converted target)."""
    monkeypatch.setattr(target_mod, "CACHE_DIR", tmp_path / "cache")
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(56))
    with pytest.raises(TargetError, match=rf"cannot convert {bad} \("):
        resolve_target(str(bad))
    assert list((tmp_path / "cache").rglob("*")) in ([], [tmp_path / "cache" / "targets"])


def test_target_without_weights_or_tokenizer_is_named(tmp_path):
    tiny_llama().config.save_pretrained(tmp_path)  # a valid config.json, nothing else
    with pytest.raises(TargetError, match=rf"cannot load the target {tmp_path} \("):
        Target.load(tmp_path)
    with pytest.raises(TargetError, match=rf"cannot load the tokenizer of {tmp_path} \("):
        load_tokenizer(tmp_path)


# ---------------------------------------------------------------- end to end through train.py
def _fails_clearly(p, message):
    out = p.stdout + p.stderr
    assert p.returncode != 0, out[-2000:]
    assert "error: " in out and message in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def _bad_target(tmp_path, target, case):
    if case == "gguf":
        fake = tmp_path / "model.gguf"
        fake.write_bytes(b"<html>404 not found</html>" + bytes(1000))  # a failed download
        return fake, "is not a GGUF file"
    message = {"invalid_json": "config.json is not valid JSON", "no_model_type": "config.json has no 'model_type'"}[
        case
    ]
    return _target_with_config(target, tmp_path / "t", BROKEN_CONFIGS[case][0]), f"{tmp_path / 't'}/{message}"


@pytest.mark.parametrize("case", ["invalid_json", "no_model_type", "gguf"])
def test_train_bad_target_fails_clearly(tmp_path, tiny_run_inputs, case):
    target, data = tiny_run_inputs
    bad, message = _bad_target(tmp_path, target, case)
    before = {f: f.read_bytes() for f in ([bad] if bad.is_file() else [bad / "config.json"])}
    p = run_train(tmp_path / "out", bad, data, 0, ["--steps", "1"], check=False)
    _fails_clearly(p, message)
    assert "converting" not in p.stdout
    assert all(f.read_bytes() == b for f, b in before.items())  # inputs untouched


def _bad_data(tmp_path, case):
    if case == "csv":
        p = tmp_path / "chats.csv"
        p.write_text("role,content\nuser,What is 2 + 2?\nassistant,It is 4.\n")
        return p, "chats.csv: the format .csv is not supported; supported: .json, .jsonl"
    if case == "malformed_jsonl":
        p = tmp_path / "bad.jsonl"
        p.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD) + "\n" + '{"messages": [}\n')
        return p, "bad.jsonl:3: malformed JSON line"
    if case == "empty_assistant":
        p = tmp_path / "empty.jsonl"
        rec = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}
        p.write_text((json.dumps(rec) + "\n") * 8)
        return p, "none of the 8 records has anything to train on"
    if case == "over_max_len":  # every assistant turn starts beyond --max-len 64
        p = tmp_path / "long.jsonl"
        rec = {"messages": [{"role": "user", "content": "word " * 300}, {"role": "assistant", "content": "Yes."}]}
        p.write_text((json.dumps(rec) + "\n") * 8)
        return p, "'skipped_nothing_trainable_within_max_len': 8"
    raise ValueError(case)


@pytest.mark.parametrize("case", ["csv", "malformed_jsonl", "empty_assistant", "over_max_len"])
def test_train_bad_data_fails_clearly(tmp_path, tiny_run_inputs, case):
    target, _ = tiny_run_inputs
    data, message = _bad_data(tmp_path, case)
    before = data.read_bytes()
    p = run_train(tmp_path / "out", target, data, 0, ["--steps", "1"], check=False)
    _fails_clearly(p, message)
    assert "malformed" not in p.stdout + p.stderr or case == "malformed_jsonl"
    assert data.read_bytes() == before


def test_train_on_damaged_feature_shard_fails_clearly(tmp_path, tiny_run_inputs):
    """40 KB of one shard's feature bytes overwritten in place (header, shapes and size intact):
    train.py --features stops with an error naming the shard, and leaves the store as it was."""
    target, data = tiny_run_inputs
    out = tmp_path / "store"
    features(FeaturesConfig(target=str(target), data=str(data), out=str(out), num_records=60, max_len=64, shard_mb=1))
    store = FeatureStore(out)
    keys = store.keys()
    assert len(keys) == 2
    path = store.path(keys[0])
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, end = json.loads(raw[8 : 8 + n])["aux_hidden"]["data_offsets"]
    assert end - begin > 80_000
    at = 8 + n + begin + 20_000
    raw[at : at + 40_000] = os.urandom(40_000)
    path.write_bytes(bytes(raw))
    before = {k: store.path(k).read_bytes() for k in keys}
    # one epoch (56 train samples / batch 4): every sample, so every shard, is read
    p = run_train(
        tmp_path / "run", target, "/no/data/needed", 0, ["--steps", "14", "--features", str(out)], check=False
    )
    _fails_clearly(p, f"shard {path}: the bytes of tensor 'aux_hidden' do not match the checksum")
    assert {k: store.path(k).read_bytes() for k in keys} == before  # nothing deleted or rewritten


# ---------------------------------------------------------------- chat-API content parts, misshaped records
def test_openai_content_parts_are_joined_as_text():
    rec = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2 + 2?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is 4."}]},
            {"role": "user", "content": 7},
        ]
    }
    assert [m["content"] for m in to_messages(rec)] == ["What is\n2 + 2?", "It is 4.", "7"]


@pytest.mark.parametrize(
    "rec,message",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0]: a content part of type 'image_url'; only text parts",
        ),
        ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content is a JSON dict"),
        ({"messages": "hello"}, "'messages' is a JSON str, not a list of turns"),
        ({"conversations": ["hello"]}, "conversations[0] is a JSON str, not an object with 'from' and 'value'"),
        (["a", "list"], "record is a JSON list"),
    ],
)
def test_misshaped_turns_are_refused(rec, message):
    with pytest.raises(DataError, match=re.escape(message)):
        to_messages(rec)


def test_train_on_image_parts_fails_clearly(tmp_path, tiny_run_inputs):
    target, _ = tiny_run_inputs
    data = tmp_path / "parts.jsonl"
    rec = {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(rec) + "\n")
    p = run_train(tmp_path / "out", target, data, 0, ["--steps", "1"], check=False)
    _fails_clearly(p, "record 1 (id ?): messages[0].content[0]: a content part of type 'input_audio'")


# ---------------------------------------------------------------- bytes that are not text, files cut off (issue 35)
def _not_utf8(path: Path) -> Path:
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"messages": "caf\xe9"}\n')  # Latin-1, not UTF-8
    return path


def _cut_gz(path: Path) -> Path:
    z = gzip.compress(((json.dumps(GOOD) + "\n") * 400).encode())
    path.write_bytes(z[: len(z) // 2])
    return path


def _cut_xz(path: Path) -> Path:  # the packaged data's compression
    z = lzma.compress(((json.dumps(GOOD) + "\n") * 400).encode())
    path.write_bytes(z[: len(z) // 2])
    return path


@pytest.mark.parametrize(
    "name,make,message",
    [
        ("a.jsonl", _not_utf8, "a.jsonl:2: not UTF-8 text (byte 0xe9 at byte 18 of the line)"),
        ("a.json", _not_utf8, "a.json:2: not UTF-8 text (byte 0xe9"),  # the `datasets` path
        ("a.jsonl.gz", _cut_gz, "a.jsonl.gz: the gzip data is cut off or damaged after line"),
        ("a.json.gz", _cut_gz, "a.json.gz: the gzip data is cut off or damaged after line"),
        ("a.jsonl.xz", _cut_xz, "a.jsonl.xz: the xz data is cut off or damaged after line"),
    ],
)
def test_undecodable_data_is_a_data_error(tmp_path, name, make, message):
    """Were a UnicodeDecodeError and an EOFError traceback (train, capture and gate read data this way)."""
    f = make(tmp_path / name)
    with pytest.raises(DataError) as e:
        load_records(str(f))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "text,message",
    [  # before: "column 1" for a line cut off (the parse ran past its newline) and for any line of a JSON array
        ('{"messages": [}\n', "a.jsonl:2: malformed JSON line (Expecting value at column 15)"),
        ('{"messages": [{"role": "user"', "a.jsonl:2: malformed JSON line (Expecting ',' delimiter at the end"),
    ],
)
def test_malformed_json_line_says_where(tmp_path, text, message):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps(GOOD) + "\n" + text)
    with pytest.raises(DataError, match=re.escape(message)):
        load_records(str(f))


def test_malformed_json_array_names_its_line_and_column(tmp_path):
    f = tmp_path / "a.json"
    f.write_text("[\n" + json.dumps(GOOD) + ",\n" + '  {"messages": [}\n]\n')
    with pytest.raises(DataError, match=re.escape("a.json:3: malformed JSON (Expecting value at column 17)")):
        load_records(str(f))


@pytest.mark.parametrize("case", ["not_utf8", "cut_gz"])
def test_train_on_undecodable_data_fails_clearly(tmp_path, tiny_run_inputs, case):
    target, _ = tiny_run_inputs
    data = _not_utf8(tmp_path / "a.jsonl") if case == "not_utf8" else _cut_gz(tmp_path / "a.jsonl.gz")
    p = run_train(tmp_path / "out", target, data, 0, ["--steps", "1", "--num-records", "0"], check=False)
    _fails_clearly(p, "not UTF-8 text" if case == "not_utf8" else "the gzip data is cut off")


def test_truncated_target_weights_are_named(tmp_path, tiny_run_inputs):
    """A model.safetensors cut off (an interrupted copy) was a SafetensorError traceback from from_pretrained."""
    target, data = tiny_run_inputs
    bad = tmp_path / "t"
    shutil.copytree(target, bad)
    w = bad / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(TargetError, match=rf"{w} is damaged or incompletely copied: \d+ bytes, its tensors end at"):
        resolve_target(str(bad))
    w.write_bytes(b"\x00" * 4)  # not even a header
    with pytest.raises(TargetError, match="its header alone needs"):
        resolve_target(str(bad))
    p = run_train(tmp_path / "out", bad, data, 0, ["--steps", "1"], check=False)
    _fails_clearly(p, f"{w} is damaged or incompletely copied")


# ---------------------------------------------------------------- train.py --config (issue 35)
@pytest.mark.parametrize(
    "text,message",
    [
        ("- steps\n- 2\n", "expected a mapping of option: value, got a list"),
        ('steps: "two"\n', "steps: expected a whole number, got str 'two'"),
        ("lr: fast\n", "lr: expected a number, got str 'fast'"),
        ("lr: 1e-3\nsteps: 2\n", None),  # YAML reads 1e-3 as a string; the flag takes it, so does the file
        ("deploy: 5\n", "deploy: expected a mapping of option: value, got int 5"),
        ("role: boss\n", "deploy: role: expected one of '', 'producer', 'consumer', got str 'boss'"),  # started a run
        ("aux_layers: 3\n", "aux_layers: expected a list of int, got int 3"),
        ("progress: maybe\n", "progress: expected true or false, got str 'maybe'"),
        ("steps: [1, 2\n", "not valid YAML at line 2, column 1"),
        ("stepz: 3\n", "unknown config key 'stepz'"),
    ],
)
def test_config_file_values_are_checked(tmp_path, text, message):
    y = tmp_path / "run.yaml"
    y.write_text(text)
    if message is None:
        cfg = cli(TrainConfig, ["--config", str(y)])
        assert (cfg.lr, cfg.steps) == (1e-3, 2)
        return
    with pytest.raises(SystemExit) as e:
        cli(TrainConfig, ["--config", str(y)])
    assert str(e.value.code) == f"error: --config {y}: {message}" or (
        message.startswith("not valid") and str(e.value.code).startswith(f"error: --config {y}: {message}")
    )


def test_config_file_that_is_not_yaml_text(tmp_path):
    for path, message in [(tmp_path, "IsADirectoryError"), (_cut_gz(tmp_path / "a.gz"), "UnicodeDecodeError")]:
        with pytest.raises(SystemExit, match=f"error: --config {path}: cannot be read as a YAML file \\({message}"):
            cli(TrainConfig, ["--config", str(path)])
    with pytest.raises(SystemExit, match="error: --config .*: not found"):
        cli(TrainConfig, ["--config", str(tmp_path / "none.yaml")])


# ---------------------------------------------------------------- evaluate.py prompts files (issue 35)
@pytest.mark.parametrize(
    "text,message",
    [
        ('{"x": 1}\n', "a.jsonl:1: expected an object with 'prompt' (a string), 'turns' (strings) or 'messages'"),
        ("not json\n", "a.jsonl:1: malformed JSON line (Expecting value at column 1)"),
        ("[1]\n", "a.jsonl:1: expected an object with 'prompt'"),
        ('{"messages": "hi"}\n', "a.jsonl:1: 'messages' must be a list of {role, content} objects"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "a.jsonl:1: 'messages' has no user turn"),
        ('{"turns": ["a", 2]}\n', "a.jsonl:1: expected an object with 'prompt'"),
        ("", "a.jsonl: no prompts in it (empty)"),
        (None, "a.jsonl:1: not UTF-8 text"),
    ],
)
def test_evaluate_refuses_bad_prompts_before_loading(tmp_path, text, message):
    """Were a KeyError / JSONDecodeError / TypeError traceback, after the target and draft had loaded."""
    f = tmp_path / "a.jsonl"
    if text is None:
        f.write_bytes(b'{"prompt": "caf\xe9"}\n')
    else:
        f.write_text(text)
    with pytest.raises(SystemExit) as e:  # the draft does not exist: nothing was loaded before the refusal
        evaluate.main(evaluate.EvalArgs(str(tmp_path / "no_draft"), data=(str(f),)))
    assert str(e.value.code).startswith(f"error: {f.parent}/{message}"), e.value.code


def test_evaluate_reads_good_prompt_files(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text('{"prompt": "p"}\n\n{"turns": ["a", "b"]}\n' + json.dumps(GOOD) + "\n")
    assert load_prompts(str(f), 0) == [["p"], ["a", "b"], ["What is 2 + 2?"]]


# ---------------------------------------------------------------- capture.py --out (issue 35)
@pytest.mark.parametrize("command", ["features", "regenerate", "prompts"])
def test_capture_out_read_only_fails_before_loading(tmp_path, monkeypatch, command):
    """Was a PermissionError / OSError traceback from a mkdir or touch, after the target had loaded."""

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = tmp_path / ("store" if command == "features" else "out.jsonl")
    kw = dict(target="/no/target", out=str(out))
    run, cfg = {
        "features": (capture.features, capture.FeaturesConfig(data="/no/data.jsonl", **kw)),
        "regenerate": (capture.regenerate, capture.RegenConfig(data="/no/data.jsonl", **kw)),
        "prompts": (capture.write_prompts, capture.PromptsConfig(**kw)),
    }[command]
    with pytest.raises(SystemExit) as e:
        run(cfg)
    assert str(e.value.code) == f"error: --out {out}: cannot write there: it is on a read-only file system"


def test_capture_out_of_the_wrong_kind(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text("x")
    with pytest.raises(SystemExit, match=f"error: --out {f} is a file; the feature store is a directory"):
        capture.features(capture.FeaturesConfig(target="/no/target", out=str(f)))
    with pytest.raises(SystemExit, match=f"error: --out {tmp_path} is a directory; give a file name"):
        capture.regenerate(capture.RegenConfig(target="/no/target", out=str(tmp_path)))
    assert f.read_text() == "x"


# ---------------------------------------------------------------- gate.py inputs (issue 35)
@pytest.mark.parametrize("case", ["sample_not_json", "sample_other_json", "sample_missing", "ckpt_missing", "data"])
def test_gate_bad_inputs_are_one_error_line(tmp_path, tiny_run_inputs, case, capsys):
    target, data = tiny_run_inputs
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    kw = dict(out=str(tmp_path / "gate"), target=str(target), ckpt=str(ckpt))
    if case == "sample_not_json":
        kw["sample"], message = str(data), f"--sample {data}: not a sample.json of a gate run (JSONDecodeError"
    elif case == "sample_other_json":
        (tmp_path / "s.json").write_text('{"config": {}}')
        kw["sample"], message = str(tmp_path / "s.json"), "(no target, prompt_ids, served_tokens, eos_ids)"
    elif case == "sample_missing":
        kw["sample"], message = str(tmp_path / "none.json"), "not found"
    elif case == "ckpt_missing":
        kw["ckpt"], message = str(tmp_path / "none"), f"--ckpt {tmp_path / 'none'}: no such directory"
    else:
        kw = dict(out=str(tmp_path / "gate"), target=str(target), data=str(_not_utf8(tmp_path / "a.jsonl")))
        message = "a.jsonl:2: not UTF-8 text"
    assert gate.main(gate.GateConfig(**kw)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "GATE FAILED" not in err, err
    report = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert report["failed_stage"] == "input" and not report["passed"]


# ---------------------------------------------------------------- found by the wider probe (issue 35)
@pytest.mark.parametrize(
    "kw,message",
    [
        ({"max_new_tokens": -1}, "error: --max-new-tokens must be at least 1, got -1"),
        ({"batch_size": 0}, "error: --batch-size must be at least 1, got 0"),
        ({"num_prompts": 0}, "error: --num-prompts must be at least 1, got 0"),  # wrote an empty file, "complete"
        ({"top_p": 0.0}, "error: --top-p must be a finite number in (0, 1], got 0.0"),
        ({"dtype": "nope"}, "error: --dtype must be auto or one of bf16, fp16, fp32, got 'nope'"),  # a KeyError
        ({"device": "nope"}, "error: --device must be auto, cpu or cuda, got 'nope'"),
        (  # sat allocating one batch of 10**12, printing nothing more
            {"batch_size": 10**12},
            "error: --batch-size must be at most 65536 (prompts sampled together, each with a cache of "
            "--max-new-tokens positions), got 1000000000000",
        ),
    ],
)
def test_capture_prompts_refuses_bad_options_before_loading(tmp_path, kw, message):
    with pytest.raises(SystemExit) as e:
        capture.write_prompts(capture.PromptsConfig(target="/no/target", out=str(tmp_path / "p.jsonl"), **kw))
    assert str(e.value.code) == message
    assert not list(tmp_path.iterdir())


def test_evaluate_out_checked_before_loading(tmp_path, monkeypatch):
    """--out was opened only after every dataset was decoded: a PermissionError traceback that lost the run."""

    def run(out):
        with pytest.raises(SystemExit) as e:  # the draft does not exist: nothing was loaded before the refusal
            evaluate.main(evaluate.EvalArgs(str(tmp_path / "no_draft"), data=("mtbench",), out=str(out)))
        return str(e.value.code)

    assert run(tmp_path) == f"error: --out {tmp_path} is a directory; give a file name"

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    out = tmp_path / "sub" / "r.jsonl"
    assert run(out) == f"error: --out {out}: cannot write there (Read-only file system)"
    assert not (tmp_path / "sub").exists()
