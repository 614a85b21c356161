"""The deployment section of train.py's config, and YAML configs for any config dataclass.

    train.py --config run.yaml [--flag value ...]     # YAML first, then flags override it

A YAML file holds the same fields as the flags (underscored names; the deployment fields in a
`deploy:` mapping, or at top level like their flags). Unknown keys are an error that names them.
"""

import dataclasses
import sys
import typing
from dataclasses import dataclass
from pathlib import Path

import tyro
import yaml


@dataclass
class DeployConfig:
    """Disaggregated online training (core/disagg/): producers run the target, consumers train."""

    role: typing.Literal["", "producer", "consumer"] = ""
    """'' = this node runs the whole job (with --producers > 0 the launcher supervises both pools);
    producer | consumer = start one pool member against --control"""
    producers: int = 0
    """producer processes the launcher starts (0 = colocated online training: the target runs in the trainer)"""
    consumer_ranks: int = 1
    """consumer (trainer) ranks the launcher starts (torchrun, FSDP2)"""
    control: str = ""
    """directory of the control database (leases, refs, ledger); shared by every member of the run
    (default --out/pipeline)"""
    store: str = ""
    """feature transport: a directory (local or shared) or mooncake://HOST:PORT (the master's RPC
    address; the launcher starts a master on loopback for mooncake://local) (default --out/pipeline/features)"""
    worker_name: str = ""
    """name of this producer in its log lines (default w<id>; the control database also records host and pid)"""
    lease_size: int = 0
    """prompts a producer takes per lease, run through the target together (0 = the global batch)"""
    high_watermark: int = 0
    """samples in flight (leased or produced, not yet trained) at which producers pause (0 = 4 global batches)"""
    low_watermark: int = 0
    """paused producers resume once in flight samples fall to this (0 = 2 global batches)"""
    heartbeat: float = 2.0
    """seconds between a member's heartbeats"""
    lease_timeout: float = 30.0
    """a producer silent this long is dead: its leases return to the pool"""
    producer_timeout: float = 300.0
    """the consumer fails the run when no producer has been alive for this long (covers target loading)"""
    max_attempts: int = 3
    """leases of one prompt before the run fails (a prompt that kills or stalls every producer)"""


def _build(cls, data, where: str):
    """A dataclass from a mapping: nested dataclasses from nested mappings, tuples from lists; every value
    checked against its field's type (tyro checks flags, nothing checks a YAML default), so `steps: "two"`
    is one error line here rather than a TypeError deep in the run."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SystemExit(f"error: {where}: expected a mapping of option: value, got {_kind(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    nested = {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(_plain(hints[f.name]))}
    flat = {n: sub for sub in nested for n in (f.name for f in dataclasses.fields(_plain(nested[sub])))}
    kw, sub_kw = {}, {s: {} for s in nested}
    for k, v in data.items():
        k = str(k).replace("-", "_")
        if k in nested:
            if v is not None and not isinstance(v, dict):
                raise SystemExit(f"error: {where}: {k}: expected a mapping of option: value, got {_kind(v)}")
            sub_kw[k].update(v or {})
        elif k in names:
            kw[k] = _value(v, _plain(hints[k]), f"{where}: {k}")
        elif k in flat:  # a deployment field written at top level, like its flag
            sub_kw[flat[k]][k] = v
        else:
            raise SystemExit(f"error: {where}: unknown config key {k!r}")
    for s, d in sub_kw.items():
        kw[s] = _build(_plain(nested[s]), d, f"{where}: {s}")
    return cls(**kw)


def _kind(v) -> str:
    return f"{type(v).__name__} {v!r}" if not isinstance(v, (dict, list)) else f"a {type(v).__name__}"


def _value(v, tp, where: str):
    """v as a value of type tp (bool, int, float, str, a Literal, tuple[int, ...]), else one error line."""

    def bad(want: str):
        return SystemExit(f"error: {where}: expected {want}, got {_kind(v)}")

    if typing.get_origin(tp) is typing.Literal:
        if v not in typing.get_args(tp):
            raise bad("one of " + ", ".join(map(repr, typing.get_args(tp))))
        return v
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if not isinstance(v, list):
            raise bad(f"a list of {item.__name__}")
        return tuple(_value(x, item, where) for x in v)
    if tp is bool:
        if not isinstance(v, bool):
            raise bad("true or false")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad("a whole number")
        return v
    if tp is float:
        if isinstance(v, str):  # YAML 1.1 reads 1e-3 (no dot) as a string; the flag takes it
            try:
                return float(v)
            except ValueError:
                raise bad("a number") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad("a number")
        return float(v)
    if tp is str:
        if isinstance(v, (dict, list)) or v is None:
            raise bad("a string")
        return str(v)  # e.g. `out: 2024`, a number YAML read as one
    return v


def _plain(tp):
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def load_yaml(cls, path):
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SystemExit(f"error: --config {path}: not found") from None
    except (OSError, UnicodeDecodeError) as e:  # a directory, unreadable, a binary file
        raise SystemExit(f"error: --config {path}: cannot be read as a YAML file ({type(e).__name__}: {e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise SystemExit(f"error: --config {path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None
    return _build(cls, data, f"--config {path}")


def dump_yaml(cfg, path):
    d = dataclasses.asdict(cfg)
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


def to_flags(cfg, default=None) -> list[str]:
    """The command-line flags that give `cfg` (a config dataclass, as `cli` reads it) from its class's defaults
    (or `default`): one flag per field that differs, nested dataclasses flattened as their flags are
    (OmitArgPrefixes), bools as --name / --no-name, tuples as their items. Scripts that start train.py build its
    command from a TrainConfig this way, so a misspelled or stale option is a TypeError, not a flag train.py
    refuses minutes later."""
    default = type(cfg)() if default is None else default
    out = []
    for f in dataclasses.fields(cfg):
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        if dataclasses.is_dataclass(v):
            out += to_flags(v, d)
        elif v != d:
            name = "--" + f.name.replace("_", "-")
            if isinstance(v, bool):
                out.append(name if v else "--no-" + name[2:])
            elif isinstance(v, (tuple, list)):
                out += [name, *map(str, v)]
            else:
                out += [name, str(v)]
    return out


def cli(cls, args=None):
    """tyro over `cls`, with `--config FILE.yaml` giving the defaults that flags override."""
    args = list(sys.argv[1:] if args is None else args)
    default = cls()
    for i, a in enumerate(args):
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
            if path is None:
                raise SystemExit("error: --config needs a YAML file")
            del args[i : i + (1 if "=" in a else 2)]
            default = load_yaml(cls, path)
            break
    return tyro.cli(cls, args=args, default=default)


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values given to `flag` on a command line (`flag VALUE` or `flag=VALUE`), in order."""
    out = []
    for i, a in enumerate(argv):
        if a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
        elif a == flag and i + 1 < len(argv):
            out.append(argv[i + 1])
    return out


def config_path(argv: list[str]) -> str:
    """The --config file named on the command line (cli() reads the first and drops it from the flags)."""
    return next(iter(flag_values(argv, "--config")), "")
