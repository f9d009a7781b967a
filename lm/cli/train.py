"""``lm train`` and ``lm plot``: thin wrappers over :mod:`lm.train`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from lm.cli.common import add_command, add_compute, add_out, add_quiet, as_flags

TRAIN_EXAMPLES = """
  lm train --config configs/cpu-small.toml
  lm train --config configs/tinystories-17m.toml --set train.max_steps=2000 --set optim.max_lr=6e-4
  lm train --config configs/cpu-small.toml --resume        # continue the run's latest checkpoint
  lm train --config configs/cpu-small.toml --resume runs/cpu-small/checkpoints/best.pt --set train.out_dir=runs/b
  lm train --config configs/cpu-small.toml --threads 1     # one CPU thread (faster on a busy machine)
  torchrun --nproc_per_node 4 -m lm train --config configs/tinystories-17m.toml   # DDP
"""

PLOT_EXAMPLES = """
  lm plot runs/cpu-small                       # writes runs/cpu-small/loss.png
  lm plot runs/a runs/b --out compare.png      # overlay two runs
  lm plot demoA/run demoB/run --out demos.png  # same folder names: the legend says demoA/run, demoB/run
  lm plot runs/cpu-small --overwrite           # redraw an existing loss.png
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "train",
        help="train a Transformer LM from a TOML config",
        description="Train a Transformer language model on token files written by `lm tokenize`. A run writes "
        "RUN_DIR (train.out_dir): config.toml (resolved), metrics.jsonl, checkpoints/step_*.pt (the last "
        "checkpoint.keep_last) and best.pt, model.safetensors. SIGINT/SIGTERM save a checkpoint and exit; --resume "
        "continues exactly where it stopped. One `lm train` at a time holds a run folder (RUN_DIR/.lock).",
        examples=TRAIN_EXAMPLES,
    )
    p.add_argument("--config", required=True, metavar="FILE.toml", help="the run's configuration")
    p.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override config values (TOML syntax; bare strings allowed; none unsets a key that may be "
        "left out, e.g. train.max_time=none or data.tokenizer=none; a file so named is ./none); one or more "
        "after --set (--set a.b=1 c.d=2), and repeatable",
    )
    p.add_argument("--resume", nargs="?", const=True, default=False, metavar="PATH",
                   help="continue the latest checkpoint in train.out_dir, or the checkpoint PATH given (a file, "
                   "or a run folder: its latest checkpoint)")
    add_compute(p, device=None, dtype=None)
    add_quiet(p)
    p.set_defaults(func=run_train)

    q = add_command(
        subparsers,
        "plot",
        help="plot train/validation loss of runs to a PNG",
        description="Plot train and validation loss against steps and training time (evaluation, checkpoints "
        "and compilation left out, as in metrics.jsonl), runs overlaid.",
        examples=PLOT_EXAMPLES,
    )
    q.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `lm train`")
    add_out(q, "output PNG (default: RUN_DIR/loss.png, or ./loss.png for several runs)", required=False,
            metavar="FILE.png")
    add_quiet(q)
    q.set_defaults(func=run_plot)


def run_train(args: argparse.Namespace) -> int:
    from lm.io import check_readable_file, check_threads

    check_threads(args.threads)  # before torch is imported: a wrong count is said at once
    from lm.device import resolve_device, set_threads
    from lm.tomlio import toml_string
    from lm.train import Trainer, TrainingDiverged, load_config
    from lm.train.distributed import torchrun_env
    from lm.train.trainer import PeerStopped, RefusedOnRankZero

    set_threads(args.threads)
    overrides = list(args.overrides)  # --device and --dtype after them: they win
    try:
        overrides += [f"train.device={toml_string(args.device)}"] if args.device is not None else []
    except ValueError:  # not UTF-8 (TOML cannot hold it), so no device: the usual line
        resolve_device(args.device, "--device")
        raise
    overrides += [f"train.dtype={args.dtype}"] if args.dtype else []
    # a device refused names the --device typed, not the train.device it became
    flags = as_flags(**{"train.device": "--device"}) if args.device is not None else contextlib.nullcontext()
    env = torchrun_env()  # each process's own: checked (and said) by every process
    try:
        if args.resume == "":  # an unset variable: taken for "not given", it started the run over
            raise ValueError("--resume: must not be empty; pass --resume alone to continue the run in "
                             "train.out_dir, or --resume PATH")
        check_readable_file(args.config, "--config")  # a folder: "[Errno 21] Is a directory", naming nothing
        cfg = load_config(args.config, overrides)
    except (ValueError, OSError):
        if env.local_rank != 0:  # under torchrun the same line from every process: local rank 0 says it
            return 2
        raise
    try:
        with flags:
            return Trainer(cfg, resume=args.resume, quiet=args.quiet).run()
    except RefusedOnRankZero:  # rank 0 says why, once
        return 2
    except TrainingDiverged as e:  # under torchrun every process holds the same all-reduced numbers
        if env.local_rank == 0:
            print(f"lm train: error: {e}", file=sys.stderr)
        return 3
    except PeerStopped as e:  # under torchrun: the process that failed says why; this one, where it stopped
        print(f"lm train: error: {e}", file=sys.stderr)
        return 1


def run_plot(args: argparse.Namespace) -> int:
    from lm.io import check_not_empty, check_output_file
    from lm.train.plot import is_marked_plot, plot_runs

    for d in args.run_dirs:
        check_not_empty(d, "RUN_DIR")  # Path('') is the working folder: a script's unset variable plotted it
        if not Path(d).exists():
            raise ValueError(f"RUN_DIR: folder not found: {d!r}")
        if not Path(d).is_dir():
            raise ValueError(f"RUN_DIR: {d!r} is not a folder; pass a run directory of `lm train`")
        if not (Path(d) / "metrics.jsonl").is_file():
            raise ValueError(f"RUN_DIR: {d!r} has no metrics.jsonl; is it a run directory of `lm train`?")
    if args.out == "":  # it had been taken for "not given": the plot went to the default
        raise ValueError("--out: must not be empty; omit --out for the default, RUN_DIR/loss.png")
    out = args.out if args.out is not None else (
        Path(args.run_dirs[0]) / "loss.png" if len(args.run_dirs) == 1 else Path("loss.png"))
    if Path(out).suffix.lower() != ".png":
        raise ValueError(f"--out: {str(out)!r} must end in .png")
    inputs = [("RUN_DIR", Path(d) / "metrics.jsonl") for d in args.run_dirs]
    check_output_file(out, overwrite=args.overwrite, inputs=inputs, recognise=is_marked_plot,
                      what="a plot that lm plot wrote (marked Software='lm plot' in its PNG metadata)")
    path = plot_runs(args.run_dirs, out)
    print(path)
    return 0
