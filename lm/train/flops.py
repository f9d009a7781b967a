"""The peak FLOP/s that model FLOPs utilisation (MFU) divides by, per device."""

from __future__ import annotations

import time

import torch

# Dense bfloat16 peak FLOP/s of common accelerators, matched against torch.cuda.get_device_name().
_GPU_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40": 181e12,
    "4090": 165e12,
    "A10": 125e12,
    "L4": 121e12,
    "V100": 125e12,
    "3090": 71e12,
    "T4": 65e12,
}


def peak_flops(device: torch.device, override_tflops: float | None = None, dtype: torch.dtype | None = None) -> float:
    """The device's peak FLOP/s for MFU: the override, a table of GPUs, or a nominal CPU figure.

    The CPU figure is threads x clock x FLOPs per cycle, with the clock from /proc/cpuinfo (2.5 GHz
    when unknown): in float32, 64 with AVX-512 (two 16-lane FMA units), 32 with AVX2 + FMA, 8
    otherwise. Under bfloat16 autocast (``dtype``) matrix products run on other units: 128 a cycle
    with AVX512_BF16 (a dot product of two pairs per float32 lane), 2,048 with AMX; and since some
    chips beat their nominal figure there (this project's 2-core Zen 5 multiplies bfloat16 at
    about 2.5x its float32 nominal), the figure is at least what a bfloat16 matrix product measures
    here (a tenth of a second, once): a utilisation stays below 100%. A yardstick for comparing
    runs on one machine, not a vendor's peak.
    """
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        return 100e12
    flags, hz = _cpu_flags_and_hz()
    threads = torch.get_num_threads()
    if dtype == torch.bfloat16:
        per_cycle = 2048 if "amx_bf16" in flags else 128 if "avx512_bf16" in flags else _float32_per_cycle(flags)
        return max(threads * per_cycle * hz, _measured_bfloat16_matmul_flops())
    return threads * _float32_per_cycle(flags) * hz


def _float32_per_cycle(flags: set[str]) -> int:
    return 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8


def _cpu_flags_and_hz() -> tuple[set[str], float]:
    flags, mhz = "", 2500.0
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = value
                elif key.strip() == "cpu MHz":
                    mhz = float(value)
                if flags and key.strip() == "cpu MHz":
                    break
    except (OSError, ValueError):
        pass
    return set(flags.split()), mhz * 1e6


def _measured_bfloat16_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a bfloat16 n x n matrix product on this CPU with torch's threads: the best of a few."""
    g = torch.Generator().manual_seed(0)  # its own: the global generator is the run's (a resume restores it)
    a = torch.randn(n, n, dtype=torch.bfloat16, generator=g)
    b = torch.randn(n, n, dtype=torch.bfloat16, generator=g)
    a @ b  # the first call sets up the kernel
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
