"""The command-line options several scripts share, one small dataclass per group, so that each is declared (name,
type, default, --help text) once and means the same in every script that takes it:

    StrategyOption    --strategy     the draft family, as train.py and gate.py take it
    TargetOption      --target       the target model, as train.py and capture.py take it
    DataOption        --data         the chats, as train.py --data takes them
    NumRecordsOption  --num-records  how many records of --data are read (0 = all)
    MaxLenOption      --max-len      tokens per conversation (train.py's default, 384)
    DeviceOption      --device       auto | cpu | cuda
    DtypeOption       --dtype        auto | bf16 | fp16 | fp32 (auto: bf16 on a GPU, fp32 on a CPU)
    SamplingOptions   --temperature --top-p --top-k --seed   how the target samples what it writes

A script's tyro dataclass inherits the groups it takes, and re-declares a field only to change its default, with a
comment saying why that script's default differs (the group's docstring stays the --help text unless the script
writes one of its own):

    @dataclass
    class Args(MaxLenOption, DataOption, TargetOption):
        max_len: int = 4096  # the 8B recipe's rows
        steps: int = 40

--help lists the inherited options first, the last base's first (a dataclass's fields start with its last base's):
the bases are written in the reverse of the order the options are listed in (here --target, --data, --max-len).

Each group is kw_only, so a script may add required (positional) fields after the inherited ones; a script that has
such a field and also re-declares a group field is itself declared kw_only (a re-declared field is an ordinary one
again, and a field without a default may not follow it).

Library code that imports nothing of the project, nor torch: a --help, or a process that only launches others
(experiments/sweep.py), stays as light as it was. So the defaults are written out here: TargetOption's is
models/target.DEFAULT_TARGET, DataOption's data/datasets.DEFAULT_DATA and StrategyOption's names the families of
models/families.py (tests/test_cli_options.py checks all three)."""

from dataclasses import dataclass


@dataclass(kw_only=True)
class StrategyOption:
    strategy: str = "eagle3"
    """draft family: eagle3 | peagle | dflash | domino | dspark (models/families.py)"""


@dataclass(kw_only=True)
class TargetOption:
    target: str = "smollm2"
    """HF causal-LM directory, a .gguf file, or 'smollm2' (the packaged SmolLM2-135M-Instruct)"""


@dataclass(kw_only=True)
class DataOption:
    data: str = "sharegpt-greedy"
    """'sharegpt-greedy' (packaged chats answered greedily by SmolLM2 itself, 16,808), 'sharegpt-regen' (3,390
    answered by SmolLM2 at temperature 0.8), 'sharegpt' (the original answers), or a ShareGPT/messages-style
    .json/.jsonl(.gz)/.parquet file or directory"""


@dataclass(kw_only=True)
class NumRecordsOption:
    num_records: int = 0
    """records read from the data (0 = all)"""


@dataclass(kw_only=True)
class MaxLenOption:
    max_len: int = 384
    """tokens per conversation; longer ones are truncated"""


@dataclass(kw_only=True)
class DeviceOption:
    device: str = "auto"
    """auto | cpu | cuda"""


@dataclass(kw_only=True)
class DtypeOption:
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32"""


@dataclass(kw_only=True)
class SamplingOptions:
    temperature: float = 0.0
    """0 = greedy"""
    top_p: float = 1.0
    top_k: int = 0
    """0 = off"""
    seed: int = 0
