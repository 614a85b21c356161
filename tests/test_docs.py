"""Every document the code and docs cite is in the repository (issue #34).

Each .py and .md file that git tracks or would track is read as text; every `NAME.md` path in it
(`DESIGN.md`, `experiments/README.md`, `../BENCHMARKS.md`, ...; URLs left out) must name a .md file of
the repository, taken from the repository root or from the citing file's folder, and never a path
outside the repository (a user who clones it sees nothing else). A quoted section right after a
citation (`DESIGN.md, "Serving formats"`, `experiments/README.md ("Families side by side")`) must be
the text of a heading of that file, or part of one.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+", re.I)
CITE = re.compile(r"(?<![\w./-])((?:\.{1,2}/)*[\w.-]+(?:/[\w.-]+)*\.md)\b")
SECTION = re.compile(r"[\s,(]*[\"“](\w[^\"”\n]*)[\"”]")
HEADING = re.compile(r"^#+\s+(.*)$", re.M)


def tracked(root: Path, *patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [Path(p) for p in out.splitlines() if (root / p).is_file()]


def resolve(root: Path, citing: Path, name: str, docs: set[Path]) -> Path | None:
    """The repository .md file `name` cites from file `citing` (both relative to root), or None."""
    for base in (root, root / citing.parent):
        p = (base / name).resolve()
        if p.is_relative_to(root.resolve()) and p.relative_to(root.resolve()) in docs:
            return p.relative_to(root.resolve())
    return None


def broken_citations(root: Path, files: list[Path], docs: set[Path]) -> list[str]:
    """'file:line: why' for every citation of a missing .md file or of a missing section."""
    bad, headings = [], {}
    for f in files:
        text = URL.sub(lambda m: " " * len(m.group()), (root / f).read_text(encoding="utf-8"))
        for m in CITE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            doc = resolve(root, f, m.group(1), docs)
            if doc is None:
                bad.append(f"{f}:{line}: cites {m.group(1)}, which is not a file of the repository")
                continue
            s = SECTION.match(text, m.end())
            if s:
                if doc not in headings:
                    headings[doc] = HEADING.findall((root / doc).read_text(encoding="utf-8"))
                if not any(s.group(1) in h for h in headings[doc]):
                    bad.append(f'{f}:{line}: cites {m.group(1)} "{s.group(1)}", which is no heading of {doc}')
    return bad


def test_cited_documents_are_in_the_repository():
    files = tracked(ROOT, "*.py", "*.md")
    docs = {p for p in files if p.suffix == ".md"}
    assert Path("DESIGN.md") in docs and Path("README.md") in docs
    this = Path(__file__).resolve().relative_to(ROOT)  # its examples are the checker's test cases
    assert broken_citations(ROOT, [f for f in files if f != this], docs) == []


def test_checker_finds_missing_files_and_sections(tmp_path):
    """The check can fail: a missing file, a path outside the repository (that exists), a missing
    section; a present file from the root or the citing folder, a present section and a URL pass."""
    (tmp_path / "repo" / "sub").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("# Outside\n")
    root = tmp_path / "repo"
    (root / "DESIGN.md").write_text("# Design\n## Serving formats (engines)\ntext\n")
    (root / "sub" / "notes.md").write_text("see DESIGN.md and ../DESIGN.md, https://example.org/x/README.md\n")
    (root / "a.py").write_text(
        '"""DESIGN.md, "Serving formats"; sub/notes.md; notes.md\n'
        'DESIGN.md "Strategy contract"; GONE.md; ../outside.md"""\n'
    )
    files = [Path("DESIGN.md"), Path("sub/notes.md"), Path("a.py")]
    docs = {Path("DESIGN.md"), Path("sub/notes.md")}
    assert broken_citations(root, files, docs) == [
        "a.py:1: cites notes.md, which is not a file of the repository",
        'a.py:2: cites DESIGN.md "Strategy contract", which is no heading of DESIGN.md',
        "a.py:2: cites GONE.md, which is not a file of the repository",
        "a.py:2: cites ../outside.md, which is not a file of the repository",
    ]
