"""``lm translate``: translate sentences with an encoder–decoder checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import sys
import zlib
from collections.abc import Iterator
from functools import partial

from lm.cli.common import (
    add_checkpoint,
    add_command,
    add_compute,
    add_quiet,
    as_flags,
    check_fits,
    check_not_token_file,
    check_utf8,
    compute_dtype,
    model_fits,
    plural,
    quiet_on_closed_pipe,
    read_stdin,
    reading_stdin,
    require_architecture,
    stdin_stream,
)

EXAMPLES = """
  lm translate --checkpoint runs/multi30k-en-de "A man is riding a bicycle." "Two dogs play in the snow."
  lm translate --checkpoint runs/multi30k-en-de --input test.en --beam 4 > test.hyp.de
  zcat test.en.gz | lm translate --checkpoint runs/multi30k-en-de --input - --beam 1   # greedy
  lm translate --checkpoint runs/multi30k-en-de --beam 5 --nbest 3 "A man is riding a bicycle."
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "translate",
        help="translate sentences with an encoder-decoder checkpoint",
        description="Translate sentences, one per line, with a model trained on parallel text (architecture "
        "encoder_decoder). Prints one translation a line (--nbest N: N a sentence, with its number and score), in the "
        "input's order, as each batch is done (a translation never holds a line break: tokens holding one are never "
        "chosen); a progress bar on a "
        "terminal's stderr (none with --buffer-size). Beam search ranks hypotheses by log-probability over "
        "GNMT's length penalty.",
        examples=EXAMPLES,
    )
    add_checkpoint(p)
    p.add_argument("text", nargs="*", metavar="TEXT", help="sentences to translate (or use --input)")
    p.add_argument("--input", metavar="FILE",
                   help="a file of sentences, one a line ('-': standard input; gzip is read as such); lines end "
                        "at \\n (a \\r before it is dropped), as `lm eval --target` and sacrebleu read them")
    p.add_argument("--beam", type=int, default=4, metavar="K", help="beam size; 1 is greedy decoding")
    p.add_argument("--alpha", type=float, default=0.6, metavar="A", help="length penalty exponent (GNMT)")
    p.add_argument("--nbest", type=int, default=1, metavar="N",
                   help="print the N best translations of each sentence (N <= --beam), best first, each a line "
                        "'LINE<TAB>SCORE<TAB>TRANSLATION': LINE the sentence's number (from 1), SCORE its log P / "
                        "lp; a sentence with no translation (an empty line) gets no lines. 1: one translation a "
                        "line, without the two fields")
    p.add_argument("--batch-size", type=int, default=32, metavar="N", help="sentences decoded together")
    p.add_argument("--buffer-size", type=int, default=None, metavar="N",
                   help="with --input -: translate every N lines as they come in, printing each group's "
                        "translations before reading on (1: each line as it is read, as a co-process or a person "
                        "typing needs). Default: 1 at a terminal; else standard input is read to its end first, "
                        "and every line checked before the first is translated")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    add_compute(p)
    add_quiet(p)
    p.set_defaults(func=cmd_translate)


def decoding_fits(beam: int, batch_size: int) -> contextlib.AbstractContextManager[None]:
    """Within it, a batch that cannot fit in memory is one line naming ``--beam`` and
    ``--batch-size`` and their values (README, "Errors"), not torch's traceback: the decoder's
    cache holds ``batch_size × beam`` rows of keys and values. A model whose logits are not finite
    (NaN or inf: it overflows) is one line naming ``--checkpoint``."""
    return model_fits(f"--beam/--batch-size: a batch of up to {batch_size} {plural(batch_size, 'sentence')} at "
                      f"beam {beam}", "lower --beam or --batch-size")


def check_decoding_memory(model, batches: list[list[int]], beam: int, batch_size: int) -> None:
    """Refuse ``--beam``/``--batch-size`` when decoding the largest of ``batches`` (each the source
    lengths of one decoding batch) cannot fit (:func:`lm.generate.seq2seq.decoding_bytes`), before
    any decoding (and before ``lm eval``'s teacher forcing), in the words of :func:`decoding_fits`."""
    from lm.generate.seq2seq import decoding_bytes

    need = max((decoding_bytes(model, b, beam) for b in batches if b), default=0)
    check_fits(f"--beam/--batch-size: a batch of up to {batch_size} {plural(batch_size, 'sentence')} at beam {beam}",
               need, "decoding needs about", model.device, "lower --beam or --batch-size")


def check_alpha(alpha: float) -> None:
    """``--alpha``, checked as the decoders check it (:func:`lm.checks.check_alpha`), but before
    torch is imported, the model loaded and any output made, as ``--beam`` is."""
    from lm.checks import check_alpha as check

    with as_flags(alpha="--alpha"):
        check(alpha)


def progress_bar(total: int, quiet: bool):
    """A bar over ``total`` sentences on stderr, drawn only where stderr is a terminal (and not with
    ``--quiet``), as every progress bar of the project decides."""
    from tqdm import tqdm

    return tqdm(total=total, unit=" sentences", desc="translate", disable=True if quiet else None,
                file=sys.stderr)


def split_lines(text: str) -> list[str]:
    """The lines of ``text`` as every reader of a corpus here splits them (``lm.data.pairs``,
    sacrebleu): at ``\\n`` only, less one ``\\r`` before it. ``str.splitlines`` also splits at
    ``\\r``, ``\\x0c``, ``\\x85``, U+2028..., which scraped corpora hold inside sentences: the
    translations would stop lining up with the references.

    >>> split_lines("A dog\\u2028runs.\\r\\nTwo birds.\\n")
    ['A dog\\u2028runs.', 'Two birds.']
    """
    lines = text.split("\n")
    if lines[-1] == "":  # the final newline ends the last line; it does not start another
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_lines(args: argparse.Namespace) -> list[str]:
    from lm.io import check_readable_file, decode_utf8, utf8_error_place

    if args.text and args.input:
        raise ValueError("--input: give sentences as TEXT or in --input FILE, not both")
    if args.text:
        for k, text in enumerate(args.text, 1):
            check_utf8("TEXT", text, f"sentence {k}", "pass the text as UTF-8 or use --input")
            if "\n" in text.strip():  # "$(head -3 test.en)": three lines, one translation; lm serve refuses it too
                raise ValueError(f"TEXT: sentence {k} holds a line break, and a line is one sentence (one "
                                 "translation a line); pass each line as its own TEXT, or the lines in --input FILE")
        return list(args.text)
    if args.input == "":  # not "no sentences given": it was given, empty (a script's unset variable)
        raise ValueError("--input: must not be empty; pass a file, or - for standard input")
    if not args.input:
        raise ValueError("--input: no sentences given (pass TEXT... or --input FILE)")
    if args.input == "-":
        data = read_stdin("--input")
    else:  # read once, whole: a pipe or <(cmd) works too
        path = check_readable_file(args.input, "--input", stream=True)
        check_not_token_file(path, "--input", "give the sentences to translate as text, one a line (plain or gzip)")
        data = path.read_bytes()
    name = "standard input" if args.input == "-" else repr(args.input)
    if data[:2] == b"\x1f\x8b":  # gzip, as the Multi30k files come and `lm eval --data/--target` read them
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
            raise ValueError(f"--input: {name} is not a valid gzip file: {e}") from None
    text, bad = decode_utf8(data)
    if bad:  # where the first bad byte is, as lm eval --target and lm tokenize --target say it
        line, column, byte = utf8_error_place(data)
        raise ValueError(f"--input: {name} line {line}: not valid UTF-8 (byte 0x{byte:02x} at column {column}; "
                         f"{bad:,} {plural(bad, 'byte', 'bytes')} in all)")
    return split_lines(text)


@quiet_on_closed_pipe
def cmd_translate(args: argparse.Namespace) -> int:
    from lm.io import check_threads

    # the flags and the first input lines first, before torch is imported: a wrong flag or an
    # unreadable input is said at once, not after the seconds that importing torch takes
    if args.beam < 1:
        raise ValueError(f"--beam: must be >= 1, got {args.beam}")
    if not 1 <= args.nbest <= args.beam:
        raise ValueError(f"--nbest: must be in [1, --beam={args.beam}] (beam search keeps --beam finished "
                         f"translations), got {args.nbest}")
    check_alpha(args.alpha)  # before any work and any output, as --beam (translate() checks it per batch)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: must be >= 1, got {args.batch_size}")
    check_threads(args.threads)
    buffered = buffer_size(args)
    groups = stdin_groups(buffered) if buffered else iter([read_lines(args)])
    first = next(groups, [])  # before the model loads: a bad input costs nothing
    from tqdm import tqdm

    from lm.cli.common import load_model_and_tokenizer
    from lm.device import autocast, set_threads
    from lm.generate import beam_search_nbest, translate
    from lm.generate.sampling import NonFiniteLogitsError
    from lm.generate.seq2seq import check_source_length, line_break_ids

    set_threads(args.threads)
    model, tok, _ = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device)
    require_architecture(model, "encoder_decoder", args.checkpoint)
    cfg = model.config
    dtype = compute_dtype("lm translate", args, model.device)
    given = "TEXT sentence" if args.text else "--input line"  # what the user gave the sentences as
    where = "TEXT: sentence" if args.text else "--input: line"
    banned = line_break_ids(tok)  # one translation a line, whatever the model would emit
    out = sys.stdout
    done_lines = 0  # the lines of the groups before this one
    with autocast(model.device, dtype), progress_bar(len(first), args.quiet or bool(buffered)) as bar, \
            decoding_fits(args.beam, args.batch_size):
        for lines in itertools.chain([first], groups):
            sources = [tok.encode(line.strip()) for line in lines]
            for i, s in enumerate(sources):
                check_source_length(f"{where} {done_lines + i + 1}", len(s), cfg.context_length)
            check_decoding_memory(model, [[len(s) for s in sources[i : i + args.batch_size] if s]
                                          for i in range(0, len(sources), args.batch_size)], args.beam, args.batch_size)
            for start in range(0, len(sources), args.batch_size):
                chunk = sources[start : start + args.batch_size]
                todo = [j for j, s in enumerate(chunk) if s]  # an empty line translates to an empty line
                result = [[] for _ in chunk]
                if todo:
                    with as_flags(alpha="--alpha"):
                        try:
                            decode = translate if args.nbest == 1 else partial(beam_search_nbest, nbest=args.nbest)
                            done = decode(model, [chunk[j] for j in todo], beam_size=args.beam, alpha=args.alpha,
                                          vocab_size=tok.vocab_size,  # a model's vocabulary may be larger
                                          banned_ids=banned)
                        except NonFiniteLogitsError as e:  # its row in this batch, as the line the user gave
                            raise e.naming([done_lines + start + j + 1 for j in todo], given) from None
                    for j, ids in zip(todo, done):
                        result[j] = ids
                if args.nbest == 1:
                    text = "".join(tok.decode(ids).strip() + "\n" for ids in result)
                else:  # "LINE\tSCORE\tTRANSLATION" for each hypothesis, best first
                    text = "".join(f"{done_lines + start + j + 1}\t{h.score:.4f}\t{tok.decode(h.tokens).strip()}\n"
                                   for j, hyps in enumerate(result) for h in hyps)
                with tqdm.external_write_mode(file=out):  # the bar steps aside when both share a terminal
                    out.write(text)
                    out.flush()
                bar.update(len(chunk))
            done_lines += len(lines)
    return 0


def buffer_size(args: argparse.Namespace) -> int | None:
    """``--buffer-size``, or 1 where ``--input -`` is a terminal (each Enter had given nothing until
    Ctrl-D: seq2seq20); None: read the input whole first."""
    if args.buffer_size is not None:
        if args.buffer_size < 1:
            raise ValueError(f"--buffer-size: must be >= 1, got {args.buffer_size}")
        if args.input != "-" or args.text:
            raise ValueError("--buffer-size: applies to --input - (standard input), which is read as it comes")
        return args.buffer_size
    if args.input == "-" and not args.text and sys.stdin is not None and sys.stdin.isatty():
        return 1
    return None


def stdin_groups(size: int) -> Iterator[list[str]]:
    """Standard input's lines in groups of ``size``, each yielded once read (a line once its line
    end has come), so that its translations are printed before the next group is waited for, as
    fairseq-interactive's ``--buffer-size`` does. Lines split and checked as :func:`read_lines` does
    (one bad line: the error names it, and the groups before its own are translated)."""
    stream = stdin_stream("--input")
    with contextlib.suppress(OSError, AttributeError):
        if stream.peek(2)[:2] == b"\x1f\x8b":
            raise ValueError("--buffer-size: standard input is gzip, which is read whole; leave --buffer-size out "
                             "(or pipe it through zcat)")
    group, number = [], 0
    while True:
        with reading_stdin("--input"):
            raw = stream.readline()
        if not raw:
            break
        number += 1
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"--input: standard input line {number}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                             f"column {e.start + 1})") from None
        group += split_lines(text)  # its one line, without its line end
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group
