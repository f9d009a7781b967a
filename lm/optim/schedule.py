"""Learning-rate schedules: linear warm-up, then cosine decay (or warm-up, stable, decay), then a floor."""

from __future__ import annotations

import math


def _check(function: str, **values: float) -> None:
    """Each value a finite, non-negative real number, else a ValueError naming ``function`` and the
    argument: a NaN or negative argument would otherwise give a NaN rate, a ZeroDivisionError, or a
    plausible rate from the wrong thing (the trainer's config checks the same for ``lm train``)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise ValueError(f"{function}: {name} must be a number, got {value!r}")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{function}: {name} must be a finite number >= 0, got {value!r}")


def _check_rates(function: str, max_learning_rate: float, min_learning_rate: float) -> None:
    _check(function, max_learning_rate=max_learning_rate, min_learning_rate=min_learning_rate)
    if min_learning_rate > max_learning_rate:
        raise ValueError(f"{function}: min_learning_rate ({min_learning_rate!r}) must not exceed "
                         f"max_learning_rate ({max_learning_rate!r})")


def _check_width_and_warmup(function: str, d_model: int, warmup_iters: float) -> None:
    """The inverse square root schedule's ``d_model`` and ``warmup_iters`` (numbers, checked by
    :func:`_check`) are > 0: ``0 ** -1.5`` divides by zero, and a scale for either 0 is 0."""
    if d_model < 1 or warmup_iters <= 0:
        raise ValueError(f"{function}: d_model and warmup_iters must be > 0, got {d_model!r} and {warmup_iters!r}")


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
    A warm-up longer than the cycle (a run of a few steps under the default 100 of warm-up, as a
    demo's, whose cycle is its length) climbs until the warm-up ends, past the cycle, then gives
    ``min`` (nanoGPT's ``get_lr`` and CS336's schedule check the warm-up first too): there is no
    cosine left to follow. ``lm train`` refuses a config whose run would go on past that drop.

    >>> cosine_lr_schedule(5, 1.0, 0.1, 10, 100), cosine_lr_schedule(100, 1.0, 0.1, 10, 100)
    (0.5, 0.1)
    """
    _check("cosine_lr_schedule", it=it, warmup_iters=warmup_iters, cosine_cycle_iters=cosine_cycle_iters)
    _check_rates("cosine_lr_schedule", max_learning_rate, min_learning_rate)
    if it < warmup_iters:
        return max_learning_rate * it / warmup_iters
    if it > cosine_cycle_iters:
        return float(min_learning_rate)  # a float whatever numbers came in (an int had come back: api22)
    if cosine_cycle_iters == warmup_iters:
        return float(max_learning_rate)
    progress = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (
        max_learning_rate - min_learning_rate
    )


def wsd_lr_schedule(
    it: float,
    max_learning_rate: float,
    min_learning_rate: float,
    warmup_iters: float,
    total_iters: float,
    decay_fraction: float = 0.2,
) -> float:
    """Warm-up, stable, decay ("WSD"): the learning rate at iteration ``it``.

    - ``it < warmup_iters``: linear warm-up ``max · it / warmup_iters``;
    - then ``max`` until the last ``decay_fraction`` of ``total_iters``;
    - then a linear decay that reaches ``min`` at ``total_iters``, and ``min`` after it.

    Holding the peak longer and decaying late often ends a fixed budget a little lower than
    cosine (Hu et al. 2024, "MiniCPM"; Hägele et al. 2024).

    >>> [wsd_lr_schedule(i, 1.0, 0.0, 10, 100, 0.2) for i in (5, 50, 80, 90, 100)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    _check("wsd_lr_schedule", it=it, warmup_iters=warmup_iters, total_iters=total_iters)
    _check_rates("wsd_lr_schedule", max_learning_rate, min_learning_rate)
    if not (isinstance(decay_fraction, (int, float)) and 0 < decay_fraction <= 1):
        raise ValueError(f"wsd_lr_schedule: decay_fraction must be in (0, 1], got {decay_fraction!r}")
    if it < warmup_iters:
        return max_learning_rate * it / warmup_iters
    decay_start = max(warmup_iters, total_iters * (1 - decay_fraction))
    if it <= decay_start:
        return float(max_learning_rate)
    if it >= total_iters:
        return float(min_learning_rate)
    frac = (it - decay_start) / (total_iters - decay_start)
    return max_learning_rate + frac * (min_learning_rate - max_learning_rate)


def inverse_sqrt_lr_schedule(it: float, d_model: int, warmup_iters: float, scale: float = 1.0) -> float:
    """The learning rate of "Attention Is All You Need" at iteration ``it``:
    ``scale · d_model^-0.5 · min(it^-0.5, it · warmup_iters^-1.5)``.

    A linear warm-up to the peak ``scale · (d_model · warmup_iters)^-0.5`` at ``warmup_iters``,
    then a decay with the inverse square root of the step (0 at ``it = 0``, like the other
    schedules here). The paper uses ``scale = 1``, ``warmup_iters = 4000``; the trainer picks
    ``scale`` so that the peak is ``optim.max_lr`` (:func:`inverse_sqrt_scale`).

    >>> round(inverse_sqrt_lr_schedule(4000, 512, 4000), 6), inverse_sqrt_lr_schedule(0, 512, 4000)
    (0.000699, 0.0)
    """
    _check("inverse_sqrt_lr_schedule", it=it, d_model=d_model, warmup_iters=warmup_iters, scale=scale)
    _check_width_and_warmup("inverse_sqrt_lr_schedule", d_model, warmup_iters)
    if it <= 0:
        return 0.0
    return scale * d_model**-0.5 * min(it**-0.5, it * warmup_iters**-1.5)


def inverse_sqrt_scale(peak: float, d_model: int, warmup_iters: float) -> float:
    """The ``scale`` that makes :func:`inverse_sqrt_lr_schedule` peak at ``peak`` (at ``warmup_iters``)."""
    _check("inverse_sqrt_scale", peak=peak, d_model=d_model, warmup_iters=warmup_iters)
    _check_width_and_warmup("inverse_sqrt_scale", d_model, warmup_iters)
    return peak * math.sqrt(d_model * warmup_iters)
