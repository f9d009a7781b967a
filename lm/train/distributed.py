"""Process-group setup for ``torchrun``: one process per device, gloo on CPU, nccl on CUDA."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

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

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (picklable) in rank order on rank 0, None on the others; ``[value]``
        with one process. Each rank must call it at the same point."""
        if not self.enabled:
            return [value]
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, out, dst=0)  # nccl: through the device that resolve_device made current
        return out

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` (picklable) on every rank; ``value`` itself with one process, or where
        no process group was started (a Dist made by hand). Each rank must call it at the same point."""
        if not self.enabled or not dist.is_initialized():
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)  # nccl: through the device that resolve_device made current
        return box[0]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def agree(self, signal: int, seconds: float, device: torch.device) -> tuple[int, float]:
        """One all-reduce for the decisions every rank must take together: the signal that arrived
        on some rank (its number, the largest if several did; 0: none), and the largest of the
        ranks' ``seconds`` (the slowest rank's clock since the last agreement). The values
        themselves with one process."""
        if not self.enabled:
            return signal, seconds
        t = torch.tensor([float(signal), seconds], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        raised, slowest = t.tolist()
        return int(raised), slowest


_TORCHRUN = "start the processes with torchrun (which sets WORLD_SIZE, RANK and LOCAL_RANK), or unset WORLD_SIZE"


def _whole(name: str, lowest: int, default: str | None = None) -> int:
    """The environment variable ``name`` as a whole number >= ``lowest``, or a one-line ValueError naming it."""
    raw = os.environ.get(name, default)
    if raw is None:
        raise ValueError(f"{name}: not set, but WORLD_SIZE is {os.environ['WORLD_SIZE']!r}; {_TORCHRUN}")
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < lowest:
        raise ValueError(f"{name}: {raw!r} is not a whole number >= {lowest}; {_TORCHRUN}")
    return value


def torchrun_env() -> Dist:
    """This process's place in the run that ``torchrun`` describes in WORLD_SIZE, RANK and
    LOCAL_RANK (one process when WORLD_SIZE is not set), checked: a missing or garbled variable,
    or a RANK outside the world (which waited for its peers until the rendezvous timed out), is a
    one-line ValueError naming the variable."""
    if "WORLD_SIZE" not in os.environ:
        return Dist()
    world_size = _whole("WORLD_SIZE", 1)
    if world_size == 1:
        return Dist()
    rank, local_rank = _whole("RANK", 0), _whole("LOCAL_RANK", 0, default="0")
    if rank >= world_size:
        raise ValueError(f"RANK: {os.environ['RANK']!r} is not below WORLD_SIZE {world_size} (ranks are 0 to "
                         f"{world_size - 1}); {_TORCHRUN}")
    return Dist(rank, local_rank, world_size)


def init_distributed(device_name: str, timeout: float | None = None) -> tuple[Dist, torch.device]:
    """Join the process group ``torchrun`` describes in the environment (if any); pick the device.
    ``timeout``: seconds a collective waits for the other processes (``train.dist_timeout``), or torch's default."""
    env = torchrun_env()
    if not env.enabled:
        return env, resolve_device(device_name, "train.device")
    rank, local_rank, world_size = env.rank, env.local_rank, env.world_size
    device = resolve_device(device_name, "train.device", local_rank)
    if not dist.is_initialized():
        wait = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", **wait)
    return Dist(rank, local_rank, world_size), device


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
