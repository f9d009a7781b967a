"""``lm sample``: stream completions of a prompt from a trained model."""

from __future__ import annotations

import argparse
import codecs
import sys
import time

EXAMPLES = """examples:
  lm sample --checkpoint runs/cpu-small --prompt "Once upon a time"
  lm sample --checkpoint runs/cpu-small/checkpoints/best.pt --prompt "Tom and Lily" \\
      --num-samples 3 --temperature 0.8 --top-p 0.95 --seed 1
  lm sample --checkpoint runs/cpu-small --prompt ""      # start a new document
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sample",
        help="stream text from a trained model",
        description="Complete a prompt with a trained model, printing text as it is generated. Generation stops "
        "at <|endoftext|> or after --max-new-tokens; a prompt longer than the context keeps its last "
        "context_length tokens (the window slides).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="checkpoint file or run directory")
    p.add_argument("--prompt", required=True, help="text to continue; '' starts a new document")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="0 = greedy (default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="for repeatable samples")
    p.add_argument("--num-samples", type=int, default=1, metavar="N")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_sample)


def cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from lm.cli.common import load_model_and_tokenizer
    from lm.generate import generate
    from lm.generate.sampling import check_sampling_args

    check_sampling_args(args.temperature, args.top_p, args.top_k)
    if args.num_samples < 1:
        raise ValueError(f"--num-samples: must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    model, tok, _ = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device)
    eos = tok.token_to_id.get(b"<|endoftext|>")
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        if eos is None:
            raise ValueError("--prompt: empty, and the tokenizer has no <|endoftext|> to start a document with")
        prompt_ids = [eos]
    gen = torch.Generator(device=next(model.parameters()).device)
    if args.seed is not None:
        gen.manual_seed(args.seed)
    else:
        gen.seed()
    out = sys.stdout
    total, t0 = 0, time.perf_counter()
    for i in range(args.num_samples):
        if i:
            out.write("\n" + "-" * 40 + "\n")
        out.write(args.prompt)
        out.flush()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

        def emit(row: int, token: int, decoder=decoder) -> None:
            if token == eos:
                return
            out.write(decoder.decode(tok.vocab[token]))
            out.flush()

        new = generate(model, prompt_ids, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                       top_k=args.top_k, eos_id=eos, generator=gen, on_token=emit)
        out.write(decoder.decode(b"", final=True) + "\n")
        total += len(new)
    dt = time.perf_counter() - t0
    print(f"[{total} tokens in {dt:.1f}s, {total / dt:.0f} tokens/s]", file=sys.stderr)
    return 0
