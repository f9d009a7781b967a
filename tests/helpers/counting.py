"""Counting a module's heap operations: work measured without a clock."""

from __future__ import annotations

import heapq
from collections import Counter
from types import SimpleNamespace


def count_heap_ops(monkeypatch, module) -> Counter:
    """Replace ``module.heapq`` by one that counts its ``heappush`` and ``heappop`` calls; the counts."""
    calls = Counter()

    def counted(name):
        def call(*args):
            calls[name] += 1
            return getattr(heapq, name)(*args)
        return call

    monkeypatch.setattr(module, "heapq", SimpleNamespace(heapify=heapq.heapify, heappush=counted("heappush"),
                                                         heappop=counted("heappop")))
    return calls
