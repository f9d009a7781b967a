"""The peak FLOP/s that model FLOPs utilisation (MFU) divides by, per device."""

from __future__ import annotations

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


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float:
    """The device's peak FLOP/s for MFU: the override, a table of GPUs, or a nominal CPU figure.

    The CPU figure is threads x clock x float32 FLOPs per cycle: 64 with AVX-512 (two 16-lane
    FMA units), 32 with AVX2 + FMA, 8 otherwise, with the clock from /proc/cpuinfo (2.5 GHz
    when unknown). It is a yardstick for comparing runs on one machine, not a measured peak.
    """
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _GPU_PEAK_FLOPS.items():
            if key in name:
                return flops
        return 100e12
    return torch.get_num_threads() * _cpu_flops_per_cycle_and_hz()


def _cpu_flops_per_cycle_and_hz() -> float:
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
    words = set(flags.split())
    per_cycle = 64 if "avx512f" in words else 32 if {"avx2", "fma"} <= words else 8
    return per_cycle * mhz * 1e6
