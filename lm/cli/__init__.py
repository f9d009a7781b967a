"""The ``lm`` command line: a thin layer over functions a user can call from Python.

Every subcommand module exposes ``register(subparsers)`` and follows the grammar written down
in :mod:`lm.cli.common`. Errors that a user can fix (bad arguments, missing files, malformed
data) are raised as ``ValueError`` or ``OSError`` and printed here as one line, with exit
status 2; a library warning is printed as one ``lm CMD: warning: ...`` line; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from lm import __version__
from lm.cli.common import HelpFormatter

EXAMPLES = """examples:
  lm demo                                          # the whole pipeline in a few minutes, offline
  lm tokenizer train --input corpus.txt --vocab-size 10000 --special-token '<|endoftext|>' --out tok
  lm tokenize --tokenizer tok --input corpus.txt --out corpus.bin
  lm train --config configs/cpu-small.toml
  lm sample --checkpoint runs/cpu-small --prompt "Once upon a time"
  lm COMMAND --help                                # options, defaults and examples of one command
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lm",
        description="Train byte-level BPE tokenizers and small Transformer language models.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from lm.cli import data, demo, evaluate, export, sample, serve, tokenizer, train, translate

    tokenizer.register(sub)  # lm tokenizer train, lm tokenize
    train.register(sub)  # lm train, lm plot
    data.register(sub)  # lm data download
    sample.register(sub)  # lm sample
    serve.register(sub)  # lm serve
    translate.register(sub)  # lm translate
    evaluate.register(sub)  # lm eval
    export.register(sub)  # lm export hf
    demo.register(sub)  # lm demo
    return parser


def _one_line_warnings(command: str):
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"lm {command}: warning: {message}", file=sys.stderr)

    return show


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = " ".join(
        x for x in (args.command, getattr(args, "tokenizer_command", None), getattr(args, "data_command", None),
                    getattr(args, "export_format", None)) if x
    )
    previous = warnings.showwarning
    warnings.showwarning = _one_line_warnings(command)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"lm {command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"lm {command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = previous


class StdoutError(OSError):
    def __str__(self) -> str:
        return f"standard output cannot be written: {self.strerror}"


class _Stdout:
    """Standard output whose write errors name it: ``lm sample > /dev/full`` said "error: [Errno 28]
    No space left on device", naming no argument (clifuzz9). A closed pipe's BrokenPipeError is
    left as it is: :func:`lm.cli.common.quiet_on_closed_pipe` ends such a run quietly."""

    def __init__(self, stream):
        self._stream = stream

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _named(self, call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise StdoutError(e.errno, e.strerror) from None

    def write(self, text: str) -> int:
        return self._named(self._stream.write, text)

    def flush(self) -> None:
        self._named(self._stream.flush)


def _writable(stream) -> bool:
    """Whether ``stream`` can be written. Closed (``2>&-``), Python makes it None, so every status
    line went to stdout, into the data, and the final flush was an exit 1 after a clean run
    (clifuzz9 #7); a launcher that leaves a file of its own open for reading there (pyenv's shim
    does) made each write an EBADF. A stream without a descriptor (captured) is taken as it is."""
    if stream is None:
        return False
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return True
    try:
        import fcntl

        return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    except ImportError:  # not Unix
        return True
    except OSError:  # a descriptor that is not open
        return False


def entry() -> None:
    """The ``lm`` executable: :func:`main`, then exit. After Ctrl-C or SIGTERM (status 130, 143) the
    process ends at once, without the interpreter's teardown of torch and its threads, which can take a second:
    every output was already cleaned up while the interrupt unwound. Once :func:`main` has
    returned, Ctrl-C is ignored: there is nothing left to interrupt."""
    import signal

    for name in ("stdout", "stderr"):
        if not _writable(getattr(sys, name)):  # closed: what the user asked to discard is discarded
            setattr(sys, name, open(os.devnull, "w"))
    sys.stdout = _Stdout(sys.stdout)
    # Once the work is over, a Ctrl-C would land in the interpreter's teardown, which restores the
    # default handler and would die by the signal (status -2) after a clean run: it is ignored from
    # the moment main returns (the finally), and one that lands before that is caught here too.
    try:
        try:
            status = main()
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt:  # in the instant between main's own handler and the finally
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("lm: interrupted", file=sys.stderr)
        status = 130
    sys.stdout.flush()
    sys.stderr.flush()
    if status in (130, 143):
        os._exit(status)
    sys.exit(status)
