"""Counting the aten operations run inside a block (on a GPU, each one a kernel launch)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """``with AtenOps() as count:`` counts in ``count.ops`` the aten ops dispatched (not the
    profiler's record_function markers, which are not aten's)."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += func.namespace == "aten"
        return func(*args, **(kwargs or {}))
