"""``lm train`` and ``lm plot``: thin wrappers over :mod:`lm.train`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TRAIN_EXAMPLES = """examples:
  lm train --config configs/cpu-small.toml
  lm train --config configs/tinystories-17m.toml --set train.max_steps=2000 --set optim.max_lr=6e-4
  lm train --config configs/cpu-small.toml --resume        # continue the run's latest checkpoint
  torchrun --nproc_per_node 4 -m lm train --config configs/tinystories-17m.toml   # DDP

A run writes RUN_DIR (train.out_dir): config.toml (resolved), metrics.jsonl,
checkpoints/step_*.pt (the last checkpoint.keep_last) and best.pt, model.safetensors.
SIGINT/SIGTERM save a checkpoint and exit; --resume continues exactly where it stopped.
"""

PLOT_EXAMPLES = """examples:
  lm plot runs/cpu-small                       # writes runs/cpu-small/loss.png
  lm plot runs/a runs/b --out compare.png      # overlay two runs
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a Transformer LM from a TOML config",
        description="Train a Transformer language model on token files written by `lm tokenize`.",
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, metavar="FILE.toml", help="the run's configuration")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        dest="overrides",
        help="override one config value (TOML syntax; bare strings allowed); repeatable",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in train.out_dir")
    p.set_defaults(func=run_train)

    q = subparsers.add_parser(
        "plot",
        help="plot train/validation loss of runs to a PNG",
        description="Plot train and validation loss against steps and wall-clock time, runs overlaid.",
        epilog=PLOT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    q.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories of `lm train`")
    q.add_argument(
        "--out", metavar="FILE.png", help="output PNG (default: RUN_DIR/loss.png, or ./loss.png for several)"
    )
    q.set_defaults(func=run_plot)


def run_train(args: argparse.Namespace) -> int:
    from lm.train import Trainer, TrainingDiverged, load_config

    cfg = load_config(args.config, args.overrides)
    try:
        return Trainer(cfg, resume=args.resume).run()
    except TrainingDiverged as e:
        print(f"lm train: error: {e}", file=sys.stderr)
        return 3


def run_plot(args: argparse.Namespace) -> int:
    from lm.train.plot import plot_runs

    out = args.out or (Path(args.run_dirs[0]) / "loss.png" if len(args.run_dirs) == 1 else Path("loss.png"))
    path = plot_runs(args.run_dirs, out)
    print(path)
    return 0
