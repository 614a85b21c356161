"""vLLM's ExampleHiddenStatesConnector, copying on the CPU. Imported only inside the vLLM venv
(by vLLM, through kv_connector_module_path; core/vllm_features.py sets it up).

The stock connector (vLLM 0.32) extracts a finished request's hidden states from the cache on a
CUDA stream into pinned host memory and records a CUDA event that get_finished() polls; the CPU
build has neither streams nor pinned memory and fails at its first write. Here the rows are
gathered on the host (a copy, so the cache blocks can be freed at once) and the event is one
that is already done. Everything else (file names, lock files, the writer threads) is vLLM's.
On a GPU build this class works too (the gather then runs on the device and .cpu() syncs).
"""

import fcntl
import os

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event of the stock connector's device-to-host copy."""

    def query(self) -> bool:
        return True

    def synchronize(self):
        pass


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        n = pending.token_ids.shape[0]
        # [n, len(layer ids), H]: a copy (advanced indexing), so the cache blocks may be reused at once
        hidden = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), n).cpu()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)  # taken (LOCK_EX) in wait_for_save
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))
