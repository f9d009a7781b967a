"""The bytes of the tensors a piece of code makes: a CPU stand-in for ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage that an op inside the mode creates, until it is
    freed, and keeps the peak (``.peak``)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _freed(self, key: int, nbytes: int) -> None:
        if self.live.pop(key, None) is not None:
            self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.live:  # in-place ops and views add nothing
                    self.live[key] = nbytes
                    self.current += nbytes
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._freed, key, nbytes)
        return out
