"""Gradient clipping by the global L2 norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_l2_norm: float, eps: float = 1e-6) -> float:
    """Scale all gradients in place so that their joint L2 norm is at most ``max_l2_norm``.

    The norm is taken over every gradient together, as if they were one vector; parameters
    without a gradient are skipped. Returns the norm before clipping. When it exceeds the limit
    every gradient is multiplied by ``max_l2_norm / (norm + eps)``.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # Accumulate in float32 whatever the gradient dtype, on the gradients' device (no host sync
    # until the final .item()).
    norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.detach(), dtype=torch.float32) for g in grads])
    )
    total = norm.item()
    if total > max_l2_norm:
        scale = max_l2_norm / (total + eps)
        torch._foreach_mul_(grads, scale)
    return total
