"""Loss curves of one or more runs: train and validation loss against steps and wall-clock time."""

from __future__ import annotations

import os
from pathlib import Path

from lm.train.metrics import read_metrics


def plot_runs(run_dirs: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write a PNG with two panels (loss vs step, loss vs training time) overlaying every run.

    Train loss is a solid line and validation loss a dashed line with markers, in one colour per run.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from lm.io import atomic_write

    runs = [(Path(d), read_metrics(d)) for d in run_dirs]
    longest = max((r.get("time", 0) for _, records in runs for r in records), default=0)
    unit, scale = ("minutes", 60) if longest > 120 else ("seconds", 1)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (run_dir, records) in enumerate(runs):
        color = f"C{i % 10}"
        for split, style in (("train", dict(linestyle="-")), ("val", dict(linestyle="--", marker="o", ms=3))):
            rows = [r for r in records if r.get("split") == split and r.get("loss") is not None]
            if not rows:
                continue
            label = f"{run_dir.name} {split}"
            by_step.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=label, **style)
            by_time.plot(
                [r["time"] / scale for r in rows], [r["loss"] for r in rows], color=color, label=label, **style
            )
    by_step.set_xlabel("step")
    by_time.set_xlabel(f"training time ({unit})")
    for ax in (by_step, by_time):
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    with atomic_write(out, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return out
