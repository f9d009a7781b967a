"""The grammar every ``lm`` subcommand follows, and what `sample`, `eval` and `export` share.

One convention (README, "The command line"):

- inputs are named options: ``--input FILE`` (text), ``--data FILE``, ``--tokenizer DIR``,
  ``--checkpoint PATH`` (a checkpoint file or a run folder), ``--config FILE``;
- every output is ``--out PATH`` (a file or a folder, as the command makes); an existing output
  is replaced only with ``--overwrite``, and only when it is an output of the same command;
- positionals only name the things a command acts on (``lm plot RUN_DIR...``, ``lm data
  download DATASET``);
- ``--quiet`` on every command: no progress bars or progress lines (results and errors still print);
- commands that run a model take ``--device`` (default ``auto``: CUDA, then MPS, then CPU),
  ``--dtype`` (``auto``, ``float32``, ``bfloat16``) and ``--threads N`` (torch's CPU threads);
- every ``--help`` shows the defaults and ends with examples;
- a command stops quietly (status 141) when the reader of its output goes away (``| head``), as a
  Unix tool does (see :func:`quiet_on_closed_pipe`); ``lm train`` trains on, silently;
- an option a command does not know is that command's error, under its usage (:class:`CommandParser`).

Old spellings (``--out-dir``, the positional checkpoint and folder of ``lm export hf``) still
work for one release and print a deprecation line.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lm.generate.load import Loaded


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Examples kept as written; a one-paragraph description wrapped to the terminal; every option's
    default shown (except where it is None or a flag)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:  # laid out by hand (the examples): kept as written
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)  # a paragraph, wrapped

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or action.default == [] or action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)


class WrittenHelpParser(argparse.ArgumentParser):
    """A parser whose ``--help`` and ``--version`` text, on standard output, is written or is an error:
    argparse drops a failed write (``except (AttributeError, OSError): pass``), so ``lm --version >
    /dev/full`` and ``lm tokenize --help >&-`` exited 0 with nothing written (cli21 F1), where every
    command's own output that cannot be written is ``lm CMD: error: standard output cannot be
    written: ...``, exit 2. A closed pipe (``lm --help | head -1``) ends quietly with status 141, as
    every command does (:func:`quiet_on_closed_pipe`). A message to standard error (a usage error)
    is left to argparse: there is nowhere left to report its failure."""

    def _print_message(self, message, file=None):
        if not message or file is None or file is not sys.stdout:  # (None: no stdout at all, argparse's case)
            return super()._print_message(message, file)
        from lm.cli import StdoutError
        from lm.io import silence_stdout

        try:
            file.write(message)
            file.flush()  # a buffered stdout fails here, or at the interpreter's last flush, which is silent
        except BrokenPipeError:
            silence_stdout()
            self.exit(CLOSED_PIPE_STATUS)
        except OSError as e:  # lm.cli's StdoutError; a plain OSError where main runs without entry's streams
            silence_stdout()
            error = e if isinstance(e, StdoutError) else StdoutError(e.errno, e.strerror)
            self.exit(2, f"{self.prog}: error: {error}\n")


class CommandParser(WrittenHelpParser):
    """The parser of one subcommand (``lm export``, ``lm export hf``).

    An argument it does not know is its own error, under its own usage (``lm export hf: error:
    unrecognized arguments: --bogus``): argparse hands a subcommand's leftovers up to ``lm``, which
    named itself and showed its own usage. Its command (``set_defaults(func=...)``) stops quietly
    when the reader of its output goes away (:func:`quiet_on_closed_pipe`), like those that print
    their results: a closed pipe after an export is no failed export.
    """

    def _add_action(self, action: argparse.Action) -> argparse.Action:
        # every path option, a mutually exclusive group's too (it adds its options through here), stored once
        if type(action) is argparse._StoreAction and action.option_strings[:1] and \
                action.option_strings[0] in ONCE_OPTIONS:
            action.__class__ = Once  # a plain store, with the check: no attribute of its own
        return super()._add_action(action)

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        vars(namespace).pop(ONCE, None)
        self._check_spellings(namespace)
        return namespace, extras

    def _check_spellings(self, namespace: argparse.Namespace) -> None:
        """A deprecated spelling's line, or, when the new spelling was given too (``--out-dir A --out B``:
        the last one given had won, silently), one line that refuses both, as ``lm export hf`` refuses a
        positional given beside its option."""
        given = vars(namespace).pop(SPELLINGS, [])
        for old, value, new in [g for g in given if g[2] is not None]:
            same = next(((o, v) for o, v, n in given if n is None and o == new), None)
            if same is not None:
                self.exit(2, f"{self.prog}: error: {old}: given both as {old} ({value!r}) and as {new} "
                             f"({same[1]!r}); use {new} alone\n")
        for old, _, new in given:
            if new is not None:
                print(f"{self.prog}: warning: {old} is deprecated and will be removed; use {new}", file=sys.stderr)

    def set_defaults(self, **kwargs) -> None:
        if "func" in kwargs:
            kwargs["func"] = quiet_on_closed_pipe(kwargs["func"])
        super().set_defaults(**kwargs)


def add_command(sub: argparse._SubParsersAction, name: str, *, help: str, description: str,
                examples: str) -> argparse.ArgumentParser:
    """A subcommand parser (a :class:`CommandParser`) with the shared formatter and an ``examples:`` epilog."""
    sub._parser_class = CommandParser  # add_subparsers(parser_class=...) for the subparsers of every command
    return sub.add_parser(name, help=help, description=description, epilog="examples:\n" + examples.strip("\n"),
                          formatter_class=HelpFormatter)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("lm",)):
    """``(("lm",), parser), (("lm", "tokenizer"), ...), (("lm", "tokenizer", "train"), ...)``: every parser
    of the command line under ``parser``, each command after the group that holds it, in the order
    ``lm --help`` lists them (docs/cli.md is written in this order; the grammar tests walk it)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


SPELLINGS = "_spellings"  # the namespace's list of (option, value, new spelling or None), see Deprecated
ONCE = "_once"  # the namespace's values of the Once options given so far
# the options that name one file or folder: given twice, the last had won without a word
ONCE_OPTIONS = ("--input", "--target", "--data", "--checkpoint", "--tokenizer", "--prompt-file", "--config", "--out",
                "--resume")


class Once(argparse.Action):
    """An option that names one file or folder, refused when given twice: ``lm tokenize --input a
    --input b`` had tokenized ``b`` alone, silently (``lm tokenizer train`` reads every ``--input``)."""

    def __call__(self, parser, namespace, values, option_string=None):
        seen = vars(namespace).setdefault(ONCE, {})
        if self.dest in seen:
            shown = [repr(v) if v is not self.const or self.const is None else "with no value"
                     for v in (seen[self.dest], values)]  # (--resume alone: the latest checkpoint)
            parser.exit(2, f"{parser.prog}: error: {option_string}: given twice ({shown[0]} and {shown[1]}); "
                           "it takes one, so pass it once\n")
        seen[self.dest] = values
        setattr(namespace, self.dest, values)


class Deprecated(argparse.Action):
    """An old spelling of an option (``--out-dir`` for ``--out``): stores into the new option's
    ``dest``; once the command line is parsed, :class:`CommandParser` prints one deprecation line,
    or refuses it given beside the new spelling. (``lm export hf``'s old positionals are told apart
    by the command itself: which one is which depends on ``--checkpoint``.)"""

    def __init__(self, option_strings, dest, new: str = "", **kwargs):
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        seen = vars(namespace).setdefault(ONCE, {})
        if option_string in seen:  # ``--out-dir a --out-dir b``: refused as --out given twice is
            parser.exit(2, f"{parser.prog}: error: {option_string}: given twice ({seen[option_string]!r} and "
                           f"{values!r}); it takes one, so pass it once\n")
        seen[option_string] = values
        vars(namespace).setdefault(SPELLINGS, []).append((option_string, values, self.new))
        setattr(namespace, self.dest, values)


class Spelled(Once):
    """The new spelling of an option that has a :class:`Deprecated` one: stored once (:class:`Once`),
    and recorded, so that both given together can be refused."""

    def __call__(self, parser, namespace, values, option_string=None):
        vars(namespace).setdefault(SPELLINGS, []).append((option_string, values, None))
        super().__call__(parser, namespace, values, option_string)


def add_out(p: argparse.ArgumentParser, what: str, *, metavar: str, required: bool = True,
            default: str | None = None, old: str | None = None) -> None:
    """``--out`` (and ``--overwrite``); ``metavar`` says what it names (DIR, FILE.bin); ``old`` is a
    deprecated spelling of ``--out``."""
    p.add_argument("--out", required=required and default is None and old is None, default=default,
                   metavar=metavar, help=what, **({"action": Spelled} if old else {}))
    if old:
        p.add_argument(old, dest="out", action=Deprecated, new="--out", metavar=metavar, help=argparse.SUPPRESS)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output of this command (never anything else)")


def add_checkpoint(p: argparse.ArgumentParser, required: bool = True) -> None:
    """``--checkpoint PATH``: a checkpoint file or a run directory (see :func:`lm.generate.load.resolve_checkpoint`)."""
    p.add_argument("--checkpoint", required=required, metavar="PATH", help="checkpoint file or run directory")


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bars or progress lines")


def add_compute(p: argparse.ArgumentParser, *, device: str | None = "auto", dtype: str | None = "auto") -> None:
    """``--device``, ``--dtype`` and ``--threads`` for a command that runs a model; a default of None
    is the config's (``lm train``: ``train.device``, ``train.dtype``), and the help says so."""
    p.add_argument("--device", default=device, metavar="DEVICE",
                   help="auto (CUDA, then MPS, then CPU), cpu, cuda, cuda:N or mps"
                   + (" (default: the config's train.device)" if device is None else ""))
    p.add_argument("--dtype", default=dtype, choices=["auto", "float32", "bfloat16"],
                   help="compute dtype (autocast); auto is bfloat16 on CUDA GPUs that support it, else float32"
                   + (" (default: the config's train.dtype)" if dtype is None else ""))
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's choice, usually the core count)")


def compute_dtype(prog: str, args: argparse.Namespace, device):
    """``--dtype`` for ``device`` (:func:`lm.device.resolve_dtype`), and, unless ``--quiet``, a
    warning on standard error where it is bfloat16 on a CPU that multiplies bfloat16 slowly (85-125x
    float32's time on an AVX2 CPU, docs/benchmarks.md): such a run had been that slow without a word."""
    from lm.device import resolve_dtype, slow_bfloat16_line

    dtype = resolve_dtype(args.dtype, device)
    line = "" if args.quiet else slow_bfloat16_line(device, dtype)
    if line:
        print(f"{prog}: warning: {line}", file=sys.stderr, flush=True)
    return dtype


# -- models and tokenizers from a path ---------------------------------------------------------

def load_model_and_tokenizer(checkpoint: str, tokenizer: str | None, device: str,
                             need_tokenizer: bool = True) -> Loaded:
    """:func:`lm.generate.load_model_and_tokenizer`, the library's loader, with the command line's
    argument names in its errors: ``model, tokenizer, info = ...``, and ``.path``, the file loaded.
    ``tokenizer`` and ``device`` are the command's ``--tokenizer`` and ``--device`` (no defaults of
    its own: those are the command's)."""
    from lm.generate.load import load_model_and_tokenizer as load

    return load(checkpoint, tokenizer, device, need_tokenizer=need_tokenizer)


@contextlib.contextmanager
def as_flags(**flags: str) -> Iterator[None]:
    """Name the command line's flag in a library ValueError or warning that names its parameter:
    within ``as_flags(vocab_size="--vocab-size")``, ``vocab_size: 100 is below ...`` becomes
    ``--vocab-size: 100 is below ...`` and ``alpha must be ...`` ``--alpha: must be ...``; within
    ``as_flags(input="--input")`` the warning ``input: 3 bytes ... are not valid UTF-8`` is shown
    as ``--input: 3 bytes ...``."""

    def renamed(message: str) -> str | None:
        for name, flag in flags.items():
            m = re.match(rf"{re.escape(name)}(?::\s*|\s+(?=must\b))", message)
            if m:  # a command line has no None, and names the flag, not the parameter: "got 0", not "got top_k=0"
                rest = message[m.end():].replace(" or None, got ", ", got ").replace(f"got {name}=", "got ")
                return f"{flag}: {rest}"
        return None

    shown = warnings.showwarning

    def show(message, category, *rest, **kwargs):
        new = renamed(str(message))
        shown(message if new is None else category(new), category, *rest, **kwargs)

    warnings.showwarning = show
    try:
        yield
    except ValueError as e:
        new = renamed(str(e))
        if new is not None:
            raise ValueError(new) from None
        raise
    finally:
        warnings.showwarning = shown


# -- errors in the command line's words --------------------------------------------------------

def check_utf8(option: str, value: str, what: str = "", remedy: str = "") -> None:
    """Refuse an argument that is not UTF-8, in one line: "OPTION: WHAT is not valid UTF-8 (at
    character N); REMEDY", N counted from 1 (default remedy: pass OPTION in UTF-8). Bytes the shell or the file
    system could not decode arrive in ``sys.argv`` as lone surrogates, which every later encode
    fails on: a prompt's tokens, a server's JSON responses and headers, an output file's name.

    >>> check_utf8("--prompt", "caf\\udce9", remedy="use --prompt-file")
    Traceback (most recent call last):
    ValueError: --prompt: not valid UTF-8 (at character 4); use --prompt-file
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{option}: {what + ' is ' if what else ''}not valid UTF-8 (at character {e.start + 1}); "
                         f"{remedy or f'pass {option} in UTF-8'}") from None


def require_architecture(model, want: str, checkpoint: str) -> None:
    """One line pointing to the right command when a checkpoint is of the other kind."""
    arch = model.config.architecture
    if arch == want:
        return
    hint = "`lm translate`" if arch == "encoder_decoder" else "`lm sample`"
    kind = "a translation model (encoder_decoder)" if arch == "encoder_decoder" else "a language model (decoder_lm)"
    raise ValueError(f"--checkpoint: {checkpoint!r} is {kind}; use {hint}")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether torch's allocator failed: ``torch.OutOfMemoryError`` (a GPU), or the CPU allocator's
    ``RuntimeError`` ("DefaultCPUAllocator: can't allocate memory: you tried to allocate ...")."""
    import torch

    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))


@contextlib.contextmanager
def model_fits(batch: str, remedy: str) -> Iterator[None]:
    """Within it, a batch that cannot fit in memory is one line, "``batch`` does not fit in memory
    (torch tried to allocate N); ``remedy``", not torch's traceback (README, "Errors": ``batch``
    starts with the arguments that size it and says their values). A model whose logits are not
    finite (NaN or inf: it overflows) is one line naming ``--checkpoint``."""
    from lm.generate.sampling import NonFiniteLogitsError

    try:
        yield
    except NonFiniteLogitsError as e:
        raise ValueError(f"--checkpoint: {e}") from None
    except RuntimeError as e:
        if not is_out_of_memory(e):
            raise
        size = re.search(r"[Tt]ried to allocate ([\d.]+ ?[A-Za-z]+)", str(e))
        tried = f" (torch tried to allocate {size.group(1)})" if size else ""
        raise ValueError(f"{batch} does not fit in memory{tried}; {remedy}") from None


def check_fits(batch: str, need: int, what: str, device, remedy: str) -> None:
    """Refuse, in the words of :func:`model_fits`, a batch that needs ``need`` bytes, counted before
    anything is allocated (``what``: for what and how exactly, "its cache needs at least"), when that is more
    than ``device`` has free, or more than a tensor can hold where the free memory is unknown:
    torch's own errors for a size past int64 were tracebacks ("Storage size calculation
    overflowed", "Overflow when unpacking long long")."""
    from lm.train.memory import available_bytes

    have = available_bytes(device)
    if need <= (2**63 - 1 if have is None else have):
        return
    free = "more than a tensor can hold" if have is None else f"{device} has {gib(have)} free"
    raise ValueError(f"{batch} does not fit in memory ({what} {gib(need)}, {free}); {remedy}")


def gib(n: int) -> str:
    """A size in GiB, as torch's allocator errors give it: "2.00 GiB"; any integer (a size counted
    from an absurd option need not fit a float).

    >>> gib(3 << 29), gib(10**400)
    ('1.50 GiB', 'about 2**1328 bytes')
    >>> gib(2**998)[-12:], gib(2**999)  # up to 999 bits in GiB, then as a power of two
    ('9,856.00 GiB', 'about 2**999 bytes')
    """
    return f"{n / 2**30:,.2f} GiB" if n.bit_length() < 1000 else f"about 2**{n.bit_length() - 1} bytes"


def check_not_token_file(path: Path, argument: str, remedy: str) -> None:
    """Refuse a file of ``lm tokenize`` (a token or pair file, told by its sidecar) where text is
    read, before its bytes are taken for text: a prompt of NULs and control characters."""
    from lm.data.pairs import is_pair_file
    from lm.data.token_file import is_token_file

    if is_pair_file(path):
        raise ValueError(f"{argument}: {str(path)!r} is a translation pair file (`lm tokenize --target`); {remedy}")
    if is_token_file(path):
        raise ValueError(f"{argument}: {str(path)!r} is a token file (`lm tokenize`); {remedy}")


def read_stdin(argument: str) -> bytes:
    """All of standard input, for ``argument`` given as ``-``; one line naming ``argument`` when it
    cannot be read. Closed (``<&-``), Python's ``sys.stdin`` is None, and reading it was a traceback;
    opened for writing only (``0>file``), the error named no option (clifuzz9 #4)."""
    stream = stdin_stream(argument)
    with reading_stdin(argument):
        return stream.read()


def stdin_stream(argument: str):
    """Standard input's binary stream, for ``argument`` given as ``-``; one line naming ``argument``
    when it is closed (``<&-``: Python's ``sys.stdin`` is None)."""
    if sys.stdin is None:
        raise ValueError(f"{argument}: - reads standard input, which is closed")
    return sys.stdin.buffer


@contextlib.contextmanager
def reading_stdin(argument: str):
    """An OSError of reading standard input as one line naming ``argument``."""
    try:
        yield
    except OSError as e:
        raise ValueError(f"{argument}: - reads standard input, which cannot be read: {e.strerror or e}") from None


def plural(n: int, word: str, words: str | None = None) -> str:
    """``word`` for a count of one, else ``words`` (default ``word + "s"``): "1 byte", "2 bytes"."""
    return word if n == 1 else words or word + "s"


def run_as_command(prog: str, run: Callable[[], int | None]) -> int:
    """``run()`` as a command line runs it (``lm``'s commands, ``python -m lm.demo.stories``): each
    warning one line ``PROG: warning: ...``, a ValueError or an OSError one line ``PROG: error: ...``
    and exit 2, a Ctrl-C ``PROG: interrupted`` and 130; else ``run()``'s status (None: 0)."""
    previous = warnings.showwarning
    warnings.showwarning = lambda message, *rest, **kwargs: print(f"{prog}: warning: {message}", file=sys.stderr)
    try:
        return int(run() or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        warnings.showwarning = previous


def interruptible_script(prog: str, run: Callable[[], int], kept: Callable[[], str] = lambda: "") -> int:
    """A script's ``main``: ``run()``, with Ctrl-C and SIGTERM ending it as they end an ``lm`` command:
    one line, ``PROG: interrupted`` (exit 130) or ``PROG: terminated`` (143), where a Ctrl-C had been a
    traceback (demo21). A training run stopped by either (:class:`lm.train.TrainingInterrupted`, raised
    inside the script's ``claim_dir``, which then removes the half-made output and puts back the one it
    replaced) exits as its signal says. ``kept()``: what the script keeps all the same, for the line."""
    import signal as signals

    from lm.cli.tokenizer import terminate_as_interrupt

    try:
        return terminate_as_interrupt(prog, run, note=kept)
    except KeyboardInterrupt as e:  # Ctrl-C, or a training run stopped by SIGINT or SIGTERM
        status = getattr(e, "status", 128 + signals.SIGINT)
        word = "terminated" if status == 128 + signals.SIGTERM else "interrupted"
        note = kept()  # once: it may look at the disk
        print(f"{prog}: {word}{'; ' + note if note else ''}", file=sys.stderr)
        return status


# -- a closed output pipe ----------------------------------------------------------------------

CLOSED_PIPE_STATUS = 141  # 128 + SIGPIPE: what a shell reports for a tool that `| head` cut short


def quiet_on_closed_pipe(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Wrap a command that prints its results so that ``lm CMD ... | head`` ends as ``seq 1e9 | head``
    does: no error line, no traceback, status 141. Python ignores SIGPIPE, so a write to a closed
    pipe raises BrokenPipeError, which would otherwise be reported as an error with exit 2."""

    if getattr(command, "quiet_on_closed_pipe", False):  # wrapped already
        return command

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            status = command(args)
            sys.stdout.flush()  # the last buffered lines: their reader may be gone too
            return status
        except BrokenPipeError:
            if not stdout_reader_gone():  # another pipe broke (a worker's, a socket): a real error
                raise
            from lm.io import silence_stdout

            silence_stdout()
            return CLOSED_PIPE_STATUS

    run.quiet_on_closed_pipe = True
    return run


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reader went away: ``poll`` reports an error or a
    hang-up on it. False for a file, a terminal, a live pipe, or a stdout with no descriptor."""
    import select

    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False
