"""The ``lm`` command line: a thin layer over functions a user can call from Python.

Every subcommand module exposes ``register(subparsers)``; errors that a user can fix
(bad arguments, missing files, malformed data) are raised as ``ValueError`` or ``OSError``
and printed here as one line, with a non-zero exit status.
"""

from __future__ import annotations

import argparse
import sys

from lm.cli import tokenizer as _tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm",
        description="Train byte-level BPE tokenizers and small Transformer language models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _tokenizer.register(sub)
    __import__("lm.cli.train", fromlist=["register"]).register(sub)  # lm train, lm plot
    __import__("lm.cli.data", fromlist=["register"]).register(sub)  # lm data download
    __import__("lm.cli.sample", fromlist=["register"]).register(sub)  # lm sample
    __import__("lm.cli.evaluate", fromlist=["register"]).register(sub)  # lm eval
    __import__("lm.cli.export", fromlist=["register"]).register(sub)  # lm export hf
    __import__("lm.cli.demo", fromlist=["register"]).register(sub)  # lm demo
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("lm: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"lm {args.command}: error: {e}", file=sys.stderr)
        return 2
