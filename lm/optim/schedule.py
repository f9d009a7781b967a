"""Learning-rate schedule: linear warm-up, cosine decay, constant floor."""

from __future__ import annotations

import math


def cosine_lr_schedule(
    it: float,
    max_learning_rate: float,
    min_learning_rate: float,
    warmup_iters: float,
    cosine_cycle_iters: float,
) -> float:
    """The learning rate at iteration ``it``.

    - ``it < warmup_iters``: linear warm-up ``max · it / warmup_iters`` (0 at ``it = 0``);
    - ``warmup_iters ≤ it ≤ cosine_cycle_iters``: half a cosine from ``max`` down to ``min``;
    - ``it > cosine_cycle_iters``: ``min``.

    ``it`` may be fractional, which lets a time-limited run follow the schedule by elapsed time.

    >>> cosine_lr_schedule(5, 1.0, 0.1, 10, 100), cosine_lr_schedule(100, 1.0, 0.1, 10, 100)
    (0.5, 0.1)
    """
    if it < warmup_iters:
        return max_learning_rate * it / warmup_iters
    if it > cosine_cycle_iters:
        return min_learning_rate
    if cosine_cycle_iters == warmup_iters:
        return max_learning_rate
    progress = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (
        max_learning_rate - min_learning_rate
    )
