"""Small helpers that several experiments/ scripts share."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def short_commit(root: Path = ROOT) -> str:
    """`git rev-parse --short HEAD` in root; '' where git is missing or prints nothing (not a checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return ""
