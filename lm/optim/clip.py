"""Gradient clipping by the global L2 norm."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lm.checks import check_non_negative, check_positive


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_l2_norm: float,
    eps: float = 1e-6,
    *,
    return_tensor: bool = False,
) -> float | torch.Tensor:
    """Scale all gradients in place so that their joint L2 norm is at most ``max_l2_norm``.

    ``parameters`` is an iterable of tensors or a single tensor. The norm is taken over every
    gradient together, as if they were one vector; parameters without a gradient are skipped.
    Returns the norm before clipping (``max_l2_norm`` a finite number > 0, ``eps`` one >= 0).
    Every gradient is multiplied by the float32
    ``min(1, max_l2_norm / (norm + eps))``, as ``torch.nn.utils.clip_grad_norm_`` does (a
    bfloat16 gradient by the unrounded scale, in float32, and rounded once); where any gradient
    is float64, the norm and the scale are float64.

    The work stays on the gradients' device (a ``torch._foreach_norm``, a norm of the norms, a
    ``torch._foreach_mul_``): with ``return_tensor=True`` the norm comes back as a 0-d tensor and
    the host never waits for the device; the float (the default) reads it back.
    """
    # a negative limit had reversed every gradient, NaN made them NaN (the config's 0 is "no clipping":
    # the trainer then does not call this)
    check_positive("max_l2_norm", max_l2_norm)
    check_non_negative("eps", eps)
    if isinstance(parameters, torch.Tensor):  # one tensor, not its rows
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(()) if return_tensor else 0.0
    # in float32 whatever the gradient dtype, or float64 when a gradient is float64 (a float64 model:
    # asked for float32, its norm had raised "should be convertible without narrowing")
    wide = any(g.dtype == torch.float64 for g in grads)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64 if wide
                                                                    else torch.float32)))
    scale = (max_l2_norm / (norm + eps)).clamp(max=1.0)
    # The float32 scale as it is (torch's too): rounded to a bfloat16 gradient's dtype it would
    # scale that gradient differently, and rounded to the first gradient's it would scale all the
    # others so. On CUDA a list of float32 gradients takes the one-kernel route; others, one each.
    torch._foreach_mul_(grads, scale)
    return norm if return_tensor else float(norm)
