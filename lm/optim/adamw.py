"""AdamW (Loshchilov & Hutter, 2019): Adam with weight decay decoupled from the gradient."""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lm.checks import as_real, check_flag, check_non_negative

_FUSED_DEVICES = ("cpu", "cuda")  # where torch has a fused AdamW kernel


def _plain_until_dynamo(name: str) -> Callable:
    """``torch.optim.Optimizer``'s method ``name`` without its ``torch._disable_dynamo`` wrapper while
    torch._dynamo is not imported, and with it once it is. The wrapper only keeps dynamo from tracing
    the method, and dynamo traces nothing before it is imported; but the wrapper's first call imports
    it, 2.4 s (2 cores) of every ``lm train``'s start, compiled or not. A method torch does not wrap
    that way (another version) is torch's as it is."""
    method = getattr(torch.optim.Optimizer, name)
    if getattr(method.__code__, "co_qualname", "") != "_disable_dynamo.<locals>.inner" or \
            not hasattr(method, "__wrapped__"):
        return method
    plain = method.__wrapped__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        return (method if "torch._dynamo" in sys.modules else plain)(self, *args, **kwargs)

    return call


_add_param_group = _plain_until_dynamo("add_param_group")


class AdamW(torch.optim.Optimizer):
    """Adam with bias correction and decoupled weight decay; hyper-parameters may differ per group.

    For each parameter ``θ`` with gradient ``g`` at step ``t`` (counted from 1)::

        m ← β1·m + (1 − β1)·g
        v ← β2·v + (1 − β2)·g²
        θ ← θ − lr·wd·θ                                  (decay, not scaled by the moments)
        θ ← θ − lr·√(1 − β2ᵗ)/(1 − β1ᵗ) · m / (√v + ε')   with ε' = ε·√(1 − β2ᵗ)

    which is ``θ − lr · m̂ / (√v̂ + ε)`` with ``m̂, v̂`` the bias-corrected moments, the same update as
    ``torch.optim.AdamW``.

    ``fused`` (the default, ``None``, on CPU and CUDA parameters) runs the update of a group as
    torch's fused AdamW kernel: one pass over the memory and one launch per group and device (the
    step counts then live on the parameters' device, as in ``torch.optim.AdamW(fused=True)``).
    Otherwise it is a handful of ``torch._foreach_*`` kernels over all the group's parameters,
    with the step counts mirrored on the host (no read of a tensor per step): seven passes over
    the memory, so on a CPU several times slower than the fused kernel.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        fused: bool | None = None,
    ):
        check_flag("fused", fused, none_ok=True)  # a string is truthy: fused="no" had fused
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        _check_hyperparameters(defaults, "")
        super().__init__(params, {**defaults, "betas": tuple(betas)})
        # id(param) -> (its step tensor, the count it holds): valid while that tensor is the state's
        # (a load_state_dict or a copy brings new step tensors, whose counts are read once)
        self._counts: dict[int, tuple[torch.Tensor, float]] = {}
        self.fused = fused

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, with the group's own hyper-parameters checked as the defaults are: a group with
        ``lr=-1`` had climbed the gradient, and one with a NaN weight decay made every weight NaN."""
        if isinstance(param_group, dict):  # (torch's own check says what else is wrong)
            _check_hyperparameters({**self.defaults, **param_group}, f"param_groups[{len(self.param_groups)}]: ")
        _add_param_group(self, param_group)
        self.param_groups[-1]["betas"] = tuple(self.param_groups[-1]["betas"])

    zero_grad = _plain_until_dynamo("zero_grad")
    state_dict = _plain_until_dynamo("state_dict")
    load_state_dict = _plain_until_dynamo("load_state_dict")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _fuses(self, p: torch.Tensor) -> bool:
        return self.fused if self.fused is not None else p.device.type in _FUSED_DEVICES

    def _step_group(self, group: dict[str, Any]) -> None:
        """One update of every parameter of ``group`` with a gradient: torch's fused kernel for the
        parameters it fuses (per device and dtype), a few ``torch._foreach_*`` kernels for the others."""
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        by_step: dict[float, tuple[list, list, list, list]] = {}
        fused: dict[tuple, tuple[list, list, list, list, list]] = {}  # by device and dtype
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state, fuses = self.state[p], self._fuses(p)
            if not state:
                _moments(state, p)
                if not fuses:
                    self._counts[id(p)] = (state["step"], 0.0)
            if fuses:
                if state["step"].device != p.device:  # a new state, or one loaded onto the CPU
                    state["step"] = state["step"].to(p.device, torch.float32)
                lists = fused.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for lst, tensor in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                    lst.append(tensor)
                continue
            # The count is kept in the tensor (state_dicts) and mirrored on the host, so reading it
            # never reads a tensor back (read once after a load_state_dict, never for new state).
            mirror = self._counts.get(id(p))
            t = (state["step"].item() if mirror is None or mirror[0] is not state["step"] else mirror[1]) + 1
            state["step"] += 1
            self._counts[id(p)] = (state["step"], t)
            lists = by_step.setdefault(t, ([], [], [], []))  # one count, normally
            for lst, tensor in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                lst.append(tensor)
        for params, grads, m, v, steps in fused.values():
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(params, grads, m, v, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd,
                                eps=eps, amsgrad=False, maximize=False)  # fmt: skip
        for t, (params, grads, m, v) in by_step.items():
            torch._foreach_lerp_(m, grads, 1 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - beta2)
            if wd != 0:
                torch._foreach_mul_(params, 1 - lr * wd)
            bias1 = 1 - beta1**t
            bias2_sqrt = math.sqrt(1 - beta2**t)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(params, m, denom, value=-lr / bias1)


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    """``lr``, ``eps``, ``weight_decay``: finite numbers >= 0 (`not x >= 0`, as torch.optim.AdamW: NaN
    fails every comparison, and would make every parameter NaN); ``betas``: two numbers in [0, 1)."""
    for name in ("lr", "eps", "weight_decay"):  # numbers, or one-element tensors (torch's AdamW takes a tensor lr)
        check_non_negative(name, group[name], where)
    betas = group["betas"]
    try:
        pair = tuple(betas)
    except TypeError:
        pair = ()
    if len(pair) != 2 or not all((b := as_real(beta)) is not None and 0.0 <= b < 1.0 for beta in pair):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got betas={betas!r}")


def _moments(state: dict, p: torch.Tensor) -> None:
    # The step count lives in a tensor on the CPU, as in torch.optim (state_dicts interchange, and
    # reading it never waits for the device).
    state["step"] = torch.tensor(0.0)
    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def param_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = False) -> list[dict[str, Any]]:
    """Split ``model``'s trainable parameters into a decayed group and a no-decay group.

    Weight decay pulls a weight towards zero, which is a prior that suits the matrices of linear
    layers. Norm gains (initialised at 1), biases and embedding tables are left alone: decaying
    a gain shrinks the activations, and decaying embeddings penalises rare tokens that receive
    few gradients. Matrices are told apart by dimension (≥ 2) and embeddings by module type or by
    the name of the parameter (``...embed...``), so it works for any module tree.
    ``decay_embeddings=True`` decays the embedding tables too, as nanoGPT does: on a small
    corpus read for many epochs that is a useful regulariser.
    """
    check_non_negative("weight_decay", weight_decay)  # NaN had made every weight NaN at the first step
    no_decay_ids = set()
    for module in model.modules():
        is_embedding = isinstance(module, nn.Embedding) or "embedding" in type(module).__name__.lower()
        for p in module.parameters(recurse=False):
            if is_embedding:
                no_decay_ids.add(id(p))
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or (not decay_embeddings and (id(p) in no_decay_ids or "embed" in name.lower())):
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]
