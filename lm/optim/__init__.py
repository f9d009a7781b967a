"""Optimisation: AdamW, its parameter groups, the learning-rate schedules and gradient clipping."""

from lm.optim.adamw import AdamW, param_groups
from lm.optim.clip import clip_grad_norm_
from lm.optim.schedule import cosine_lr_schedule, inverse_sqrt_lr_schedule, inverse_sqrt_scale, wsd_lr_schedule

__all__ = [
    "AdamW",
    "clip_grad_norm_",
    "cosine_lr_schedule",
    "inverse_sqrt_lr_schedule",
    "inverse_sqrt_scale",
    "param_groups",
    "wsd_lr_schedule",
]
