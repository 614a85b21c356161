"""core/cli_options.py's groups say what the library says (their defaults are written out there, so that the groups
import nothing heavy), and every script that takes an option of a group takes it from the group: one declaration per
option, whatever default a script gives it."""

import ast
import inspect
from pathlib import Path

from core.cli_options import DataOption, DeviceOption, MaxLenOption, StrategyOption, TargetOption
from core.train_config import BaseTrainConfig
from data.datasets import DEFAULT_DATA
from models.families import FAMILIES
from models.target import DEFAULT_TARGET
from tests.test_imports import python_files

ROOT = Path(__file__).resolve().parents[1]
# (file, class, option): options of a group's name and type that mean something else there
OTHER_MEANING = {
    ("core/train_config.py", "BaseTrainConfig", "seed"),  # orders the data and initialises the draft; samples nothing
    ("evaluate.py", "EvalArgs", "target"),  # default: the target recorded with the draft
    ("evaluate.py", "EvalArgs", "device"),  # cpu | cuda: no auto (τ is compared on one device)
    ("evaluate.py", "EvalArgs", "dtype"),  # fp32 | bf16: no auto
    ("experiments/gen_bench.py", "Args", "device"),  # cuda | cpu (a smoke run): the benchmark has no auto
    ("export.py", "ExportArgs", "target"),  # the target the export is checked against (default: none)
    ("tools/random_target.py", "Args", "device"),  # where the random weights are drawn, not where a model runs
    ("tools/random_target.py", "Args", "seed"),  # the random weights' seed
}


def test_group_defaults_are_the_librarys():
    assert TargetOption().target == DEFAULT_TARGET == BaseTrainConfig().target
    assert DataOption().data == DEFAULT_DATA == BaseTrainConfig().data
    assert MaxLenOption().max_len == BaseTrainConfig().max_len
    assert DeviceOption().device == BaseTrainConfig().device
    assert StrategyOption().strategy in FAMILIES
    # the --help text lists every family (written out: the group imports nothing of the project)
    names = inspect.getsource(StrategyOption).split('"""')[1].split("(")[0].replace("draft family:", "").split("|")
    assert [n.strip() for n in names] == list(FAMILIES)


def class_fields(root: Path, files: list[str]) -> dict[str, list[tuple[str, list[str], dict[str, str]]]]:
    """{class name: [(file, base names, {field: annotation})]} of every class in files (parsed, not imported)."""
    out = {}
    for f in files:
        for node in ast.walk(ast.parse((root / f).read_text(), f)):
            if isinstance(node, ast.ClassDef):
                fields = {
                    s.target.id: ast.unparse(s.annotation)
                    for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                }
                bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                out.setdefault(node.name, []).append((f, bases, fields))
    return out


def redeclared_options(root: Path, files: list[str]) -> list[tuple[str, str, str]]:
    """(file, class, option) of every class outside models/ (runtime types, not command lines) that declares an
    option of a core/cli_options.py group, with the group's type, without inheriting that group."""
    classes = class_fields(root, files)
    group_of = {
        name: (group, ann)
        for group, defs in classes.items()
        for f, _, fields in defs
        if f == "core/cli_options.py"
        for name, ann in fields.items()
    }

    def ancestors(name: str, seen: set) -> set:
        for _, bases, _ in classes.get(name, []):
            for b in set(bases) - seen:
                seen.add(b)
                ancestors(b, seen)
        return seen

    return [
        (f, name, opt)
        for name, defs in classes.items()
        for f, _, fields in defs
        if f != "core/cli_options.py" and not f.startswith("models/")
        for opt, ann in fields.items()
        if opt in group_of and group_of[opt][1] == ann and group_of[opt][0] not in ancestors(name, set())
    ]


def test_scripts_take_shared_options_from_the_groups():
    """A script declares no option of a group by hand: it inherits the group (and may change the default)."""
    files = [str(p) for p in python_files() if p.parts[0] != "tests"]
    found = set(redeclared_options(ROOT, files))
    assert not found - OTHER_MEANING, f"declared again (inherit the core/cli_options.py group): {found - OTHER_MEANING}"
    assert not OTHER_MEANING - found, f"no longer declared: drop from OTHER_MEANING {OTHER_MEANING - found}"


def test_check_finds_a_redeclared_option(tmp_path):
    """The check can fail: a script that writes --target itself is found; one that inherits the group is not."""
    (tmp_path / "core").mkdir()
    (tmp_path / "core/cli_options.py").write_text((ROOT / "core/cli_options.py").read_text())
    (tmp_path / "a.py").write_text("class A:\n    target: str = 'x'\n")
    (tmp_path / "b.py").write_text("class B(TargetOption):\n    target: str = 'y'\n")
    assert redeclared_options(tmp_path, ["core/cli_options.py", "a.py", "b.py"]) == [("a.py", "A", "target")]
