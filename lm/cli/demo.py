"""``lm demo``: corpus -> BPE -> tokenize -> train -> evaluate -> sample -> plot, with a report."""

from __future__ import annotations

import argparse
import signal
import sys

from lm.cli.common import add_command, add_compute, add_out, add_quiet

EXAMPLES = """
  lm demo                                   # synthetic stories, or TinyStories if it is in data/
  lm demo --data my_corpus.txt --train-seconds 120 --out runs/my-demo
  lm demo --overwrite                       # run again into runs/demo, replacing the earlier demo
"""


def register(sub: argparse._SubParsersAction) -> None:
    from lm.demo.pipeline import DEFAULT_VOCAB_SIZE, DemoSettings

    d = DemoSettings()
    p = add_command(
        sub,
        "demo",
        help="run the whole pipeline in a few minutes and print a report",
        description="Train a tokenizer and a small model on a corpus, evaluate it against a unigram baseline, "
        "sample three stories and plot the loss curve. Works offline: without --data or TinyStories in data/ "
        "it generates a synthetic corpus of children's stories.",
        examples=EXAMPLES,
    )
    p.add_argument("--data", default=None, metavar="FILE",
                   help="a UTF-8 text corpus; gzip (told by its content) is decompressed to a temporary file first")
    add_out(p, "the folder for the tokenizer, data, run, report and plot", default=d.out_dir, metavar="DIR",
            old="--out-dir")
    p.add_argument("--train-seconds", type=float, default=d.train_seconds, metavar="S", help="training time budget")
    p.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, metavar="B",
                   help="bytes of the corpus to use (5%% of them for validation; at least 50,000)")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, metavar="N",
                   help=f"the BPE tokenizer's size (a small corpus may give fewer tokens: a warning says so; "
                   f"default: up to {DEFAULT_VOCAB_SIZE:,}, as many as the corpus gives, without a warning)")
    p.add_argument("--seed", type=int, default=d.seed, help="for a repeatable run (data, model, batches)")
    add_compute(p, dtype=d.dtype)
    add_quiet(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from lm.io import check_threads
    from lm.tokenizer import EOT

    # it had been found only after the corpus was prepared, as `vocab_size`; None: the default, "up to"
    if args.vocab_size is not None and args.vocab_size < 256 + 1:
        raise ValueError(f"--vocab-size: must be at least 257 (256 bytes + the {EOT} token), got {args.vocab_size}")
    check_threads(args.threads)  # before torch is imported: a wrong count is said at once
    from lm.demo.pipeline import DemoSettings, run_demo
    from lm.device import resolve_device, set_threads

    set_threads(args.threads)
    device = str(resolve_device(args.device))
    settings = DemoSettings(out_dir=args.out, data=args.data, train_seconds=args.train_seconds,
                            corpus_bytes=args.corpus_bytes, vocab_size=args.vocab_size, seed=args.seed,
                            progress=not args.quiet, overwrite=args.overwrite, device=device,
                            dtype=args.dtype)
    from lm.cli.tokenizer import terminate_as_interrupt
    from lm.train import TrainingDiverged, TrainingInterrupted

    def run() -> int:
        try:
            report = run_demo(settings)
        except TrainingDiverged as e:  # the demo's folder is removed; as `lm train`, exit 3 (it had been a traceback)
            print(f"lm demo: error: {e}", file=sys.stderr)
            return 3
        except TrainingInterrupted as e:  # the trainer's own handler took the signal
            if e.status != 128 + signal.SIGTERM:
                raise
            print("lm demo: terminated", file=sys.stderr)
            return e.status
        print(report.to_text())
        return 0

    # SIGTERM as Ctrl-C, while the tokenizer is trained and the corpus tokenized (the trainer handles it itself)
    return terminate_as_interrupt("lm demo", run)
