"""The peak FLOP/s that model FLOPs utilisation (MFU) divides by, per device."""

from __future__ import annotations

import functools
import operator

import torch

from lm.device import cpu_flags_and_hz, fastest_time

# NVIDIA's dense (no sparsity) tensor-core peaks in TFLOP/s, (bfloat16, float32), matched against
# torch.cuda.get_device_name() by the first pattern found in it: the more specific names first ("H100
# PCIe" before "H100", "L40S" before "L40", "A100" before "A10"). The float32 figure is TF32's, which a
# float32 run uses on CUDA (lm.device.configure_matmul_precision), or plain FP32's where there are no
# TF32 tensor cores; None: no such units (bfloat16 on a V100 or a T4 runs on no tensor core). From the
# vendors' datasheets; a GPU not listed has no peak: MFU is left out (null) unless log.peak_tflops says it.
GPU_PEAK_TFLOPS: tuple[tuple[str, float | None, float | None], ...] = (
    ("H200 NVL", 835.0, 417.5),
    ("H100 NVL", 835.0, 417.5),
    ("H100 PCIe", 756.0, 378.0),
    ("GH200", 989.4, 494.7),
    ("H200", 989.4, 494.7),
    ("H100", 989.4, 494.7),  # SXM
    ("H800", 989.4, 494.7),
    ("B200", 2250.0, 1100.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.05, 183.0),
    ("L40", 181.05, 90.5),
    ("A10G", None, None),  # AWS's A10 variant has no public datasheet: before "A10", whose figures it has not
    ("A10", 125.0, 62.5),
    ("L4", 121.0, 60.0),
    ("RTX 4090", 165.2, 82.6),
    ("RTX 3090", 71.0, 35.6),
    ("V100", None, 15.7),
    ("T4", None, 8.1),
)


def gpu_peak_flops(name: str, dtype: torch.dtype | None) -> float | None:
    """The peak FLOP/s of the GPU called ``name`` for matrix products in ``dtype`` (bfloat16, else
    float32 through TF32) from :data:`GPU_PEAK_TFLOPS`; None for a GPU the table does not know.

    >>> gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) / 1e12, gpu_peak_flops("NVIDIA L40S", None) / 1e12
    (756.0, 183.0)
    >>> gpu_peak_flops("NVIDIA A10", torch.bfloat16) / 1e12, gpu_peak_flops("NVIDIA B300", torch.bfloat16)
    (125.0, None)
    """
    for pattern, bf16, fp32 in GPU_PEAK_TFLOPS:
        if pattern in name:
            peak = bf16 if dtype == torch.bfloat16 else fp32
            return None if peak is None else peak * 1e12
    return None


def peak_flops(device: torch.device, override_tflops: float | None = None,
               dtype: torch.dtype | None = None) -> float | None:
    """The device's peak FLOP/s for MFU: the override, a table of GPUs (:func:`gpu_peak_flops`; None
    for a GPU it does not know, whose MFU is then left out), or a nominal CPU figure.

    The CPU figure is threads x clock x FLOPs per cycle, with the clock from /proc/cpuinfo (2.5 GHz
    when unknown): in float32, 64 with AVX-512 (two 16-lane FMA units), 32 with AVX2 + FMA, 8
    otherwise. Under bfloat16 autocast (``dtype``) matrix products run on other units: 128 a cycle
    with AVX512_BF16 (a dot product of two pairs per float32 lane), 2,048 with AMX; and since some
    chips beat their nominal figure there (this project's 2-core Zen 5 multiplies bfloat16 at
    about 2.5x its float32 nominal), the figure is at least what a bfloat16 matrix product measures
    here (a tenth of a second, once; a fifth on a CPU without bfloat16 units, where the matrices
    stay smaller): a utilisation stays below 100%. A yardstick for comparing
    runs on one machine, not a vendor's peak.
    """
    if override_tflops:
        return override_tflops * 1e12
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype)
    if device.type != "cpu":  # an MPS GPU: no figure
        return None
    flags, hz = cpu_flags_and_hz()
    threads = torch.get_num_threads()
    if dtype == torch.bfloat16:
        per_cycle = 2048 if "amx_bf16" in flags else 128 if "avx512_bf16" in flags else _float32_per_cycle(flags)
        return max(threads * per_cycle * hz, _measured_bfloat16_matmul_flops())
    return threads * _float32_per_cycle(flags) * hz


def peak_line(device: torch.device, peak: float | None, dtype: torch.dtype | None, given: bool) -> str:
    """The run's line saying which peak its MFU divides by, on a GPU (the CPU's figure is a yardstick
    of its own, see :func:`peak_flops`), or that it has none: "" on a CPU or when ``log.peak_tflops``
    (``given``) set it."""
    if device.type == "cpu" or given:
        return ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    kind = "bfloat16" if dtype == torch.bfloat16 else "float32"
    if peak is None:
        return f"MFU: no {kind} peak known for {name!r}; set log.peak_tflops to its dense peak to log MFU"
    return f"MFU against {name}'s dense {kind} peak of {peak / 1e12:,.1f} TFLOP/s (log.peak_tflops to change it)"


def _float32_per_cycle(flags: set[str]) -> int:
    return 64 if "avx512f" in flags else 32 if {"avx2", "fma"} <= flags else 8


def _measured_bfloat16_matmul_flops(n: int = 1024, repeats: int = 5, slow: float = 0.02) -> float:
    """FLOP/s of a bfloat16 matrix product on this CPU with torch's threads: the best of ``repeats``
    products of two n x n matrices. The size starts at 128 and doubles up to n only while a product
    takes under ``slow`` seconds: a CPU without bfloat16 units (AVX2 only) multiplies a 1024 x 1024
    pair in seconds, and had spent 17 s here before a run's first step; where bfloat16 is fast the
    measurement is n's, as before."""
    g = torch.Generator().manual_seed(0)  # its own: the global generator is the run's (a resume restores it)
    size = min(128, n)
    while True:
        a = torch.randn(size, size, dtype=torch.bfloat16, generator=g)
        b = torch.randn(size, size, dtype=torch.bfloat16, generator=g)
        a @ b  # the first call sets up the kernel
        best = fastest_time(functools.partial(operator.matmul, a, b), times=repeats)
        if size >= n or best >= slow:
            return 2 * size**3 / best
        size = min(2 * size, n)
