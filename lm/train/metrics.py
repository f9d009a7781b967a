"""Where training reports go: the console, ``RUN_DIR/metrics.jsonl`` and (optionally) Weights & Biases."""

from __future__ import annotations

import json
import math
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from lm.io import atomic_write

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


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors records to wandb when enabled."""

    def __init__(self, run_dir: Path, wandb_cfg: Any = None, config: dict | None = None, resume: bool = False):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed in close())
        self._wandb = None
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            import wandb

            id_file = Path(run_dir) / "wandb_id.txt"
            run_id = id_file.read_text().strip() if resume and id_file.exists() else uuid.uuid4().hex[:8]
            with atomic_write(id_file) as f:
                f.write(run_id + "\n")
            self._wandb = wandb.init(
                project=wandb_cfg.project,
                name=wandb_cfg.name or Path(run_dir).name,
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
                id=run_id,
                resume="allow",
            )

    @staticmethod
    def truncate(run_dir: Path, after_step: int) -> None:
        """Drop records past ``after_step``: a resumed run repeats those steps and logs them again."""
        path = Path(run_dir) / "metrics.jsonl"
        if not path.exists():
            return
        keep = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line).get("step", 0) <= after_step:
                    keep.append(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
        with atomic_write(path) as f:
            f.write("".join(line + "\n" for line in keep))

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            split = record.get("split", "train")
            values = {f"{split}/{k}": v for k, v in record.items() if k not in ("step", "split") and v is not None}
            self._wandb.log(values, step=record["step"])

    def close(self) -> None:
        self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` (lines cut short by a kill are skipped)."""
    out = []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl; is it a run directory of `lm train`?")
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
