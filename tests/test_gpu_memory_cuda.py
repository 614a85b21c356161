"""--gpu-memory on a GPU (through the device tool: `pytest -m cuda tests/test_gpu_memory_cuda.py`): PyTorch's
allocator is capped at the GiB given, so a run sized for an 80 GiB GPU on a larger one fails where the smaller
GPU would, and more than the GPU has is refused."""

import pytest
import torch

from core.feeding import gpu_memory
from core.train_config import ConfigError, TrainConfig

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_gpu_memory_caps_the_allocator():
    dev = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(dev).total_memory
    assert gpu_memory(TrainConfig(), dev) == total  # 0: all of it, no cap
    try:
        assert gpu_memory(TrainConfig(gpu_memory=2.0), dev) == 2 * 2**30
        x = torch.empty(2**30, dtype=torch.uint8, device=dev)  # 1 GiB fits under the cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 * 2**30, dtype=torch.uint8, device=dev)  # 3 GiB does not, on a GPU with far more
        del x
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
    with pytest.raises(ConfigError, match="more than this GPU has"):
        gpu_memory(TrainConfig(gpu_memory=total / 2**30 + 1), dev)
