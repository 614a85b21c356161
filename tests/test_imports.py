"""The project's import graph runs one way (issue #19).

Every .py outside tests/ that git tracks or would track is parsed (ast, no import runs): each `import` and
`from ... import` anywhere in the file, at top level, inside a function or under `if TYPE_CHECKING:` (an annotation
is a dependency too: a type-only cycle still ties two modules together), is an
edge to the project module it names (`from x import y` goes to x.y when that is a module, else to x). Four rules:
- no cycles;
- a library module (core/, models/, data/, kernels/) never imports an entry script (the scripts a user runs:
  train.py, capture.py, export.py, evaluate.py, gate.py, experiments/, tools/);
- nothing outside tests/ imports tests/ (what scripts share with the tests lives in the library, e.g. models/tiny.py);
- the bottom layers import down only: data/ and kernels/ nothing else of the project, models/ only them.
"""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# library modules; every other module is an entry script
LIBRARY = ("core", "data", "kernels", "models")


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, files: list[Path]) -> dict[str, set[str]]:
    """{module: project modules it imports}; files are paths relative to root."""
    mods = {module_name(f): f for f in files}
    graph = {m: set() for m in mods}
    for mod, f in mods.items():
        package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse((root / f).read_text(), str(f))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, level-1 packages up
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                    base = ".".join([*up, *([base] if base else [])])
                names = [
                    f"{base}.{a.name}".lstrip(".") if f"{base}.{a.name}".lstrip(".") in mods else base
                    for a in node.names
                ]
            else:
                continue
            for name in names:
                while name and name not in mods:  # `import a.b.c` of a module a.b: the longest project prefix
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    state, stack = {}, []  # state: 1 = on the DFS stack, 2 = done

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state and (c := visit(n)):
                return c
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def is_library(mod: str) -> bool:
    return mod.split(".")[0] in LIBRARY


def library_to_entry(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, n) for m, deps in graph.items() if is_library(m) for n in deps if not is_library(n))


def python_files(root: Path = ROOT) -> list[Path]:
    """Every .py that git tracks or would track (not ignored), relative to root."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [Path(p) for p in out.split()]


def project_graph(with_tests: bool = False) -> dict[str, set[str]]:
    files = [p for p in python_files() if with_tests or p.parts[0] != "tests"]
    return import_graph(ROOT, files)


def imports_of_tests(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module outside tests/, the tests/ module it imports)."""
    is_test = lambda m: m == "tests" or m.startswith("tests.")  # noqa: E731
    return sorted((m, n) for m, deps in graph.items() if not is_test(m) for n in deps if is_test(n))


def test_project_imports_run_one_way():
    graph = project_graph()
    assert {"train", "capture", "core.disagg.roles", "core.config", "core.distributed"} <= graph.keys()
    assert "core.distributed" in graph["capture"] and "core.distributed" in graph["train"]  # the parser sees real edges
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"
    assert library_to_entry(graph) == [], "library modules import entry scripts"


# the root scripts another entry script may import: export.py is where the design card puts the engine
# formats, so evaluate.py, gate.py and experiments read and write serving dirs through it
SHARED_SCRIPTS = {"export"}


def script_to_script(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(entry script, the root script it imports) for every root script outside SHARED_SCRIPTS;
    experiments/ importing its own helpers (experiments.common, experiments.sweep) is not counted."""
    root = lambda m: "." not in m and not is_library(m) and m != "tests"  # noqa: E731
    return sorted(
        (m, n)
        for m, deps in graph.items()
        if not is_library(m) and not m.startswith("tests")
        for n in deps
        if root(n) and n not in SHARED_SCRIPTS
    )


def test_scripts_import_no_other_script_but_export():
    graph = project_graph()
    assert "export" in graph["evaluate"]  # the parser sees the one allowed script-to-script edge
    assert script_to_script(graph) == [], "an entry script imports another entry script (not export.py)"
    assert script_to_script({"experiments.x": {"capture", "export", "experiments.sweep", "core.regenerate"}}) == [
        ("experiments.x", "capture")
    ]


# the bottom layers (DESIGN.md, "Layers and imports"): package -> the project packages it may import
BOTTOM = {"data": {"data"}, "kernels": {"kernels"}, "models": {"models", "data", "kernels"}}


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module of a bottom package, the module above its layer that it imports)."""
    top = lambda m: m.split(".")[0]  # noqa: E731
    return sorted((m, n) for m, deps in graph.items() if top(m) in BOTTOM for n in deps if top(n) not in BOTTOM[top(m)])


def test_bottom_layers_import_down_only():
    """data/ and kernels/ import nothing else of the project; models/ only data/ and kernels/."""
    graph = project_graph()
    assert "data.feature_store" in graph and "models.eagle3" in graph
    assert upward(graph) == [], "a bottom layer imports upward"
    assert upward({"data.feature_store": {"models.target"}, "models.x": {"kernels.ce", "features"}}) == [
        ("data.feature_store", "models.target"),
        ("models.x", "features"),
    ]


def test_nothing_outside_tests_imports_tests():
    graph = project_graph(with_tests=True)
    assert "models.tiny" in graph["tests.tiny"]  # the parser sees tests/ too
    assert imports_of_tests(graph) == [], "scripts or library import tests/"
    assert imports_of_tests({"tools.golden": {"tests.tiny"}, "tests.conftest": {"tests.tiny"}}) == [
        ("tools.golden", "tests.tiny")
    ]


def test_checker_finds_cycles_and_upward_imports(tmp_path):
    """The checks can fail: a cycle closed by a function-local import, one closed by a type-only import
    (`if TYPE_CHECKING:`, as models/moe.py once had with models/eagle3.py), and a library module (core/)
    importing an entry script (train.py)."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text("")
    (tmp_path / "core" / "roles.py").write_text("import os\n\ndef f():\n    from train import Trainer\n")
    (tmp_path / "core" / "control.py").write_text("from . import roles\nfrom .roles import f\n")
    (tmp_path / "train.py").write_text("import torch\nimport core.roles\n")
    (tmp_path / "capture.py").write_text(
        "from typing import TYPE_CHECKING\nfrom core import control\nif TYPE_CHECKING:\n    import train\n"
    )
    (tmp_path / "moe.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eagle3 import C\n")
    (tmp_path / "eagle3.py").write_text("from moe import MoEMLP\n")
    names = ("core/__init__.py", "core/roles.py", "core/control.py", "train.py", "capture.py")
    graph = import_graph(tmp_path, [Path(p) for p in names])
    assert graph == {
        "core": set(),
        "core.roles": {"train"},
        "core.control": {"core.roles"},
        "train": {"core.roles"},
        "capture": {"core.control", "train"},
    }
    assert find_cycle(import_graph(tmp_path, [Path("moe.py"), Path("eagle3.py")])) == ["eagle3", "moe", "eagle3"]
    assert find_cycle(graph) == ["core.roles", "train", "core.roles"]
    assert library_to_entry(graph) == [("core.roles", "train")]
    graph["core.roles"].clear()  # the fix: roles gets the Trainer as an argument
    assert find_cycle(graph) is None and library_to_entry(graph) == []
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


def unexplained_local_imports(source: str, filename: str = "<src>") -> list[int]:
    """Line numbers of the imports inside a function (any depth) whose lines carry no comment saying why; a comment
    that is only `noqa: ...` says nothing. Imports belong at the top of a file: one inside a function is there for a
    reason (a heavy or optional dependency, an environment variable to set first, a --help kept light), and the line
    says which."""
    lines = source.splitlines()

    def explained(node) -> bool:
        for line in lines[node.lineno - 1 : node.end_lineno]:
            comment = line.partition("#")[2]
            words = re.sub(r"noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?", "", comment)
            if re.search(r"[A-Za-z]", words):
                return True
        return False

    found = set()
    for fn in ast.walk(ast.parse(source, filename)):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found |= {
                n.lineno for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)) and not explained(n)
            }
    return sorted(found)


def test_imports_inside_functions_say_why():
    """Every tracked .py, tests included: an import inside a function says on its line why it is not at the top."""
    found = {
        str(p): lines for p in python_files() if (lines := unexplained_local_imports((ROOT / p).read_text(), str(p)))
    }
    assert found == {}, f"imports inside functions without a reason on the line (move them up, or say why): {found}"


def test_local_import_check_can_fail():
    src = (
        "import os\n\n"
        "def f():\n    import json\n    import gzip  # noqa: F401\n    import vllm  # optional: vLLM's venv only\n"
        "    def g():\n        from torch import (  # heavy: --help stays light\n            nn,\n        )\n"
        "        from math import (\n            pi,  # noqa: F401\n        )\n"
    )
    assert unexplained_local_imports(src) == [4, 5, 11]
