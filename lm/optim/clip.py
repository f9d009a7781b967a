"""Gradient clipping by the global L2 norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_l2_norm: float, eps: float = 1e-6, *, return_tensor: bool = False
) -> float | torch.Tensor:
    """Scale all gradients in place so that their joint L2 norm is at most ``max_l2_norm``.

    The norm is taken over every gradient together, as if they were one vector; parameters
    without a gradient are skipped. Returns the norm before clipping. Every gradient is multiplied
    by ``min(1, max_l2_norm / (norm + eps))``, as ``torch.nn.utils.clip_grad_norm_`` does.

    The work stays on the gradients' device (a ``torch._foreach_norm``, a norm of the norms, a
    ``torch._foreach_mul_``): with ``return_tensor=True`` the norm comes back as a 0-d tensor and
    the host never waits for the device; the float (the default) reads it back.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(()) if return_tensor else 0.0
    # in float32 whatever the gradient dtype
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)))
    scale = (max_l2_norm / (norm + eps)).clamp(max=1.0)
    torch._foreach_mul_(grads, scale.to(grads[0].dtype))
    return norm if return_tensor else float(norm)
