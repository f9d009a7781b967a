"""Evaluate a language model on a whole token sequence: loss, perplexity and bits per byte.

The sequence is cut into consecutive windows of ``context_length`` inputs, so every token
but the first is predicted exactly once, with as much left context as its window gives.
Bits per byte divide the loss (nats per token) by ``ln 2`` and by the bytes per token of
the source text, which makes tokenizers of different vocabularies comparable.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch
from tqdm.auto import tqdm


@torch.no_grad()
def evaluate_tokens(
    model: torch.nn.Module,
    tokens: np.ndarray,
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
    bytes_per_token: float | None = None,
    progress: bool = False,
) -> dict[str, float | int | None]:
    """Mean next-token loss of ``model`` over ``tokens`` (a 1-D id array, a memmap is fine)."""
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    ctx = model.config.context_length
    n = len(tokens) if max_tokens is None else min(len(tokens), max_tokens + 1)
    if n < 2:
        raise ValueError(f"data: needs at least 2 tokens to predict one, got {n}")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    starts = list(range(0, n - 1, ctx))
    total, count = 0.0, 0
    bar = tqdm(total=n - 1, unit="tok", unit_scale=True, desc="eval", disable=not progress, file=sys.stderr)
    try:
        full = [s for s in starts if s + ctx + 1 <= n]
        tail = [s for s in starts if s + ctx + 1 > n]
        for i in range(0, len(full), batch_size):
            rows = np.stack([np.asarray(tokens[s : s + ctx + 1], dtype=np.int64) for s in full[i : i + batch_size]])
            total, count = _add(model, rows, device, total, count)
            bar.update(rows.shape[0] * ctx)
        for s in tail:  # the last, shorter window
            rows = np.asarray(tokens[s:n], dtype=np.int64)[None]
            total, count = _add(model, rows, device, total, count)
            bar.update(rows.shape[1] - 1)
    finally:
        bar.close()
        model.train(was_training)
    loss = total / count
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": loss / math.log(2) / bytes_per_token if bytes_per_token else None,
        "bytes_per_token": bytes_per_token,
        "tokens": count,
    }


def _add(model, rows: np.ndarray, device, total: float, count: int) -> tuple[float, int]:
    xy = torch.from_numpy(rows).to(device)
    x, y = xy[:, :-1], xy[:, 1:]
    loss = model.loss(x, y) if hasattr(model, "loss") else _ce(model(x), y)
    k = y.numel()
    return total + float(loss) * k, count + k


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from lm.nn import cross_entropy

    return cross_entropy(logits.float(), targets)
