"""Loss curves of one or more runs: train and validation loss against steps and training time."""

from __future__ import annotations

import math
import os
from pathlib import Path

from lm.io import check_not_input, text_name
from lm.train.metrics import read_metrics

# The PNG text chunk that marks a plot of plot_runs, so that `lm plot --overwrite` replaces its own
# plots and no other PNG (a user's figure or screenshot given as --out).
PLOT_MARK = ("Software", "lm plot")


def _number(value) -> bool:
    """A finite number a plot can place: an integer past a float's range (a step of 10**400 in a
    hand-edited metrics.jsonl) was an OverflowError traceback."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def loss_records(run_dir: str | os.PathLike) -> dict[str, list[dict]]:
    """The train and validation loss records of a run: JSON objects with a ``split`` of train or
    val and a number as ``step`` and ``loss`` (``time`` is optional). Other lines are not drawn."""
    rows: dict[str, list[dict]] = {"train": [], "val": []}
    for r in read_metrics(run_dir):
        if isinstance(r, dict) and r.get("split") in rows and _number(r.get("loss")) and _number(r.get("step")):
            rows[r["split"]].append(r)
    return rows


def train_label_smoothing(run_dir: str | os.PathLike) -> float:
    """The label smoothing in a run's train loss records, from its ``config.toml`` (0 when there is none).

    An encoder–decoder logs its training loss with the label smoothing it trains with
    (``model.label_smoothing``, 0.1 by default) and its validation loss without: the two are
    different quantities, and a plot that draws them on one axis must say so."""
    from lm.tomlio import loads  # tomllib, or tomli on Python 3.10

    try:
        model = loads((Path(run_dir) / "config.toml").read_bytes().decode("utf-8")).get("model", {})
    except (OSError, ValueError):  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        return 0.0
    if not isinstance(model, dict) or model.get("architecture") != "encoder_decoder":
        return 0.0
    from lm.model.seq2seq import Seq2SeqConfig

    eps = model.get("label_smoothing", Seq2SeqConfig.label_smoothing)
    return float(eps) if _number(eps) else 0.0


def is_marked_plot(path: str | os.PathLike) -> bool:
    """The file is a PNG whose metadata carries :data:`PLOT_MARK`: a plot that :func:`plot_runs` wrote.

    Reads the text chunks before the image data (where matplotlib writes them), not the pixels.
    Plots written before the mark existed carry matplotlib's own ``Software`` tag and are not
    recognised: every figure a user saves with matplotlib carries it too, and a plot is redrawn in
    seconds once the old file is removed by hand, while a user's figure would be lost.
    """
    from PIL import Image, UnidentifiedImageError  # matplotlib's own dependency

    try:
        with Image.open(path) as image:  # reads the chunks before the image data, not the pixels
            return image.format == "PNG" and image.info.get(PLOT_MARK[0]) == PLOT_MARK[1]
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
        return False


def run_labels(run_dirs: list[str | os.PathLike]) -> list[str]:
    """The legend name of each run: the shortest ending of its resolved path that no other run's shares.

    Folders often share a name (``lm demo`` writes ``runs/demo/run``): two demos are ``demoA/run``
    and ``demoB/run``. Resolving first gives ``lm plot .`` its folder's name instead of "".

    >>> run_labels(["/a/x/run", "/b/x/run", "/c/other"])
    ['a/x/run', 'b/x/run', 'other']
    """
    paths = [Path(d).resolve() for d in run_dirs]
    depth = [1] * len(paths)
    while True:
        # a name that is not UTF-8 written \xff: its lone surrogate was a traceback in matplotlib's text
        labels = [text_name(Path(*p.parts[-n:])) for p, n in zip(paths, depth)]
        clashing = [i for i, p in enumerate(paths)  # with another folder: the same one given twice keeps its name
                    if depth[i] < len(p.parts) and any(q != p and name == labels[i] for q, name in zip(paths, labels))]
        if not clashing:
            return labels
        for i in clashing:
            depth[i] += 1


def plot_runs(run_dirs: list[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write a PNG with two panels (loss vs step, loss vs training time) overlaying every run.

    Train loss is a solid line and validation loss a dashed line with markers, in one colour per run,
    named by :func:`run_labels` (a train loss with label smoothing says so: see
    :func:`train_label_smoothing`); the PNG carries :data:`PLOT_MARK` (see :func:`is_marked_plot`).
    Records without a ``time`` are drawn against steps only. A run with no loss record, or an
    ``out`` that is a run's ``metrics.jsonl``, is a ValueError naming it, before anything is written;
    so is an ``out`` that cannot be written (``--out: '/proc/x.png' cannot be written: ...``).
    """
    check_not_input(out, [("run_dirs", Path(d) / "metrics.jsonl") for d in run_dirs], "out")
    runs = [(Path(d), loss_records(d)) for d in run_dirs]
    labels = run_labels(run_dirs)
    for run_dir, rows in runs:
        if not rows["train"] and not rows["val"]:
            raise ValueError(f"RUN_DIR: {str(run_dir / 'metrics.jsonl')!r} holds no loss records (train or val "
                             "lines with a step and a loss); nothing to plot")

    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    from lm.io import atomic_write, writing_out

    longest = max((r["time"] for _, rows in runs for split in rows.values() for r in split if _number(r.get("time"))),
                  default=0)
    unit, scale = ("minutes", 60) if longest > 120 else ("seconds", 1)
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, ((run_dir, records), name) in enumerate(zip(runs, labels)):
        color = f"C{i % 10}"
        eps = train_label_smoothing(run_dir)
        for split, style in (("train", dict(linestyle="-")), ("val", dict(linestyle="--", marker="o", ms=3))):
            rows = records[split]
            if not rows:
                continue
            label = f"{name} {split}" + (f" (label-smoothed, ε={eps:g})" if split == "train" and eps else "")
            if len(rows) == 1:  # a line through one point draws nothing
                style = {**style, "marker": "o", "ms": 3}
            by_step.plot([r["step"] for r in rows], [r["loss"] for r in rows], color=color, label=label, **style)
            timed = [r for r in rows if _number(r.get("time"))]
            if timed:
                by_time.plot([r["time"] / scale for r in timed], [r["loss"] for r in timed], color=color,
                             label=label, **style)
    by_step.set_xlabel("step")
    by_time.set_xlabel(f"training time ({unit})")
    for ax in (by_step, by_time):
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if not by_time.lines:
        by_time.text(0.5, 0.5, "no records with a time", ha="center", va="center", transform=by_time.transAxes)
    fig.tight_layout()
    out = Path(out)
    try:
        with writing_out(out, "--out"), atomic_write(out, "wb") as f:  # /proc/x.png: one line naming --out
            fig.savefig(f, format="png", dpi=120, metadata=dict([PLOT_MARK]))
    finally:
        plt.close(fig)
    return out
