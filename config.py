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
    """Disaggregated online training (disagg/): producers run the target, consumers train."""

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


def _build(cls, data: dict, where: str):
    """A dataclass from a mapping: nested dataclasses from nested mappings, tuples from lists."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    nested = {f.name: hints[f.name] for f in dataclasses.fields(cls) if dataclasses.is_dataclass(_plain(hints[f.name]))}
    flat = {n: sub for sub in nested for n in (f.name for f in dataclasses.fields(_plain(nested[sub])))}
    kw, sub_kw = {}, {s: {} for s in nested}
    for k, v in (data or {}).items():
        k = k.replace("-", "_")
        if k in nested:
            sub_kw[k].update(v or {})
        elif k in names:
            kw[k] = tuple(v) if isinstance(v, list) else v
        elif k in flat:  # a deployment field written at top level, like its flag
            sub_kw[flat[k]][k] = v
        else:
            raise SystemExit(f"{where}: unknown config key {k!r}")
    for s, d in sub_kw.items():
        kw[s] = _build(_plain(nested[s]), d, f"{where}: {s}")
    return cls(**kw)


def _plain(tp):
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def load_yaml(cls, path):
    p = Path(path)
    if not p.exists():
        raise SystemExit(f"--config {path}: not found")
    return _build(cls, yaml.safe_load(p.read_text()) or {}, str(path))


def dump_yaml(cfg, path):
    d = dataclasses.asdict(cfg)
    Path(path).write_text(yaml.safe_dump(d, sort_keys=False))


def cli(cls, args=None):
    """tyro over `cls`, with `--config FILE.yaml` giving the defaults that flags override."""
    args = list(sys.argv[1:] if args is None else args)
    default = cls()
    for i, a in enumerate(args):
        if a == "--config" or a.startswith("--config="):
            path = a.split("=", 1)[1] if "=" in a else (args[i + 1] if i + 1 < len(args) else None)
            if path is None:
                raise SystemExit("--config needs a YAML file")
            del args[i : i + (1 if "=" in a else 2)]
            default = load_yaml(cls, path)
            break
    return tyro.cli(cls, args=args, default=default)
