"""Counting the reads of a tensor back to the host (on a GPU, each one a sync), on the CPU.

A read shows in two ways: through the Python methods that return host values (``item``,
``int``, ``float``, ``bool``, ``index``, ``tolist``, ``numpy``; under ``inference_mode`` the CPU
reads the number without any dispatch), and as ``aten._local_scalar_dense`` from torch's own
code. A read through one of the methods is recorded once, by the method's name; one that only
the dispatcher sees, as ``"_local_scalar_dense"``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

METHODS = ("item", "__int__", "__float__", "__bool__", "__index__", "tolist", "numpy")


class HostReads(TorchDispatchMode):
    """``with HostReads() as r:`` collects in ``r.reads`` ``label(name)`` for every read (default: the name)."""

    def __init__(self, label: Callable[[str], object] = lambda name: name):
        super().__init__()
        self.reads: list = []
        self._label, self._inside = label, False
        self._patches = pytest.MonkeyPatch()

    def __enter__(self):
        for name in METHODS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, _name=name, **kwargs):
                if self._inside:  # a method that calls another (tolist → item): one read
                    return _original(tensor, *args, **kwargs)
                self.reads.append(self._label(_name))
                self._inside = True
                try:
                    return _original(tensor, *args, **kwargs)
                finally:
                    self._inside = False

            self._patches.setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        self._patches.undo()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket == torch.ops.aten._local_scalar_dense and not self._inside:
            self.reads.append(self._label("_local_scalar_dense"))
        return func(*args, **(kwargs or {}))
