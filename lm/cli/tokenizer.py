"""``lm tokenizer train`` and ``lm tokenize``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lm.cli.common import add_command, add_out, add_quiet, as_flags
from lm.io import (
    atomic_write,
    check_count,
    check_no_symlink_loop,
    check_not_empty,
    check_output_dir,
    check_output_file,
    check_readable_file,
    check_text_input,
    decompressed_copies,
    is_gzip,
    per_cpu_cap,
    replace_dir,
    text_name,
    writing_out,
)

TRAIN_EXAMPLES = """
  lm tokenizer train --input data/TinyStoriesV2-GPT4-train.txt --vocab-size 10000 \\
      --special-token '<|endoftext|>' --out data/tok-tinystories
  lm tokenizer train --input a.txt b.txt --vocab-size 4096 --out data/tok --num-workers 2
  lm tokenizer train --input a.txt --vocab-size 4096 --out data/tok --overwrite   # replace data/tok
  lm tokenizer train --input data/multi30k/train.en.gz data/multi30k/train.de.gz --vocab-size 8000 \\
      --special-token '<pad>' --special-token '<bos>' --special-token '<eos>' --out data/tok-multi30k
"""

TOKENIZE_EXAMPLES = """
  lm tokenize --tokenizer data/tok-tinystories --input data/TinyStoriesV2-GPT4-valid.txt \\
      --out data/tinystories-valid.bin
  lm tokenize --tokenizer data/tok-multi30k --input data/multi30k/train.en.gz \\
      --target data/multi30k/train.de.gz --out data/multi30k-train.bin      # a pair file
"""

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "summary.json")


def register(sub: argparse._SubParsersAction) -> None:
    tok = add_command(sub, "tokenizer", help="train a byte-level BPE tokenizer",
                      description="Byte-level BPE tokenizers.", examples=TRAIN_EXAMPLES)
    tsub = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    p = add_command(
        tsub,
        "train",
        help="train BPE on text files",
        description="Train a byte-level BPE tokenizer (GPT-2 pre-tokenizer) and write DIR/vocab.json, "
        "DIR/merges.txt, DIR/tokenizer.json and DIR/tokenizer_config.json (Hugging Face), and DIR/summary.json. "
        "The folder is built beside DIR and renamed into place when complete.",
        examples=TRAIN_EXAMPLES,
    )
    p.add_argument("--input", nargs="+", action="extend", required=True, metavar="FILE",
                   help="UTF-8 text file(s) (repeatable: --input a.txt --input b.txt trains on both); gzip "
                   "(told by its content) is decompressed to a temporary file first")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N", help="total vocabulary size")
    p.add_argument("--special-token", action="append", default=[], metavar="TOK",
                   help="a special token, e.g. '<|endoftext|>' (repeatable); documents are cut at it")
    add_out(p, "the tokenizer folder to write", metavar="DIR")
    p.add_argument("--num-workers", type=int, default=None, metavar="N", help="processes (default: CPU count)")
    p.add_argument("--holdout-bytes", type=int, default=1_000_000, metavar="B",
                   help="hold out about this many bytes at the end of the last input (at most 10%% of "
                   "the input) to measure bytes/token; 0 measures nothing")
    add_quiet(p)
    p.set_defaults(func=cmd_train)

    q = add_command(
        sub,
        "tokenize",
        help="encode a text file to a token file for training",
        description="Encode a UTF-8 text file into a flat token file (uint16 while the vocab fits, else uint32) "
        "plus a JSON sidecar FILE.bin.json, in parallel, in constant memory. With --target, encode a parallel "
        "corpus (two files aligned line by line) into a pair file for translation: FILE.bin (the ids), "
        "FILE.bin.idx (offsets) and FILE.bin.json.",
        examples=TOKENIZE_EXAMPLES,
    )
    q.add_argument("--tokenizer", required=True, metavar="DIR", help="directory written by `lm tokenizer train`")
    q.add_argument("--input", required=True, metavar="FILE",
                   help="UTF-8 text file; with --target, the source side of a parallel corpus (plain or .gz)")
    q.add_argument("--target", default=None, metavar="FILE",
                   help="the target side of a parallel corpus, aligned line by line with --input (plain or .gz): "
                   "writes a pair file (FILE.bin, FILE.bin.idx, FILE.bin.json) for translation")
    add_out(q, "the token file (or with --target the pair file) to write; its sidecar goes to FILE.bin.json",
            metavar="FILE.bin")
    q.add_argument("--num-workers", type=int, default=None, metavar="N", help="processes (default: CPU count)")
    add_quiet(q)
    q.set_defaults(func=cmd_tokenize)


def terminate_as_interrupt(prog: str, run: Callable[[], int], note: Callable[[], str] = lambda: "") -> int:
    """``run()`` with SIGTERM (``kill PID``, a job scheduler, a process manager) doing what Ctrl-C does:
    the worker processes killed, no temporary or partial output left. Then exit 143 (128 + SIGTERM)
    with one line, ``PROG: terminated`` (``lm tokenize: terminated``, or a script's name; then ``; NOTE``,
    what ``note()`` says is kept, if anything), as Ctrl-C exits 130.

    The signal goes to whatever handles Ctrl-C at that moment, so where a Ctrl-C waits (the renames
    that make a token file and its sidecar complete, :class:`lm.io.InterruptGuard`), SIGTERM waits too.
    """
    if threading.current_thread() is not threading.main_thread():  # no signal handler can be set there
        return run()
    received = []

    def handle(signum, frame) -> None:
        received.append(signum)
        on_interrupt = signal.getsignal(signal.SIGINT)
        if callable(on_interrupt):  # Python's own (raises KeyboardInterrupt), or an InterruptGuard's
            on_interrupt(signal.SIGINT, frame)
        else:  # SIGINT ignored (a background job of a script) or at its default
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        return run()
    except KeyboardInterrupt:
        if not received:
            raise
        kept = note()
        print(f"{prog}: terminated{'; ' + kept if kept else ''}", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_train(args: argparse.Namespace) -> int:
    def run() -> int:
        with contextlib.ExitStack() as stack:  # holds the decompressed copies of gzip inputs
            return _cmd_train(args, stack)

    return terminate_as_interrupt("lm tokenizer train", run)


def _cmd_train(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    from lm.tokenizer import Tokenizer, save_tokenizer_dir
    from lm.tokenizer.files import check_special_tokens_savable
    from lm.tokenizer.train import TrainStats, holdout_split, train_bpe, training_summary

    check_num_workers(args.num_workers)
    paths = [check_readable_file(p, "--input") for p in args.input]
    for p in paths:
        if p.stat().st_size == 0:
            raise ValueError(f"--input: file is empty: {str(p)!r}")
    if args.holdout_bytes < 0:
        raise ValueError(f"--holdout-bytes: must be >= 0, got {args.holdout_bytes}")
    with as_flags(special_tokens="--special-token"):
        check_special_tokens_savable(args.special_token)  # "@" could not be saved: refuse it before the work
    check_not_empty(args.out, "--out")
    out = Path(args.out)
    inputs = [("--input", p) for p in paths]
    output = dict(command="lm tokenizer train", overwrite=args.overwrite, inputs=inputs, files=TOKENIZER_FILES)
    with writing_out(out):
        check_output_dir(out, **output)  # before the work: a refusal costs nothing
    texts = decompressed_copies(paths, stack)  # the files themselves, or for gzip their decompressed text
    for p, text in zip(paths, texts):
        if text.stat().st_size == 0:
            raise ValueError(f"--input: file is empty once decompressed: {str(p)!r}")
        check_text_input(p, text)
    train_ranges, heldout = holdout_split(texts, args.special_token, args.holdout_bytes)

    stats = TrainStats()
    t0 = time.perf_counter()
    # (--num-workers and --special-token are checked above, by check_num_workers and check_special_tokens_savable)
    with as_flags(vocab_size="--vocab-size", input="--input"):
        vocab, merges = train_bpe(
            [p for p, _, _ in train_ranges], args.vocab_size, args.special_token,
            num_workers=args.num_workers, progress=not args.quiet, stats=stats, byte_ranges=train_ranges,
        )
    if len(vocab) < args.vocab_size:
        # training saw the input less its held-out tail: the limit is that of the training bytes
        held = 0 if heldout is None else heldout[2] - heldout[1]
        source = (f"the {stats.input_bytes:,} training bytes ({held:,} held out, see --holdout-bytes) give"
                  if held else f"the input's {stats.input_bytes:,} bytes give")
        raise ValueError(
            f"--vocab-size: {source} at most {len(vocab):,} tokens (it ran out of pairs to merge after "
            f"{len(merges):,} merges), not {args.vocab_size:,}; pass --vocab-size {len(vocab)} or less, or more text"
            + (", or a smaller --holdout-bytes" if held else "")
        )
    tok = Tokenizer(vocab, merges, args.special_token)
    t1 = time.perf_counter()
    with writing_out(out), replace_dir(out, **output) as tmp, \
            as_flags(special_tokens="--special-token", input="--input"):  # the held-out tail is read here
        save_tokenizer_dir(tok, tmp, hf=True)  # refuses a special token that clashes with a learned token
        t2 = time.perf_counter()
        try:  # it reads the held-out tail of the input: a failure there is the input's, not --out's
            summary = training_summary(tok, stats, paths, heldout, {"save": t2 - t1, "since_start": t2 - t0})
        except OSError as e:
            raise ValueError(f"--input: {e.filename or str(paths[0])!r} cannot be read: {e.strerror or e}") from None
        summary["inputs"] = [text_name(p) for p in summary["inputs"]]  # a name that is not UTF-8: as \xff
        with atomic_write(tmp / "summary.json") as f:
            json.dump(summary, f, indent=1, ensure_ascii=False)
    bpt = summary["bytes_per_token_heldout"]
    print(
        f"trained {len(vocab)} tokens on {stats.input_bytes / 1e6:.1f} MB in {summary['seconds']['total']:.1f}s "
        f"(pre-tokenize {stats.seconds['pretokenize']:.1f}s, merge {stats.seconds['merge']:.1f}s); "
        f"held-out bytes/token {'n/a' if bpt is None else f'{bpt:.3f}'}; peak RSS {summary['peak_rss_mb']:.0f} MB "
        f"-> {out}{os.sep}"
    )
    return 0


def max_workers() -> int:
    """The most processes ``--num-workers`` accepts: 4 per CPU, and at least 64. Each takes a share
    of the input and its own memory; any count had been taken (10**21), and 1,000 forked one
    process per 2 MB of the input on a 2-CPU machine."""
    return per_cpu_cap(64)


def check_num_workers(n: int | None) -> None:
    if n is not None:
        check_count(n, "--num-workers", floor=64)


def cmd_tokenize(args: argparse.Namespace) -> int:
    return terminate_as_interrupt("lm tokenize", lambda: _cmd_tokenize(args))


def _cmd_tokenize(args: argparse.Namespace) -> int:
    from lm.data import tokenize_file
    from lm.data.pairs import index_path, is_pair_file
    from lm.tokenizer import load_tokenizer_dir

    check_num_workers(args.num_workers)
    if args.target is not None:
        return _tokenize_pairs(args)
    src = check_readable_file(args.input, "--input")
    if is_gzip(src):  # by its content, as every command that reads text tells gzip
        raise ValueError(f"--input: {str(src)!r} is gzip-compressed; decompress it first (only parallel text, "
                         "with --target, is read from .gz)")
    if src.stat().st_size == 0:
        raise ValueError(f"--input: file is empty: {str(src)!r}")
    check_text_input(src, src)
    _check_outputs(args, [("--input", src)], what="a token file written by `lm tokenize` (it has no valid sidecar)")
    stale_index = index_path(args.out) if is_pair_file(args.out) else None  # a pair file being replaced
    tok = load_tokenizer_dir(args.tokenizer, argument="--tokenizer")
    t0 = time.perf_counter()
    with _out_errors(Path(args.out)), as_flags(input="--input"):
        meta = tokenize_file(tok, args.input, args.out, num_workers=args.num_workers, progress=not args.quiet)
    if stale_index is not None:
        stale_index.unlink(missing_ok=True)
    dt = time.perf_counter() - t0
    print(
        f"{meta['num_tokens']:,} tokens ({meta['dtype']}) from {meta['source_bytes'] / 1e6:.1f} MB in {dt:.1f}s "
        f"({meta['source_bytes'] / 1e6 / dt:.1f} MB/s, {meta['source_bytes'] / max(1, meta['num_tokens']):.3f} "
        f"bytes/token) -> {args.out}"
    )
    return 0


def _tokenize_pairs(args: argparse.Namespace) -> int:
    """``lm tokenize --target``: a parallel corpus to a pair file, over ``--num-workers`` processes."""
    from lm.data.pairs import tokenize_pairs
    from lm.tokenizer import load_tokenizer_dir

    src = check_readable_file(args.input, "--input", stream=True)  # read once, from the start: a pipe is fine
    tgt = check_readable_file(args.target, "--target", stream=True)
    inputs = [("--input", src), ("--target", tgt)]
    _check_outputs(args, inputs, what="a pair or token file written by `lm tokenize` (it has no valid sidecar)")
    tok = load_tokenizer_dir(args.tokenizer, argument="--tokenizer")
    t0 = time.perf_counter()
    with _out_errors(Path(args.out)):
        try:
            meta = tokenize_pairs(tok, src, tgt, args.out, progress=not args.quiet, num_workers=args.num_workers)
        except ValueError as e:  # name the argument: the message starts with the file it is about
            msg = str(e)
            arg = ("--input" if msg.startswith(repr(str(src)))
                   else "--target" if msg.startswith(repr(str(tgt))) else "--input/--target")
            raise ValueError(f"{arg}: {msg}") from None
    dt = time.perf_counter() - t0
    print(
        f"{meta['num_pairs']:,} pairs, {meta['num_tokens']:,} tokens ({meta['dtype']}) from "
        f"{(meta['source_bytes'] + meta['target_bytes']) / 1e6:.1f} MB in {dt:.1f}s -> {args.out}"
    )
    return 0


@contextlib.contextmanager
def _out_errors(out: Path) -> Iterator[None]:
    """An OSError writing the output (the file, its sidecar, its offsets) or making its folder, as
    one line naming ``--out`` and the path the user gave, not a temporary file beside it."""
    from lm.data.pairs import index_path
    from lm.data.token_file import sidecar_path

    try:
        yield
    except OSError as e:
        name = Path(e.filename) if isinstance(e.filename, str) and e.strerror else None
        if name in (out, sidecar_path(out), index_path(out)):
            raise ValueError(f"--out: cannot write {str(name)!r}: {e.strerror}") from None
        if name in out.parents:
            raise ValueError(f"--out: cannot make the folder {str(name)!r} for {str(out)!r}: {e.strerror}") from None
        raise


def _check_outputs(args: argparse.Namespace, inputs: list[tuple[str, Path]], what: str) -> None:
    """Check ``--out`` and the files `lm tokenize` writes beside it: its sidecar ``X.json`` and, for a
    pair file (or one being replaced, whose offsets go), its offsets ``X.idx``.

    Each one is replaced (with ``--overwrite``) only when it is recognisably ours, so a file that
    merely has the name (``notes.json`` beside ``--out notes``) is never written over; and nothing
    is written into the ``--tokenizer`` folder, an input.
    """
    from lm.data.pairs import index_path, is_pair_file
    from lm.data.token_file import is_token_file, sidecar_path

    check_not_empty(args.tokenizer, "--tokenizer")  # not the working folder (an input)
    check_not_empty(args.out, "--out")
    out = Path(args.out)
    tok = Path(args.tokenizer)
    check_no_symlink_loop(out, "--out")  # before resolving it below: a traceback on Python 3.11
    if tok.is_dir():
        where, folder = out.parent.resolve(), tok.resolve()
        if where == folder or folder in where.parents:
            raise ValueError(f"--out: {str(out)!r} is inside the --tokenizer folder {str(tok)!r}, an input; "
                             "choose another output")
    ours = lambda p: is_token_file(out) or is_pair_file(out)  # an earlier output of `lm tokenize`
    pair = lambda p: is_pair_file(out)  # its offsets: an earlier pair file's
    check_output_file(out, overwrite=args.overwrite, inputs=inputs, recognise=ours, what=what)
    check_output_file(sidecar_path(out), overwrite=args.overwrite, inputs=inputs, recognise=ours,
                      what="the sidecar of a token or pair file written by `lm tokenize`")
    if args.target is not None or is_pair_file(out):
        check_output_file(index_path(out), overwrite=args.overwrite, inputs=inputs, recognise=pair,
                          what="the offsets of a pair file written by `lm tokenize --target`")
