"""``lm eval``: loss, perplexity and bits per byte of a trained model on a token or text file."""

from __future__ import annotations

import argparse
import json

EXAMPLES = """examples:
  lm eval --checkpoint runs/cpu-small --data data/tinystories-valid-head.bin
  lm eval --checkpoint runs/cpu-small/checkpoints/best.pt --data stories.txt   # tokenized on the fly
  lm eval --checkpoint runs/cpu-small --data data/tinystories-valid-head.bin --stride 64   # sliding window
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a model: loss, perplexity, bits per byte",
        description="Evaluate a checkpoint on every token of a token file (from `lm tokenize`) or of a text "
        "file, which is tokenized on the fly with the run's tokenizer.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, metavar="PATH", help="checkpoint file or run directory")
    p.add_argument("--data", required=True, metavar="FILE", help="FILE.bin token file, or a UTF-8 text file")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None, metavar="N", help="evaluate the first N tokens only")
    p.add_argument("--stride", type=int, default=None, metavar="N",
                   help="slide the window by N tokens and score only the new ones, so each token sees at least "
                        "context_length - N tokens of context (default: the context length, windows do not overlap)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    import numpy as np

    from lm.cli.common import load_model_and_tokenizer
    from lm.data import read_token_file
    from lm.data.token_file import sidecar_path
    from lm.evaluate import evaluate_tokens
    from lm.io import check_readable_file

    data = check_readable_file(args.data, "--data")
    is_tokens = sidecar_path(data).is_file()
    model, tok, info = load_model_and_tokenizer(args.checkpoint, args.tokenizer, args.device,
                                                need_tokenizer=not is_tokens)
    if is_tokens:
        tokens, meta = read_token_file(data)
        if meta["vocab_size"] > model.config.vocab_size:
            raise ValueError(f"--data: {str(data)!r} was tokenized with {meta['vocab_size']} tokens, more than "
                             f"the model's vocab_size {model.config.vocab_size}")
        want = info.get("tokenizer_sha256") or (info.get("metadata") or {}).get("tokenizer_sha256")
        if want and meta.get("tokenizer_sha256") and meta["tokenizer_sha256"] != want:
            raise ValueError(f"--data: {str(data)!r} was tokenized with another tokenizer than the model was "
                             "trained with (sidecar checksum differs)")
        source_bytes = meta.get("source_bytes") or 0
        bpt = source_bytes / meta["num_tokens"] if source_bytes else None
    else:
        text = data.read_bytes().decode("utf-8", errors="replace")
        tokens = np.asarray(tok.encode(text), dtype=np.int64)
        bpt = data.stat().st_size / max(1, len(tokens))
    result = evaluate_tokens(model, tokens, batch_size=args.batch_size, max_tokens=args.max_tokens,
                             bytes_per_token=bpt, stride=args.stride, progress=not args.quiet)
    if args.json:
        print(json.dumps(result))
    else:
        bpb = "n/a (no source byte count)" if result["bits_per_byte"] is None else f"{result['bits_per_byte']:.4f}"
        print(f"loss {result['loss']:.4f}  perplexity {result['perplexity']:.3f}  bits/byte {bpb}  "
              f"({result['tokens']:,} tokens)")
    return 0
