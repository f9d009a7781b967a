"""``lm demo``: corpus -> BPE -> tokenize -> train -> evaluate -> sample -> plot, with a report."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lm demo                                   # synthetic stories, or TinyStories if it is in data/
  lm demo --data my_corpus.txt --train-seconds 120
"""


def register(sub: argparse._SubParsersAction) -> None:
    from lm.demo.pipeline import DemoSettings

    d = DemoSettings()
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline in a few minutes and print a report",
        description="Train a tokenizer and a small model on a corpus, evaluate it against a unigram baseline, "
        "sample three stories and plot the loss curve. Works offline: without --data or TinyStories in data/ "
        "it generates a synthetic corpus of children's stories.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", default=None, metavar="FILE", help="a UTF-8 text corpus")
    p.add_argument("--out-dir", default=d.out_dir, metavar="DIR", help=f"default: {d.out_dir}")
    p.add_argument("--train-seconds", type=float, default=d.train_seconds, help=f"default: {d.train_seconds:.0f}")
    p.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes, help=f"default: {d.corpus_bytes:,}")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help=f"default: {d.vocab_size}")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from lm.demo.pipeline import DemoSettings, run_demo

    if args.train_seconds <= 0:
        raise ValueError(f"--train-seconds: must be > 0, got {args.train_seconds}")
    settings = DemoSettings(out_dir=args.out_dir, data=args.data, train_seconds=args.train_seconds,
                            corpus_bytes=args.corpus_bytes, vocab_size=args.vocab_size, seed=args.seed,
                            progress=not args.quiet)
    report = run_demo(settings)
    print(report.to_text())
    return 0
