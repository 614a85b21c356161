"""No core file a newcomer cannot read in one sitting (issue #34): the library (core/, data/, kernels/, models/)
and the scripts at the root hold no file over 800 lines and no function over 100 (experiments/ and tools/ are
outside this rule). A function that outgrows it is split where its steps are; a file, by what it does."""

import ast
from pathlib import Path

from tests.test_imports import ROOT, python_files

MAX_FILE, MAX_FUNCTION = 800, 100


def core_files() -> list[Path]:
    return [f for f in python_files() if len(f.parts) == 1 or f.parts[0] in ("core", "data", "kernels", "models")]


def oversize(root: Path, files: list[Path]) -> list[str]:
    """'path: N lines' for files past MAX_FILE, 'path:line name: N lines' for functions past MAX_FUNCTION."""
    bad = []
    for f in files:
        src = (root / f).read_text()
        if (n := src.count("\n")) > MAX_FILE:
            bad.append(f"{f}: {n} lines")
        for node in ast.walk(ast.parse(src, str(f))):
            is_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if is_function and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION:
                bad.append(f"{f}:{node.lineno} {node.name}: {n} lines")
    return bad


def test_core_rooms_are_readable():
    files = core_files()
    assert len(files) > 40 and Path("train.py") in files and Path("models/eagle3.py") in files
    assert oversize(ROOT, files) == []


def test_checker_finds_oversize(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "short.py").write_text("def short():\n    return 1\n" + "# line\n" * MAX_FILE)
    assert oversize(tmp_path, [Path("long.py"), Path("short.py")]) == [
        f"long.py:1 long: {MAX_FUNCTION + 1} lines",
        f"short.py: {MAX_FILE + 2} lines",
    ]
