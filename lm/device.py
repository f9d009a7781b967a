"""Devices and dtypes by name, checked: one line naming the option when a device is missing."""

from __future__ import annotations

import contextlib
import functools
import re
import time
from collections.abc import Callable

import torch

from lm.io import THREADS_FLOOR, check_threads, per_cpu_cap

# whole names only (``$`` would let "cpu\n" through); an index without a leading zero (compared with
# the device count as written: torch keeps an index in 8 bits, so "cuda:256" would be cuda:0)
_DEVICE = re.compile(r"auto|cpu|mps|cuda(:(0|[1-9][0-9]{0,8}))?")
DTYPES = ("auto", "float32", "bfloat16")


def cpu_flags_and_hz() -> tuple[set[str], float]:
    """The first processor's flags and clock in /proc/cpuinfo (no flags and 2.5 GHz where it says
    none; an Arm kernel lists ``Features``, not ``flags``). x86 lists a processor's ``cpu MHz`` before
    its ``flags``: the clock had been read on to the second processor's. The one reader of the file:
    :func:`cpu_has_bfloat16` and :func:`lm.train.flops.peak_flops` ask it."""
    flags, mhz = None, None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and flags is None:
                    flags = value
                elif key == "cpu MHz" and mhz is None:
                    mhz = float(value)
                if flags is not None and mhz is not None:
                    break
    except (OSError, ValueError):
        pass
    return set((flags or "").split()), (2500.0 if mhz is None else mhz) * 1e6


def cpu_has_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX): faster than float32 there,
    slower elsewhere (docs/benchmarks.md). The CPU scripts' ``--dtype auto``."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu_flags_and_hz()[0])


def _mps_available() -> bool:
    return getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()


def available_devices() -> list[str]:
    """The device names that work on this machine, e.g. ``['cpu', 'cuda:0', 'cuda:1']``."""
    names = ["cpu"]
    if torch.cuda.is_available():
        names += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        names.append("mps")
    return names


def resolve_device(name: str, argument: str = "--device", local_rank: int = 0) -> torch.device:
    """``auto`` → ``cuda:LOCAL_RANK`` when CUDA is available, else ``mps``, else ``cpu``.

    Any other name must be a device this machine has, or a ValueError names ``argument``, the
    value and what is available.
    """
    have = ", ".join(available_devices())
    unknown = f"{argument}: unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps (here: {have})"
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(unknown)
    given = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    if name.startswith("cuda"):
        index = int(name[5:]) if ":" in name else local_rank
        if torch.cuda.is_available() and ":" not in name and index >= torch.cuda.device_count():
            count = torch.cuda.device_count()  # the index is the process's local rank (torchrun)
            raise ValueError(f"{argument}: {given!r} is the local rank's GPU, cuda:{index} for LOCAL_RANK {index}, but "
                             f"this machine has {count} (available: {have}); start at most {count} "
                             f"process{'es' if count != 1 else ''} per machine (torchrun --nproc_per_node)")
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise ValueError(f"{argument}: {name!r} is not available on this machine (available: {have})")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        return device
    try:
        device = torch.device(name)
    except RuntimeError:  # a name torch parses otherwise than the pattern says: a one-line error all the same
        raise ValueError(unknown) from None
    if device.type == "mps" and not _mps_available():
        raise ValueError(f"{argument}: 'mps' is not available on this machine (available: {have})")
    return device


def resolve_dtype(name: str, device: torch.device, argument: str = "--dtype") -> torch.dtype | None:
    """The autocast dtype for a dtype name: None for float32; ``auto`` is bfloat16 on CUDA devices that support it."""
    if name not in DTYPES:
        raise ValueError(f"{argument}: must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "float32":
        return None
    if name == "bfloat16":
        return torch.bfloat16
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def slow_bfloat16_line(device: torch.device, dtype: torch.dtype | None, argument: str = "--dtype") -> str:
    """'' unless ``dtype`` is bfloat16 on a CPU that multiplies it slowly; then a line naming
    ``argument`` with how many times float32's time a bfloat16 matrix product takes here. A CPU
    without AVX512-BF16 or AMX (an AVX2 EPYC: 85-125x, docs/benchmarks.md) had run a bfloat16
    training or generation that slowly without a word. Measured (:func:`bfloat16_matmul_slowdown`),
    not guessed from the flags: where bfloat16 is within 2x of float32 (other CPUs convert it
    well) nothing is said."""
    if device.type != "cpu" or dtype != torch.bfloat16 or cpu_has_bfloat16():
        return ""
    slowdown = bfloat16_matmul_slowdown()
    if slowdown < 2:
        return ""
    return (f"{argument}: a bfloat16 matrix product takes {slowdown:.0f}x the time of a float32 one on this CPU "
            "(no bfloat16 units): float32 is faster here")


def fastest_time(run: Callable[[], object], *, times: int = 3, seconds: float = 0.0) -> float:
    """The shortest wall time (``time.perf_counter``) of ``run()`` over at least ``times`` calls, and
    more calls until ``seconds`` have been spent in them: what disturbs a timing on a busy machine (a
    thread waiting for its scheduler slice, a page fault) only ever adds time. The one timing loop of
    the hardware probes: :func:`bfloat16_matmul_slowdown` and the CPU's measured bfloat16 peak."""
    best, spent, made = float("inf"), 0.0, 0
    while made < times or spent < seconds:
        t0 = time.perf_counter()
        run()
        took = time.perf_counter() - t0
        best, spent, made = min(best, took), spent + took, made + 1
    return best


@functools.cache
def bfloat16_matmul_slowdown(size: int = 256, seconds: float = 0.1) -> float:
    """The time of a bfloat16 product of two ``size`` x ``size`` matrices over a float32 one's on
    one of this CPU's threads: for each, the fastest of the products made in ``seconds`` (at least
    three). With torch's two threads on a busy 2-core AVX2 EPYC, a float32 product of 256 (a third
    of a millisecond) often waited a scheduler's slice (16 ms) for its second thread: the best of
    three products had read anywhere from 1.6x to 92x there, and one thread reads 57-70x. About
    0.2 s where bfloat16 is slow, a tenth of that elsewhere; once a process."""
    g = torch.Generator().manual_seed(0)  # its own: the global generator is the caller's
    a, b = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g)

    def fastest(x: torch.Tensor, y: torch.Tensor) -> float:
        return max(fastest_time(lambda: x @ y, seconds=seconds), 1e-9)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a product waits for no other thread to be scheduled
    try:
        return fastest(a.bfloat16(), b.bfloat16()) / fastest(a, b)
    finally:
        torch.set_num_threads(threads)


def is_meta(device: torch.device | str | None = None) -> bool:
    """Whether tensors made for ``device`` are shapes without values: the meta device, named or, for
    None, torch's default device (which ``with torch.device("meta"):`` sets; lm.train.memory counts a
    model's parameters on one). A table a layer computes once (RoPE's angles, sinusoidal positions)
    is left empty there: arange, sin and cos on meta run torch's Python references, and the first of
    those imports torch._dynamo, 2.4 s of every ``lm train``'s start on 2 cores."""
    return torch.device(device if device is not None else torch.get_default_device()).type == "meta"


AUTOCAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_dtype(name: str, dtype: object, allowed: tuple[torch.dtype, ...] | None = None) -> None:
    """Raise a one-line ValueError naming ``name`` and the value unless ``dtype`` is None or a
    floating ``torch.dtype`` (one of ``allowed`` when given): a name such as ``"bfloat16"`` had
    failed inside torch, and ``torch.int64`` as an autocast dtype only warned."""
    if dtype is None or isinstance(dtype, torch.dtype) and dtype.is_floating_point and \
            (allowed is None or dtype in allowed):
        return
    kind = ("a torch floating dtype such as torch.bfloat16" if allowed is None
            else "one of " + ", ".join(map(str, allowed)))
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    hint = (f" (pass torch.{dtype}, not its name)" if isinstance(named, torch.dtype) and named.is_floating_point
            and (allowed is None or named in allowed) else "")
    raise ValueError(f"{name} must be {kind} or None, got {name}={dtype!r}{hint}")


def max_threads() -> int:
    """The most CPU threads :func:`set_threads` accepts: 4 per CPU, and at least 1024.

    torch takes any count and starts the threads at the first parallel op, where too many crash
    the process: on a 2-core machine with 128 GiB (torch 2.13, OpenMP) 12,000 threads ran, 16,384
    aborted in libgomp ("Thread creation failed") and 32,768 or more died with SIGSEGV; where it
    happens depends on memory and the process limits. Threads beyond the cores only slow torch
    down, so the cap is far below any such point and far above any useful count.
    """
    return per_cpu_cap(THREADS_FLOOR)


def set_threads(threads: int | None, argument: str = "--threads") -> None:
    """Use ``threads`` CPU threads for torch's intra-op work (None: torch's default)."""
    check_threads(threads, argument)
    if threads is not None:
        torch.set_num_threads(threads)


def configure_matmul_precision(device: torch.device) -> str:
    """On CUDA, let the float32 matmuls that remain outside autocast use TF32 (``torch.
    set_float32_matmul_precision("high")``, as nanoGPT does); elsewhere change nothing. Returns
    a line for the run's log ('' when nothing changed)."""
    if device.type != "cuda":
        return ""
    torch.set_float32_matmul_precision("high")
    return "float32 matmuls: TF32 (torch.set_float32_matmul_precision('high'))"


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` to ``dtype`` on ``device``'s type; a context that changes nothing when
    ``dtype`` is None (compute in the weights' own dtype)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)
