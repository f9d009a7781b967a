"""``lm sample``: stream completions of a prompt from a trained model."""

from __future__ import annotations

import argparse
import sys
import time

from lm.cli.common import (
    add_checkpoint,
    add_command,
    add_compute,
    add_quiet,
    as_flags,
    check_not_token_file,
    check_utf8,
    compute_dtype,
    quiet_on_closed_pipe,
    read_stdin,
)

EXAMPLES = """
  lm sample --checkpoint runs/cpu-small --prompt "Once upon a time"
  lm sample --checkpoint runs/cpu-small/checkpoints/best.pt --prompt "Tom and Lily" \\
      --num-samples 3 --temperature 0.8 --top-p 0.95 --seed 1
  lm sample --checkpoint runs/cpu-small --prompt ""              # start a new document
  lm sample --checkpoint runs/cpu-small --prompt-file story.txt  # the prompt from a file
  echo "Once upon a time" | lm sample --checkpoint runs/cpu-small --prompt-file -   # or from stdin
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(
        sub,
        "sample",
        help="stream text from a trained model",
        description="Complete a prompt with a trained model, printing text as it is generated. Generation stops "
        "at <|endoftext|> or after --max-new-tokens; a prompt longer than the context keeps its last "
        "context_length tokens (the window slides).",
        examples=EXAMPLES,
    )
    add_checkpoint(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text to continue; '' starts a new document")
    prompt.add_argument("--prompt-file", metavar="FILE",
                        help="read the prompt from FILE ('-': standard input; a pipe or <(cmd) works too); "
                             "one line end at its end is dropped, as $(cat FILE) drops it")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="sample among the K likeliest tokens only (default: all tokens)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="for repeatable samples (0 to 2**64-1; folded into the 32 bits torch's CPU generator keeps) "
                   "(default: a fresh random seed each run)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N", help="samples of the prompt, one after another")
    p.add_argument("--compile", action="store_true",
                   help="decode with a compiled fixed-shape step (seconds to compile, then faster per token)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    add_compute(p)
    add_quiet(p)
    p.set_defaults(func=cmd_sample)


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt from ``--prompt`` or ``--prompt-file`` (``-`` is stdin), checked to be valid text.

    A file's one final line end goes (as llama.cpp's ``-f`` drops it): a text file, or ``echo "Once
    upon a time" |``, ends in one, and the model would start after a line break, often ending the
    story at once; a prompt meant to end in a line break ends in two, or goes through ``--prompt``."""
    from lm.io import check_readable_file, utf8_error_place

    if args.prompt is not None:
        check_utf8("--prompt", args.prompt, remedy="pass the text as UTF-8 or use --prompt-file")
        return args.prompt
    if args.prompt_file == "-":
        data = read_stdin("--prompt-file")
    else:
        path = check_readable_file(args.prompt_file, "--prompt-file", stream=True)
        check_not_token_file(path, "--prompt-file", "give the prompt as text")  # not a prompt of NULs
        try:
            data = path.read_bytes()
        except OSError as e:  # /dev/stdin when it is a socket, say: "[Errno 6] ..." would name nothing
            raise ValueError(f"--prompt-file: cannot read {str(path)!r}: {e.strerror or e}") from None
    data = data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data
    place = utf8_error_place(data)
    if place is not None:  # line and column from 1, as lm translate --input says it (it said "byte 18": cli21)
        where = "standard input" if args.prompt_file == "-" else repr(args.prompt_file)
        line, column, byte = place
        raise ValueError(f"--prompt-file: {where} line {line}: not valid UTF-8 (byte 0x{byte:02x} at column {column})")
    return data.decode("utf-8")


@quiet_on_closed_pipe
def cmd_sample(args: argparse.Namespace) -> int:
    from lm.checks import check_sampling_args, check_seed
    from lm.io import check_threads

    # the flags and the prompt first, before torch is imported: a wrong one is said at once, not
    # after the seconds that importing torch takes
    with as_flags(temperature="--temperature", top_p="--top-p", top_k="--top-k"):
        check_sampling_args(args.temperature, args.top_p, args.top_k)
    if args.num_samples < 1:
        raise ValueError(f"--num-samples: must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    if args.seed is not None:
        check_seed(args.seed, "--seed")
    check_threads(args.threads)
    prompt = read_prompt(args)
    import torch

    from lm.cli.common import load_model_and_tokenizer, require_architecture
    from lm.device import autocast, set_threads
    from lm.generate import TextStreamer, generate
    from lm.generate.sampling import NonFiniteLogitsError, generator_seed

    set_threads(args.threads)
    loaded = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device)
    model, tok, _ = loaded
    require_architecture(model, "decoder_lm", args.checkpoint)
    device = model.device
    dtype = compute_dtype("lm sample", args, device)
    eos = tok.eot_id
    prompt_ids = tok.encode(prompt)
    if not prompt_ids:
        if eos is None:
            name = "standard input" if args.prompt_file == "-" else repr(args.prompt_file)
            what = "--prompt: empty" if args.prompt is not None else f"--prompt-file: {name} is empty"
            raise ValueError(f"{what}, and the tokenizer has no <|endoftext|> to start a document with")
        prompt_ids = [eos]
    gen = torch.Generator()  # on the CPU, as lm serve's: sampling draws there, so a seed gives the same tokens anywhere
    if args.seed is not None:
        # torch keeps the low 32 bits of a seed: seeds from 2**32 on are hashed (those below are kept)
        gen.manual_seed(generator_seed(args.seed))
    else:
        gen.seed()
    out = _Output(sys.stdout)
    total, t0 = 0, time.perf_counter()
    for i in range(args.num_samples):
        if i:
            out.write("\n" + "-" * 40 + "\n")
        out.write(prompt)
        streamer = TextStreamer(tok, skip=() if eos is None else (eos,))

        def emit(row: int, token: int, streamer=streamer) -> None:
            out.write(streamer.push(token))

        try:
            with autocast(device, dtype), as_flags(temperature="--temperature", top_p="--top-p", top_k="--top-k",
                                                   max_new_tokens="--max-new-tokens"):
                new = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature,
                               top_p=args.top_p, top_k=args.top_k, eos_id=eos, generator=gen, on_token=emit,
                               vocab_size=tok.vocab_size, compile=args.compile)
        except NonFiniteLogitsError as e:  # a diverged or overflowing model: no token after that is text
            out.end_line()  # the error line goes below the text streamed so far
            raise ValueError(f"--checkpoint: {e}") from None
        except BrokenPipeError:
            raise
        except BaseException:  # any other error (or Ctrl-C): its line goes below the text too, not after it
            out.end_line()
            raise
        out.write(streamer.flush() + "\n")
        total += len(new)
    dt = time.perf_counter() - t0
    if not args.quiet:
        note = ", the step's compilation included" if args.compile else ""
        print(f"[{total} tokens in {dt:.1f}s, {total / dt:.0f} tokens/s{note}; {loaded.source}]", file=sys.stderr)
    return 0


class _Output:
    """Standard output, flushed at every write, remembering whether a line was left open: an error
    raised after the prompt was echoed then starts on a line of its own (on stderr, which a
    terminal shows interleaved), not straight after the text."""

    def __init__(self, stream):
        self.stream, self.open_line = stream, False

    def write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.open_line = not text.endswith("\n")

    def end_line(self) -> None:
        if self.open_line:
            try:
                self.write("\n")
            except OSError:  # the reader is gone: the error line is all that is left to say
                pass
