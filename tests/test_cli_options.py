"""core/cli_options.py's groups say what train.py says: their defaults are the library's (written out there, so
that the groups import nothing heavy)."""

from core.cli_options import DataOption, DeviceOption, MaxLenOption, TargetOption
from core.train_config import BaseTrainConfig
from data.datasets import DEFAULT_DATA
from models.target import DEFAULT_TARGET


def test_group_defaults_are_the_librarys():
    assert TargetOption().target == DEFAULT_TARGET == BaseTrainConfig().target
    assert DataOption().data == DEFAULT_DATA == BaseTrainConfig().data
    assert MaxLenOption().max_len == BaseTrainConfig().max_len
    assert DeviceOption().device == BaseTrainConfig().device
