"""Process-group setup for ``torchrun``: one process per device, gloo on CPU, nccl on CUDA."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lm.device import resolve_device


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over ranks (``value`` itself when there is one process)."""
        if not self.enabled:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value / self.world_size

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of ``value`` over ranks (``value`` itself when there is one process)."""
        if not self.enabled:
            return value
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def agree(self, flag: bool, seconds: float, device: torch.device) -> tuple[bool, float]:
        """One all-reduce for the decisions every rank must take together: whether ``flag`` is
        true on some rank (a signal arrived), and the largest of the ranks' ``seconds`` (the
        slowest rank's clock since the last agreement). The values themselves with one process."""
        if not self.enabled:
            return flag, seconds
        t = torch.tensor([1.0 if flag else 0.0, seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        raised, slowest = t.tolist()
        return raised > 0, slowest


def init_distributed(device_name: str) -> tuple[Dist, torch.device]:
    """Join the process group ``torchrun`` describes in the environment (if any); pick the device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return Dist(), resolve_device(device_name, "train.device")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, "train.device", local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, local_rank, world_size), device


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
