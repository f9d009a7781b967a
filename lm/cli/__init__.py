"""The ``lm`` command line: a thin layer over functions a user can call from Python.

Every subcommand module exposes ``register(subparsers)`` and follows the grammar written down
in :mod:`lm.cli.common`. Errors that a user can fix (bad arguments, missing files, malformed
data) are raised as ``ValueError`` or ``OSError`` and printed here as one line, with exit
status 2; a library warning is printed as one ``lm CMD: warning: ...`` line; Ctrl-C exits 130.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

from lm import __version__
from lm.cli.common import HelpFormatter, WrittenHelpParser, run_as_command

EXAMPLES = """examples:
  lm demo                                          # the whole pipeline in a few minutes, offline
  lm tokenizer train --input corpus.txt --vocab-size 10000 --special-token '<|endoftext|>' --out tok
  lm tokenize --tokenizer tok --input corpus.txt --out corpus.bin
  lm train --config configs/cpu-small.toml
  lm sample --checkpoint runs/cpu-small --prompt "Once upon a time"
  lm COMMAND --help                                # options, defaults and examples of one command
"""


def build_parser() -> argparse.ArgumentParser:
    parser = WrittenHelpParser(
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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = " ".join(
        x for x in (args.command, getattr(args, "tokenizer_command", None), getattr(args, "data_command", None),
                    getattr(args, "export_format", None)) if x
    )
    return run_as_command(f"lm {command}", lambda: args.func(args))


class StdoutError(OSError):
    def __str__(self) -> str:
        return f"standard output cannot be written: {self.strerror}"


class _Stdout:
    """Standard output whose write errors name it: ``lm sample > /dev/full`` said "error: [Errno 28]
    No space left on device", naming no argument (clifuzz9). A closed pipe's BrokenPipeError is
    left as it is: :func:`lm.cli.common.quiet_on_closed_pipe` ends such a run quietly. After the
    error, descriptor 1 is /dev/null, so the lines still buffered are not an error (and a
    traceback) again at the last flush. ``broken`` (stdout closed, or open for reading only): every
    write is that error, where the output had been dropped with exit 0."""

    def __init__(self, stream, broken: bool = False):
        self._stream, self._broken = stream, broken

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _named(self, call, *args):
        try:
            if self._broken:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF))
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            from lm.io import silence_stdout

            self._broken = False  # what follows goes to /dev/null, which takes it
            silence_stdout()
            raise StdoutError(e.errno, e.strerror) from None

    def write(self, text: str) -> int:
        return self._named(self._stream.write, text)

    def flush(self) -> None:
        self._named(self._stream.flush)


def _writable(stream) -> bool:
    """Whether ``stream`` can be written: not None (Python's stream for a descriptor closed at
    start), and its descriptor open for writing (pyenv's shim leaves a file of its own open for
    reading on a closed one). A stream without a descriptor (captured) is taken as it is."""
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


def _devnull_at(fd: int) -> None:
    """Point descriptor ``fd`` at /dev/null: a closed one would be taken by the next file opened, and
    what a library writes to it would land in that file."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _standard_streams() -> None:
    """Closed (``2>&-``) or read-only standard error: every status line had gone to stdout, into the
    data, and the final flush was an exit 1 after a clean run (clifuzz9 #7); what the user asked to
    discard is now discarded. Standard output is wrapped (:class:`_Stdout`); one that cannot be
    written makes the first write an error naming it. Names that are not UTF-8 (held as lone
    surrogates) are written as their bytes, as under the C locale: a strict UTF-8 locale made
    ``lm plot``'s result line an encoding error after the plot was written."""
    if not _writable(sys.stderr):
        _devnull_at(2)
        sys.stderr = open(2, "w", errors="backslashreplace", closefd=False)
    broken = not _writable(sys.stdout)
    if broken:
        _devnull_at(1)
        sys.stdout = open(1, "w", closefd=False)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="surrogateescape")
    sys.stdout = _Stdout(sys.stdout, broken)


def entry() -> None:
    """The ``lm`` executable: :func:`main`, then exit. After Ctrl-C or SIGTERM (status 130, 143) the
    process ends at once, without the interpreter's teardown of torch and its threads, which can take a second:
    every output was already cleaned up while the interrupt unwound. Once :func:`main` has
    returned, Ctrl-C is ignored: there is nothing left to interrupt."""
    import signal

    _standard_streams()
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
