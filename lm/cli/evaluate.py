"""``lm eval``: loss, perplexity and bits per byte of a trained model on a token or text file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lm.cli.common import (
    add_checkpoint,
    add_command,
    add_compute,
    add_quiet,
    as_flags,
    compute_dtype,
    quiet_on_closed_pipe,
)

EXAMPLES = """
  lm eval --checkpoint runs/cpu-small --data data/tinystories-valid-head.bin
  lm eval --checkpoint runs/cpu-small/checkpoints/best.pt --data stories.txt   # tokenized on the fly
  lm eval --checkpoint runs/cpu-small --data data/tinystories-valid-head.bin --stride 64   # sliding window
  lm eval --checkpoint runs/multi30k-en-de --data test_2016_flickr.en.gz --target test_2016_flickr.de.gz  # BLEU, chrF
"""


BEAM, ALPHA = 4, 0.6  # `lm translate`'s defaults: its output through sacrebleu gives lm eval's BLEU


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "eval",
        help="evaluate a model: loss, perplexity, bits per byte",
        description="Evaluate a checkpoint on every token of a token file (from `lm tokenize`, with its sidecar) "
        "or of a UTF-8 text file, which is tokenized on the fly with the run's tokenizer; bits per byte count "
        "the bytes of the tokens scored. A translation model (--target) is scored pair by pair: the loss by "
        "teacher forcing on the pairs as training reads them, BLEU and chrF of its translations of the "
        "source lines as `lm translate` reads them (stripped of surrounding whitespace); a source line "
        "longer than the context is refused, as `lm translate` refuses it.",
        examples=EXAMPLES,
    )
    add_checkpoint(p)
    p.add_argument("--data", required=True, metavar="FILE",
                   help="FILE.bin token file, or a UTF-8 text file; for a translation model the source sentences")
    p.add_argument("--target", default=None, metavar="FILE",
                   help="translation models: the reference translations, one a line (plain or gzip, as --data); "
                        "a pair whose reference is longer than the context is translated and scored in BLEU and "
                        "chrF but left out of the loss (n/a when every pair is)")
    p.add_argument("--beam", type=int, default=None, metavar="K",
                   help=f"translation models (--target): beam size of the translations that BLEU and chrF score, "
                        f"as `lm translate --beam` (default {BEAM})")
    p.add_argument("--alpha", type=float, default=None, metavar="A",
                   help=f"translation models (--target): length penalty exponent (GNMT) of the beam search, as "
                        f"`lm translate --alpha` (default {ALPHA})")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="windows (or sentence pairs) a forward pass")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="evaluate the first N tokens only (with --target: the first N sentence pairs) (default: "
                   "all of them)")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="slide the window by N tokens and score only the new ones, so each token after the first "
                        "window sees at least context_length - N tokens of context (default: the context length, "
                        "windows do not overlap)")
    add_compute(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_quiet(p)
    p.set_defaults(func=cmd_eval)


def data_kind(path: Path) -> str:
    """``"tokens"`` or ``"text"``, from the sidecar and the content together; ambiguous files are refused."""
    from lm.data.token_file import read_token_meta, sidecar_path
    from lm.io import is_gzip, looks_like_text

    side = sidecar_path(path)
    text_like = looks_like_text(path)
    if side.is_file():
        # A short token file can read as UTF-8 (ids of 256+ hold no NUL byte): a sidecar of this
        # format that agrees with the file's size decides it.
        try:
            read_token_meta(path)
            return "tokens"
        except ValueError:
            pass
        if text_like and path.stat().st_size > 0:
            raise ValueError(f"--data: {str(path)!r} reads as UTF-8 text but has a token-file sidecar {side.name!r}; "
                             "if it is text, move the sidecar away")
        return "tokens"
    if is_gzip(path):
        raise ValueError(f"--data: {str(path)!r} is gzip-compressed; decompress it first (only a translation "
                         "model's --data and --target may be gzip)")
    if path.suffix == ".bin" or not text_like:  # said as it is: a .bin of UTF-8 had been "not UTF-8 text"
        what = "is named .bin (a token file's name)" if text_like else "is not UTF-8 text"
        raise ValueError(f"--data: {str(path)!r} has no sidecar {side.name!r} and {what}; pass a token "
                         "file written by `lm tokenize` (with its sidecar) or a text file"
                         + (" under another name" if text_like else ""))
    return "text"


@quiet_on_closed_pipe
def cmd_eval(args: argparse.Namespace) -> int:
    from lm.cli.translate import check_alpha
    from lm.io import check_threads

    # the flags first, before torch is imported: a wrong one is said at once
    for name in ("batch_size", "max_tokens", "stride", "beam"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if args.alpha is not None:
        check_alpha(args.alpha)
    check_threads(args.threads)
    import warnings

    import numpy as np

    from lm.cli.common import load_model_and_tokenizer, model_fits, plural
    from lm.data import read_token_file
    from lm.data.token_file import bytes_per_token
    from lm.device import autocast, set_threads
    from lm.evaluate import evaluate_tokens, token_byte_lengths
    from lm.io import check_readable_file, decode_utf8, replaced_utf8_message, utf8_error_place
    from lm.tokenizer import check_tokenizer_checksum

    set_threads(args.threads)
    if args.target is not None:
        if args.stride is not None:  # it would be ignored: a translation is scored pair by pair
            raise ValueError(f"--stride: slides a language model's window over a token stream; a translation "
                             f"model is scored pair by pair (--target), got --stride {args.stride}")
        return eval_translation(args)
    data = check_readable_file(args.data, "--data")
    try:
        kind, unreadable = data_kind(data), None
    except ValueError as e:  # said after the model's kind: a translation model's fault is the missing --target
        kind, unreadable = None, e
    loaded = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device, need_tokenizer=kind == "text")
    model, tok, info = loaded
    if model.config.architecture != "decoder_lm":
        raise ValueError(f"--target: {args.checkpoint!r} is a translation model: pass the source sentences as "
                         "--data and the reference translations as --target")
    for flag, value in (("--beam", args.beam), ("--alpha", args.alpha)):  # they would be ignored, as --stride
        if value is not None:
            raise ValueError(f"{flag}: sets the beam search of a translation model's BLEU (--target); "
                             f"{args.checkpoint!r} is a language model, scored without decoding, got {flag} {value}")
    if unreadable is not None:
        raise unreadable
    ctx = model.config.context_length
    if args.stride is not None and args.stride > ctx:
        raise ValueError(f"--stride: must be between 1 and the context length {ctx}, got {args.stride}")
    if kind == "tokens":
        try:
            tokens, meta = read_token_file(data)
        except ValueError as e:
            raise ValueError(f"--data: {e}") from None
        if meta["vocab_size"] > model.config.vocab_size:
            raise ValueError(f"--data: {str(data)!r} was tokenized with {meta['vocab_size']} tokens, more than "
                             f"the model's vocab_size {model.config.vocab_size}")
        check_tokenizer_checksum(meta["tokenizer_sha256"], info["tokenizer_sha256"], argument="--data",
                                 what=f"the tokenizer of {str(data)!r}", against=f"the model {args.checkpoint!r}")
        if tok is not None and meta["vocab_size"] > tok.vocab_size:
            raise ValueError(f"--data: {str(data)!r} was tokenized with {meta['vocab_size']} tokens, more than "
                             f"the tokenizer's {tok.vocab_size}")
    else:
        raw = data.read_bytes()
        text, bad = decode_utf8(raw)
        if bad:  # where the first is, as `lm tokenize` says it: the count alone left a large file to search
            line, column, _ = utf8_error_place(raw)
            warnings.warn(replaced_utf8_message("--data", {str(data): bad}, str(data), line, column,
                                                ", which bits/byte counts as its 3 bytes"), stacklevel=1)
        del raw  # the text is kept, not its bytes too
        tokens = np.asarray(tok.encode(text), dtype=np.int64)
    if len(tokens) < 2:
        raise ValueError(f"--data: {str(data)!r} holds {len(tokens)} {plural(len(tokens), 'token')}; "
                         "at least 2 are needed to predict one")
    # The bytes of the tokens scored, not a whole-file average: --max-tokens may stop anywhere (and
    # the file's head may be English, its tail code or Japanese), and the first token is never scored.
    token_bytes = None if tok is None else token_byte_lengths(tok)
    whole_file = args.max_tokens is None or args.max_tokens + 1 >= len(tokens)
    # No tokenizer (a run trained without data.tokenizer): when every token is scored, the sidecar's
    # bytes per token is a close estimate (it counts the first token too); for a prefix it may not be.
    estimate = bytes_per_token(meta) if token_bytes is None and kind == "tokens" and whole_file else None
    device = next(model.parameters()).device
    dtype = compute_dtype("lm eval", args, device)
    window = min(ctx, len(tokens) - 1 if args.max_tokens is None else min(len(tokens) - 1, args.max_tokens))
    fits = model_fits(f"--batch-size: a batch of up to {args.batch_size} {plural(args.batch_size, 'window')} of "
                      f"{window} {plural(window, 'token')}", "lower --batch-size")
    with autocast(device, dtype), as_flags(data="--data"), fits:
        result = evaluate_tokens(model, tokens, batch_size=args.batch_size, max_tokens=args.max_tokens,
                                 token_bytes=token_bytes, bytes_per_token=estimate, stride=args.stride,
                                 progress=not args.quiet)
    result.update(checkpoint_used(loaded))
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        if result["bits_per_byte"] is None:
            bpb = "n/a (no tokenizer to count the scored bytes: pass --tokenizer DIR)"
        else:
            bpb = f"{result['bits_per_byte']:.4f}" + (" (from the file's bytes per token)" if estimate else "")
        nbytes = "" if result["bytes"] is None else f", {result['bytes']:,} {plural(result['bytes'], 'byte')}"
        print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  bits/byte {bpb}  "
              f"({result['tokens']:,} {plural(result['tokens'], 'token')}{nbytes})  {checkpoint_line(result)}")
    return 0


def checkpoint_used(loaded) -> dict:
    """The weights a result is of: the file ``--checkpoint`` resolved to (a run folder: its newest
    weights) and the training step it holds (None when it records none)."""
    return {"checkpoint": str(loaded.path), "step": loaded.info.get("iteration")}


def checkpoint_line(result: dict) -> str:
    """What the result line says of :func:`checkpoint_used`: "checkpoint runs/a/model.safetensors (step 40)"."""
    step = "" if result["step"] is None else f" (step {result['step']})"
    return f"checkpoint {result['checkpoint']}{step}"


def read_pairs(src_path: Path, tgt_path: Path) -> list[tuple[str, str]]:
    """The sentence pairs of ``--data`` and ``--target`` (:func:`lm.data.pairs.read_parallel`), or a
    one-line ValueError naming the argument at fault: also a token or pair file given for a text."""
    from lm.data.pairs import is_pair_file, read_parallel
    from lm.data.token_file import is_token_file

    for path, arg in ((src_path, "--data"), (tgt_path, "--target")):
        if is_pair_file(path) or is_token_file(path):
            what = "a translation pair file (`lm tokenize --target`)" if is_pair_file(path) else \
                "a token file (`lm tokenize`)"
            raise ValueError(f"{arg}: {str(path)!r} is {what}; with --target, --data and --target are the source "
                             "sentences and their reference translations as text, one a line (plain or gzip)")
    try:
        pairs = list(read_parallel(src_path, tgt_path))
    except ValueError as e:  # name the argument: the message starts with the file it is about
        msg = str(e)
        arg = "--data" if msg.startswith(repr(str(src_path))) else \
            "--target" if msg.startswith(repr(str(tgt_path))) else "--data/--target"
        raise ValueError(f"{arg}: {msg}") from None
    if not pairs:
        raise ValueError(f"--data/--target: {str(src_path)!r} and {str(tgt_path)!r} hold no lines")
    return pairs


def eval_translation(args: argparse.Namespace) -> int:
    """Loss and perplexity by teacher forcing, BLEU and chrF of the translations, on a file pair."""
    import sys

    from lm.cli.common import load_model_and_tokenizer, plural
    from lm.cli.translate import check_decoding_memory, decoding_fits, progress_bar
    from lm.device import autocast
    from lm.evaluate import bleu_chrf, collate_pairs, evaluate_pairs
    from lm.generate import translate
    from lm.generate.sampling import NonFiniteLogitsError
    from lm.generate.seq2seq import check_source_length, line_break_ids
    from lm.io import check_readable_file

    beam = BEAM if args.beam is None else args.beam  # checked by cmd_eval, as --alpha
    alpha = ALPHA if args.alpha is None else args.alpha
    src_path = check_readable_file(args.data, "--data", stream=True)  # read once, line by line: <(cmd) works
    tgt_path = check_readable_file(args.target, "--target", stream=True)
    try:
        pairs, unreadable = read_pairs(src_path, tgt_path), None
    except ValueError as e:  # said after the model's kind: a language model's fault is --target itself
        pairs, unreadable = None, e
    loaded = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device, need_tokenizer=False)
    model, tok, _ = loaded
    cfg = model.config
    if cfg.architecture != "encoder_decoder":
        raise ValueError(f"--target: {args.checkpoint!r} is a language model; evaluate it on --data alone")
    if unreadable is not None:
        raise unreadable
    if tok is None:  # (asked for only now: a language model's fault is --target, whatever its run holds)
        raise ValueError(f"--tokenizer: no tokenizer/ beside {str(loaded.path)!r}; pass --tokenizer DIR")
    if args.max_tokens is not None:
        pairs = pairs[: args.max_tokens]  # sentences, for a translation model
    # Translated: each source line as `lm translate` reads it, stripped. Scored by teacher forcing:
    # each pair as training reads it (`lm tokenize --target`, lm.data.pairs: the whole line), so that
    # the loss on a validation pair file's text is the loss training reports on it.
    src = [tok.encode(s.strip()) for s, _ in pairs]
    src_raw = [tok.encode(s) for s, _ in pairs]
    ref = [tok.encode(t) for _, t in pairs]
    fits = cfg.context_length - 1  # room for <eos> (source) and <bos> (target)
    for i, s in enumerate(src):  # it cannot be translated: scoring "" would lower BLEU without a word
        check_source_length(f"--data: line {i + 1} of {str(src_path)!r}", len(s), cfg.context_length)
    keep = [i for i in range(len(pairs)) if len(ref[i]) <= fits and len(src_raw[i]) <= fits]
    if len(keep) < len(pairs):  # a source too long only with its surrounding whitespace counts as a pair
        k, n = len(pairs) - len(keep), len(pairs)
        what = "reference" if all(len(s) <= fits for s in src_raw) else "pair"
        print(f"lm eval: warning: {k} of {n} {plural(n, what)} {plural(k, 'is', 'are')} longer than the {fits} "
              f"tokens a sentence may hold (context {cfg.context_length}, one kept for <bos> or <eos>): "
              f"{plural(k, 'its pair is', 'their pairs are')} left out of the loss, not of BLEU and chrF",
              file=sys.stderr)
    dtype = compute_dtype("lm eval", args, model.device)
    size = args.batch_size
    banned = line_break_ids(tok)  # as `lm translate`: one translation a line
    order = sorted(range(len(src)), key=lambda i: len(src[i]))  # similar lengths decode together
    check_decoding_memory(model, [[len(src[i]) for i in order[j : j + size] if src[i]]
                                  for j in range(0, len(order), size)], beam, size)  # before the teacher forcing
    with autocast(model.device, dtype), decoding_fits(beam, size):
        result = {"loss": None, "perplexity": None, "tokens": 0}  # no pair fits: no loss, still BLEU
        if keep:
            result = evaluate_pairs(model, (
                collate_pairs([src_raw[i] for i in keep[j : j + size]], [ref[i] for i in keep[j : j + size]],
                              pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id, device=model.device)
                for j in range(0, len(keep), size)))
        hyps = [""] * len(src)
        with progress_bar(len(order), args.quiet) as bar:
            for j in range(0, len(order), size):
                rows = [i for i in order[j : j + size] if src[i]]  # an empty source: an empty translation
                if rows:
                    try:
                        done = translate(model, [src[i] for i in rows], beam_size=beam, alpha=alpha,
                                         vocab_size=tok.vocab_size, banned_ids=banned)
                    except NonFiniteLogitsError as e:  # its row in this batch, as the line of --data
                        raise e.naming([i + 1 for i in rows], "--data line") from None
                    for i, ids in zip(rows, done):
                        hyps[i] = tok.decode(ids).strip()
                bar.update(len(order[j : j + size]))
    result.update(bleu_chrf(hyps, [t.strip() for _, t in pairs]), sentences=len(pairs), beam=beam, alpha=alpha,
                  **checkpoint_used(loaded))
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        loss = "n/a" if result["loss"] is None else f"{result['loss']:.4f}"
        ppl = "n/a" if result["perplexity"] is None else f"{result['perplexity']:.3f}"
        print(f"loss {loss}  perplexity {ppl}  BLEU {result['bleu']:.2f}  chrF {result['chrf']:.2f}  "
              f"({len(pairs):,} {plural(len(pairs), 'sentence')}, beam {beam}, alpha {alpha:g})  "
              f"{checkpoint_line(result)}")
        print(f"  {result['bleu_signature']}\n  {result['chrf_signature']}")
    return 0
