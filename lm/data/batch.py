"""Random language-modelling batches cut from a flat token array."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from jaxtyping import Int
from torch import Tensor

from lm.checks import check_size


@dataclass
class LMBatch:
    """A language-modelling batch: ``ids`` and the next-token ``targets`` (both ``(batch, seq)``).

    Batches are objects the model knows how to take the loss of (``model(batch=b)``), so the
    trainer's loop is the same for this and for :class:`lm.data.pairs.PairBatch`.
    """

    ids: Int[Tensor, "batch seq"]
    targets: Int[Tensor, "batch seq"]

    @property
    def num_tokens(self) -> int:
        return self.targets.numel()


def _check_tokens(dataset, name: str = "dataset") -> None:
    """A 1-D array of integer ids (NumPy's or torch's): a float array had been truncated into "ids"."""
    ndim = dataset.ndim if hasattr(dataset, "ndim") else np.ndim(dataset)
    if ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of token ids, got {ndim} dimensions")
    if len(dataset) == 0:  # no ids, of no type (an empty list is a float64 array): the caller's "too short"
        return
    dtype = dataset.dtype if hasattr(dataset, "dtype") else np.asarray(dataset).dtype
    integer = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
               if isinstance(dtype, torch.dtype) else np.issubdtype(dtype, np.integer))
    if not integer:
        raise ValueError(f"{name}: token ids must be integers, got dtype {dtype}")


def check_numpy_generator(generator: object) -> None:
    """``generator`` is None or a ``numpy.random.Generator`` (``np.random.default_rng(seed)``): a
    ``torch.Generator`` had failed with "no attribute 'integers'"."""
    if generator is not None and not isinstance(generator, np.random.Generator):
        raise ValueError(f"generator must be a NumPy Generator (np.random.default_rng(seed)) or None, "
                         f"got generator={generator!r}")


def random_starts(
    num_tokens: int, batch_size: int, context_length: int, generator: np.random.Generator | None = None
) -> np.ndarray:
    """``batch_size`` uniform start positions such that ``context_length + 1`` ids fit after each."""
    check_size("batch_size", batch_size)
    check_size("context_length", context_length)
    check_numpy_generator(generator)
    if num_tokens <= context_length:
        raise ValueError(f"the token array has {num_tokens} ids; it needs more than context_length={context_length}")
    high = num_tokens - context_length  # exclusive: the last start still has its target
    if generator is None:
        return np.random.randint(0, high, size=batch_size)
    return generator.integers(0, high, size=batch_size)


def batch_at(
    dataset: np.ndarray, starts: np.ndarray, context_length: int, device: str | torch.device
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Inputs and next-token targets for windows beginning at ``starts``."""
    _check_tokens(dataset)
    check_size("context_length", context_length)
    starts = np.asarray(starts)
    if starts.ndim != 1 or len(starts) == 0:
        raise ValueError(f"starts must be a non-empty 1-D array of positions, got shape {starts.shape}")
    starts = check_starts(starts, len(dataset), context_length)
    # One contiguous slice per row reads just the pages a window covers from a memmap.
    rows = np.stack([np.asarray(dataset[s : s + context_length + 1]) for s in starts])
    return windows_to_xy(rows, device)


def check_starts(starts, num_tokens: int, context_length: int) -> np.ndarray:
    """``starts`` as a 1-D integer array whose windows of ``context_length + 1`` ids fit in
    ``num_tokens``: a float start had been truncated (1.5 read from 1), and one past the end read short."""
    starts = np.asarray(starts)
    if starts.ndim != 1:
        raise ValueError(f"starts must be a 1-D array of positions, got shape {starts.shape}")
    if starts.size == 0:
        return starts.astype(np.int64)
    if not np.issubdtype(starts.dtype, np.integer):
        raise ValueError(f"starts must be integers, got dtype {starts.dtype}")
    high = num_tokens - context_length - 1  # the last start whose window and target fit
    lo, hi = starts.min(), starts.max()
    if lo < 0 or hi > high:
        raise ValueError(f"starts must be in [0, {high}] for windows of context_length={context_length} "
                         f"in {num_tokens} ids, got start {lo if lo < 0 else hi}")
    return starts


def windows_to_xy(
    rows: np.ndarray, device: str | torch.device
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """``(batch, context_length + 1)`` ids -> ``int64`` inputs ``x = rows[:, :-1]`` and targets ``y = rows[:, 1:]``."""
    xy = torch.from_numpy(rows.astype(np.int64))
    device = torch.device(device)
    if device.type == "cuda":
        xy = xy.pin_memory().to(device, non_blocking=True)
    else:
        xy = xy.to(device)
    return xy[:, :-1], xy[:, 1:]


def get_batch(
    dataset: np.ndarray,
    batch_size: int,
    context_length: int,
    device: str | torch.device,
    generator: np.random.Generator | None = None,
) -> tuple[Int[Tensor, "batch seq"], Int[Tensor, "batch seq"]]:
    """Sample ``batch_size`` windows of ``context_length`` ids at uniform random starts.

    Returns ``int64`` tensors ``x`` and ``y`` of shape ``(batch_size, context_length)`` on
    ``device`` with ``y[i, t] == x[i, t + 1]`` (``y`` is the next token). ``dataset`` is any 1-D
    integer array; a ``np.memmap`` is the normal case. Starts come from ``generator`` when given,
    else from numpy's global random state.

    Every window read through a memmap faults its pages into this process, and recent Linux
    kernels map a whole large page-cache folio (up to 2 MB) per fault, so resident memory grows
    towards the file size over a long run. :class:`lm.data.TokenDataset` reads windows with
    ``preadv`` instead and stays flat.

    >>> x, y = get_batch(np.arange(100), 4, 8, "cpu")
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    (torch.Size([4, 8]), True)
    """
    _check_tokens(dataset)  # before len(dataset), which counts a 2-D array's rows
    starts = random_starts(len(dataset), batch_size, context_length, generator)
    return batch_at(dataset, starts, context_length, device)
