"""Nothing a user points a command at is deleted or rewritten unless that command wrote it (issue 35,
'Data loss' and 'Records'): export.py --out, export.py --import-from --out, capture.py regenerate
--out, train.py --resume. Each refusal is one `error: ...` line, a non-zero exit, no traceback."""

import errno
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import export
import train
from capture import RegenConfig, regenerate
from core.capture_io import read_jsonl_repair
from tests.test_bad_input import cfg_of, main_fails
from tests.test_export import make_checkpoint
from tests.test_train_e2e import ROOT, run_train


def tree(d: Path) -> dict:
    """Every file under d with its bytes."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def refused(p, *messages) -> str:
    text = p.stdout + p.stderr
    assert p.returncode != 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("error: "), text[-3000:]
    for m in messages:
        assert m in text, (m, text[-3000:])
    return text


# ---------------------------------------------------------------- export.py --out
def test_export_refuses_a_directory_it_did_not_write(tmp_path):
    run, _, _ = make_checkpoint(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "chats.jsonl").write_text('{"messages": []}\n')
    with pytest.raises(
        export.ExportError, match=r"holds files export did not write \(chats.jsonl; no .nanospec-export"
    ):
        export.export(run, data)
    assert tree(data) == {"chats.jsonl": b'{"messages": []}\n'}
    # through the CLI: one error line, exit 1, the data still there
    refused(
        cli("export.py", run, "--out", data), f"error: export failed: --out {data} holds files export did not write"
    )
    assert tree(data) == {"chats.jsonl": b'{"messages": []}\n'}
    # an empty directory is fine, and so is one export wrote (its marker): exporting again replaces it
    (tmp_path / "empty").mkdir()
    out = export.export(run, tmp_path / "empty", dtype="fp32")
    assert (out / export.EXPORT_MARKER).is_file()
    (out / "stale.bin").write_text("from the last export")
    export.export(run, out)
    assert sorted(p.name for p in out.iterdir()) == [export.EXPORT_MARKER, "config.json", "model.safetensors"]
    # --overwrite: the user says so
    export.export(run, data, overwrite=True)
    assert not (data / "chats.jsonl").exists() and (data / "model.safetensors").exists()
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary dir left beside


def test_export_accepts_a_serving_dir_written_before_the_marker(tmp_path):
    run, _, _ = make_checkpoint(tmp_path)
    out = export.export(run, tmp_path / "served")
    (out / export.EXPORT_MARKER).unlink()  # as an earlier export.py left it: config.json + model.safetensors
    export.export(run, out, dtype="fp32")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


@pytest.mark.parametrize("where", ["run", "ckpt", "step", "parent", "tb", "metrics", "inside_ckpt"])
def test_export_never_replaces_the_run_it_reads(tmp_path, where):
    """Not even with --overwrite: replacing --out would delete the checkpoint or the run's records."""
    run, _, _ = make_checkpoint(tmp_path)
    (run / "tb").mkdir()
    (run / "tb" / "events").write_text("x")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "run.json").write_text("{}")
    (run / "notes.txt").write_text("mine")
    out = {
        "run": run,
        "ckpt": run / "ckpt",
        "step": run / "ckpt" / "step_7",
        "parent": tmp_path,
        "tb": run / "tb",
        "metrics": run / "metrics.jsonl",
        "inside_ckpt": run / "ckpt" / "served",
    }[where]
    before = tree(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(export.ExportError, match="part of the checkpoint being exported"):
            export.export(run / "ckpt" / "step_7", out, overwrite=overwrite)
    assert tree(tmp_path) == before
    # the default (<run>/export-vllm) and a named dir beside the run's files are fine
    assert export.main(export.ExportArgs(str(run))) == run / "export-vllm"
    export.export(run, run / "served")


def test_export_out_a_file_or_read_only(tmp_path, monkeypatch):
    run, _, _ = make_checkpoint(tmp_path)
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(export.ExportError, match=f"--out {f} is a file, not a directory"):
        export.export(run, f, overwrite=True)
    assert f.read_text() == "x"

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(SystemExit) as e:
        export.main(export.ExportArgs(str(run), out=str(tmp_path / "ro")))
    assert str(e.value.code) == (
        f"error: export failed: --out {tmp_path / 'ro'}: cannot write the serving dir there "
        "(it is on a read-only file system)"
    )


# ---------------------------------------------------------------- export.py --import-from --out
def test_import_refuses_an_existing_run(tmp_path):
    run, _, _ = make_checkpoint(tmp_path)
    served = export.export(run, tmp_path / "served", dtype="fp32")
    trained = tmp_path / "trained"
    (trained / "ckpt" / "step_5").mkdir(parents=True)
    (trained / "ckpt" / "step_5" / "draft.safetensors").write_text("weights")
    (trained / "ckpt" / "latest").write_text("step_5")
    (trained / "metrics.jsonl").write_text('{"step": 5}\n')
    before = tree(trained)
    p = cli("export.py", served, "--import-from", "auto", "--out", trained)
    refused(p, f"error: import failed: --out {trained} holds a run (metrics.jsonl, ckpt/)", "--overwrite")
    assert tree(trained) == before  # ckpt/latest still names the trained step_5
    # a draft inside the run it would replace: refused even with --overwrite
    with pytest.raises(export.ExportError, match="the draft to import .* is in its ckpt"):
        export.import_draft(trained / "ckpt" / "step_5", trained, overwrite=True)
    assert tree(trained) == before
    # --overwrite: the old run's files go (they would contradict the import), others stay
    (trained / "notes.txt").write_text("mine")
    export.import_draft(served, trained, overwrite=True)
    assert sorted(p.name for p in (trained / "ckpt").iterdir()) == ["latest", "step_0"]
    assert not (trained / "metrics.jsonl").exists() and (trained / "notes.txt").read_text() == "mine"
    # a file as --out
    with pytest.raises(export.ExportError, match="is a file, not a directory"):
        export.import_draft(served, trained / "notes.txt")


# ---------------------------------------------------------------- capture.py regenerate --out
def regen_cfg(target, data, out, **kw):
    base = dict(target=str(target), data=str(data), out=str(out), num_records=4, max_new_tokens=4, batch_size=2)
    return RegenConfig(**{**base, **kw})


@pytest.mark.parametrize(
    "name,content",
    [
        ("chats.json", b'[{"messages": [{"role": "user", "content": "hi"}]}]'),  # no newline at the end
        ("chats.jsonl", b'{"id": "1"}\n{"id": "2"}'),  # a JSONL whose last record has no newline
        ("notes.jsonl", b"any text\n"),
    ],
)
def test_regenerate_refuses_a_file_it_did_not_write(tmp_path, tiny_run_inputs, name, content):
    target, data = tiny_run_inputs
    out = tmp_path / name
    out.write_bytes(content)
    p = cli(
        "capture.py",
        "regenerate",
        "--target",
        target,
        "--data",
        data,
        "--out",
        out,
        "--num-records",
        "2",
        "--max-new-tokens",
        "8",
    )
    refused(p, f"error: --out {out}: {out} exists but was not written by capture.py regenerate")
    assert out.read_bytes() == content and sorted(x.name for x in tmp_path.iterdir()) == [name]


def test_regenerate_refuses_other_provenance(tmp_path, tiny_run_inputs):
    target, data = tiny_run_inputs
    out = tmp_path / "p.jsonl"
    out.write_text('{"id": "si0-00000-0000"}\n{"id": "si0-00000-0001"')
    prov = tmp_path / "p.provenance.json"
    before = out.read_bytes()
    # capture.py prompts' output (its provenance counts batches): not regeneration output
    prov.write_text(json.dumps({"output": out.name, "settings": {}, "counts": {"batches": 1}}))
    with pytest.raises(SystemExit, match="is not the provenance of capture.py regenerate output"):
        regenerate(regen_cfg(target, data, out))
    prov.write_text('{"output": "p.jsonl", "sett')  # damaged
    with pytest.raises(SystemExit, match="p.provenance.json is damaged or unreadable"):
        regenerate(regen_cfg(target, data, out))
    assert out.read_bytes() == before


def test_resume_repair_keeps_a_whole_last_record(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"id": 1}\n{"id": 2}')  # whole, only its newline missing
    assert [r["id"] for r in read_jsonl_repair(p)] == [1, 2]
    assert p.read_text() == '{"id": 1}\n{"id": 2}\n'


# ---------------------------------------------------------------- train.py --resume
@pytest.mark.parametrize(
    "run_json,message",
    [
        (None, "run.json is missing, so this run's record cannot be continued"),
        ('{"config": {"steps": 3}', "run.json is damaged or unreadable (JSONDecodeError"),
        ("[1, 2]", "run.json does not hold a run's record"),
    ],
)
def test_resume_never_starts_the_record_over(tmp_path, tiny_run_inputs, monkeypatch, run_json, message):
    """Before: a missing run.json made --resume delete metrics.jsonl (the whole history); a damaged one
    was a traceback after the target and data had loaded."""
    out = tmp_path / "run"
    (out / "ckpt" / "step_2").mkdir(parents=True)
    (out / "ckpt" / "latest").write_text("step_2")
    (out / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 3.0}\n')
    if run_json is not None:
        (out / "run.json").write_text(run_json)
    before = tree(out)
    monkeypatch.setattr(train, "Trainer", None)  # refused before the target or data load
    msg = main_fails(cfg_of(*tiny_run_inputs, out, resume=True), "error: --resume: ", message)
    assert f"--init-draft {out / 'ckpt' / 'step_2'}" in msg
    assert tree(out) == before


def test_resume_after_a_kill_rewrites_the_steps_after_the_checkpoint(tmp_path, tiny_run_inputs):
    """kill -9 after step 3 was logged, before its checkpoint (the last is step_2): --resume truncates
    metrics.jsonl (and hides TensorBoard's events) after step 2, so the record equals one run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # optional: tensorboard

    target, data = tiny_run_inputs
    run_train(tmp_path / "full", target, data, 0, ["--steps", "5", "--ckpt-every", "2"])
    out = tmp_path / "killed"
    run_train(out, target, data, 0, ["--steps", "5", "--ckpt-every", "2", "--stop-after", "3"])
    shutil.rmtree(out / "ckpt" / "step_3")  # as a kill before the checkpoint leaves it
    (out / "ckpt" / "latest").write_text("step_2")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"time": 1, "step": 4, "split": "tr')  # and a row cut off mid-write
    run_train(out, target, data, 0, ["--steps", "5", "--ckpt-every", "2", "--resume"])

    def record(run):
        return [
            (r["step"], r["split"], r.get("loss"), r.get("acc_0")) for r in map(json.loads, open(run / "metrics.jsonl"))
        ]

    assert record(out) == record(tmp_path / "full")
    assert [s for s, split, *_ in record(out) if split == "train"] == [1, 2, 3, 4, 5]
    acc = EventAccumulator(str(out / "tb"), purge_orphaned_data=True)
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5]


def test_capture_features_of_an_empty_file_fails(tmp_path, tiny_run_inputs):
    target, _ = tiny_run_inputs
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    # --max-len within the tiny target's 256 positions: past them is refused first, before the data is read
    store = tmp_path / "store"
    p = cli("capture.py", "features", "--target", target, "--data", empty, "--out", store, "--max-len", "256")
    refused(p, f"error: {empty}: no records to capture (the file is empty)")
    assert not (tmp_path / "store").exists()  # no store marked complete


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"batch_size": 0}, "error: --batch-size must be at least 1, got 0"),
        ({"max_new_tokens": 0}, "error: --max-new-tokens must be at least 1, got 0"),
        ({"top_p": 0.0}, "error: --top-p must be a finite number in (0, 1], got 0.0"),
        ({"temperature": float("nan")}, "error: --temperature must be a finite number at least 0"),
    ],
)
def test_regenerate_refuses_bad_numbers_before_loading(tmp_path, kw, message):
    with pytest.raises(SystemExit) as e:
        regenerate(regen_cfg("/no/target", "/no/data.jsonl", tmp_path / "r.jsonl", **kw))
    assert str(e.value.code).startswith(message)
    assert not list(tmp_path.iterdir())
