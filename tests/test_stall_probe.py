"""experiments/stall_probe.py: train.py runs under it unchanged, and every --every seconds the other threads'
stacks (read under the GIL; its faulthandler watchdog segfaulted the probed runs) reach --stacks."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_probe_runs_train_and_writes_the_main_threads_stack(tmp_path):
    stacks = tmp_path / "stacks.txt"
    p = subprocess.run(
        [sys.executable, "experiments/stall_probe.py", "--stacks", str(stacks), "--every", "0.1", "--", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--strategy" in p.stdout  # train.py's own help: its flags reached it
    assert "[probe] dynamo counters" in p.stderr
    text = stacks.read_text()
    assert text.startswith("--- ") and 'train.py", line' in text and "in watch" not in text, text[:2000]
