"""Overlap data preparation with compute: batch i+1 is built on a background thread (collate and
any host-side work), pinned, and copied to the GPU on a side stream with non_blocking copies
while step i runs. The consumer's stream waits on an event, never the host.

    batches = Prefetcher(lambda step: build(step), range(start, stop), device)
    for step in range(start, stop):
        b = next(batches)       # dict: tensors on `device`, other values passed through
"""

import queue
import threading

import torch

_DONE = object()


class Prefetcher:
    def __init__(self, make, keys, device, depth: int = 2):
        """make(key) -> dict of CPU tensors and plain values; keys in consumption order."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # set_device on the thread needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, iter(keys)), daemon=True, name="prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make, keys):
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.device)
            for key in keys:
                if self._stop.is_set() or not self._put(self._transfer(make(key))):
                    return
            self._put(_DONE)
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def _transfer(self, host: dict):
        if self.stream is None:
            return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in host.items()}, None
        with torch.cuda.stream(self.stream):
            out = {
                k: v.pin_memory().to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in host.items()
            }
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        item = self._queue.get()
        if item is _DONE:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        out, done = item
        if done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            for v in out.values():  # the side stream allocated them; the main stream uses them
                if torch.is_tensor(v):
                    v.record_stream(current)
        return out

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
