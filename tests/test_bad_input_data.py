"""Bad inputs fail at once with a message naming the file and the cause: a damaged target
directory or a file that is not GGUF, a data file of an unsupported format, malformed or
untrainable chats, feature-store bytes damaged in place. Through train.py they are an
`error: ...` exit (non-zero, no traceback) and no input file is changed or removed."""

import json
import re
import time
from pathlib import Path

import pytest

import models.target as target_mod
from data.chat import DataError
from models.target import TargetError, load_tokenizer, resolve_target
from tests.test_train_e2e import run_train

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
    from models.target import Target
    from tests.tiny import tiny_llama

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
    import os

    from capture import FeaturesConfig, features
    from data.feature_store import FeatureStore

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
    from data.chat import to_messages

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
    from data.chat import to_messages

    with pytest.raises(DataError, match=re.escape(message)):
        to_messages(rec)


def test_train_on_image_parts_fails_clearly(tmp_path, tiny_run_inputs):
    target, _ = tiny_run_inputs
    data = tmp_path / "parts.jsonl"
    rec = {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(GOOD) + "\n" + json.dumps(rec) + "\n")
    p = run_train(tmp_path / "out", target, data, 0, ["--steps", "1"], check=False)
    _fails_clearly(p, "record 1 (id ?): messages[0].content[0]: a content part of type 'input_audio'")
