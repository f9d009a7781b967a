"""Tiny Shakespeare in at most 100 seconds of wall-clock, tokenizer included: validation bits per byte.

    python scripts/shakespeare.py                      # needs LM_TEST_DATA (tinyshakespeare.txt)
    python scripts/shakespeare.py --budget 100 --out runs/shakespeare --seed 1

The first 90% of the bytes train (tokenizer and model), the last 10% validate. The clock starts
before the tokenizer is trained; model training gets what is left of the budget after a margin
for the final evaluation, with the cosine schedule running on elapsed time (train.max_time).
Bits per byte = the validation loss summed over every scored token, in bits, over those tokens'
bytes (every validation token but the first). The headline figure slides the evaluation window by half the
context (``--eval-stride``), so every token after the first window is predicted from at least
64 tokens; the figure for windows that do not overlap is printed too, computed after the clock.
Every option is checked before anything runs, each error naming the option and its value (exit 2).

The defaults are the best of a sweep (its table and nanoGPT's CPU recipe for comparison are in
docs/benchmarks.md): vocab 1,024, d_model 128, 3 layers of 4 heads, context 128, batch 16,
bfloat16 autocast where the CPU has bfloat16 instructions, the hand-written einsum attention
(torch's fused kernel has a slow backward under bfloat16 on CPU), peak learning rate 7e-3
decayed to 0, and weight decay 1.0 on every matrix including the embeddings (the run reads the
text about six times: it is limited by overfitting as much as by compute).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path


def error(message: str) -> int:
    """One line on stderr, and the status of a bad argument (2), as `lm` commands give."""
    print(f"shakespeare.py: error: {message}", file=sys.stderr)
    return 2


def main() -> int:
    t_start = time.perf_counter()
    from lm.cli.common import WrittenHelpParser

    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("LM_TEST_DATA"))
    ap.add_argument("--out", default="runs/shakespeare", help="the run's folder: data, tokenizer, run, result.json")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier output of this script in --out")
    ap.add_argument("--budget", type=float, default=100.0, help="total wall-clock seconds")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--context-length", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=3)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--attn-impl", default="einsum", choices=["sdpa", "einsum"],
                    help="einsum: about 1.25x faster steps than sdpa here under bfloat16 autocast on CPU")
    ap.add_argument("--d-ff", type=int, default=None, help="feed-forward width (default: the SwiGLU default)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-lr", type=float, default=7e-3)
    ap.add_argument("--warmup-fraction", type=float, default=0.03, help="of the training time")
    ap.add_argument("--schedule", default="cosine", choices=["cosine", "wsd"])
    ap.add_argument("--decay-fraction", type=float, default=0.2, help="wsd: share of the time spent decaying")
    ap.add_argument("--min-lr-ratio", type=float, default=0.0, help="final learning rate / peak")
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--weight-decay", type=float, default=1.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--no-decay-embeddings", dest="decay_embeddings", action="store_false",
                    help="leave the embedding table out of weight decay")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="autocast dtype; auto: bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16, AMX), "
                         "else float32 (bfloat16 is slower than float32 there)")
    ap.add_argument("--eval-stride", type=int, default=None,
                    help="sliding-window evaluation stride (default: half the context)")
    ap.add_argument("--tie-embeddings", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--eval-margin", type=float, default=4.0, help="seconds kept for the final evaluation")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.dtype == "auto":
        from lm.device import cpu_has_bfloat16

        args.dtype = "bfloat16" if cpu_has_bfloat16() else "float32"
    if not args.data:
        return error("--data: give the folder holding tinyshakespeare.txt (or set LM_TEST_DATA)")
    if not (Path(args.data) / "tinyshakespeare.txt").is_file():
        return error(f"--data: {args.data!r} holds no tinyshakespeare.txt")

    from lm.io import claim_dir

    out = Path(args.out)
    try:
        check_args(args)  # before anything runs: a typo must not cost the budget
    except ValueError as e:
        return error(str(e))

    def claimed() -> int:  # a Ctrl-C or SIGTERM (training's too) removes --out, or puts back the one replaced
        try:
            with claim_dir(out, command="scripts/shakespeare.py", overwrite=args.overwrite, argument="--out",
                           files=("data", "tokenizer", "run", "result.json")):
                return run(args, out, t_start)
        except ValueError as e:
            return error(str(e))

    from lm.cli.common import interruptible_script

    return interruptible_script("shakespeare.py", claimed)


# the option that sets each config key, to name it when the config refuses a value
OPTIONS = {"vocab_size": "--vocab-size", "context_length": "--context-length", "d_model": "--d-model",
           "num_layers": "--num-layers", "num_heads": "--num-heads", "d_ff": "--d-ff", "dropout": "--dropout",
           "batch_size": "--batch-size", "max_lr": "--max-lr", "min_lr": "--min-lr-ratio",
           "warmup_iters": "--warmup-fraction", "decay_fraction": "--decay-fraction", "beta2": "--beta2",
           "weight_decay": "--weight-decay", "grad_clip": "--grad-clip", "seed": "--seed"}


def check_args(args) -> None:
    """Every setting checked before anything runs (the tokenizer takes seconds, training the whole
    budget), each error naming the option and the value given; fills in the evaluation stride."""
    from lm.train import config_from_dict
    from lm.train.config import name_options

    if not args.eval_margin >= 0:
        raise ValueError(f"--eval-margin: must be >= 0, got {args.eval_margin:g}")
    if not args.budget > args.eval_margin:
        raise ValueError(f"--budget: must be more than the {args.eval_margin:g} s kept for the final evaluation "
                         f"(--eval-margin), got {args.budget:g}")
    if not math.isfinite(args.budget):  # the run's train.max_time: named here, not as that key
        raise ValueError(f"--budget: must be a finite number of seconds, got {args.budget:g}")
    if args.vocab_size < 256:
        raise ValueError(f"--vocab-size: must be at least 256 (one token a byte), got {args.vocab_size}")
    if not 0 <= args.warmup_fraction < 1:
        raise ValueError(f"--warmup-fraction: must be in [0, 1), got {args.warmup_fraction:g}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio: must be in [0, 1], got {args.min_lr_ratio:g}")
    try:
        config_from_dict(make_config(args, Path(args.out), vocab_size=args.vocab_size,
                                     tok_dir=Path(args.out) / "tokenizer", train_seconds=args.budget))
    except ValueError as e:
        raise ValueError(name_options(str(e), OPTIONS, args)) from None
    if args.eval_stride is None:
        args.eval_stride = args.context_length // 2
    if not 1 <= args.eval_stride <= args.context_length:
        raise ValueError(f"--eval-stride: must be between 1 and --context-length {args.context_length}, "
                         f"got {args.eval_stride}")


def make_config(args, out: Path, *, vocab_size: int, tok_dir: Path, train_seconds: float) -> dict:
    """The run's config (a dict for ``config_from_dict``)."""
    return {
        "model": {"vocab_size": vocab_size, "context_length": args.context_length, "d_model": args.d_model,
                  "num_layers": args.num_layers, "num_heads": args.num_heads,
                  "rope_theta": 10000.0,  # d_ff: the SwiGLU default, 8/3·d_model up to a multiple of 64
                  "tie_embeddings": args.tie_embeddings, "dropout": args.dropout, "attn_impl": args.attn_impl,
                  **({"d_ff": args.d_ff} if args.d_ff is not None else {})},
        "data": {"train": str(out / "data" / "train.bin"), "val": str(out / "data" / "val.bin"),
                 "tokenizer": str(tok_dir)},
        "train": {"out_dir": str(out / "run"), "batch_size": args.batch_size, "max_time": train_seconds,
                  "seed": args.seed, "device": "cpu", "dtype": args.dtype},
        # the schedule runs on elapsed time: 10,000 "iterations" stand for the whole training time
        "optim": {"max_lr": args.max_lr, "min_lr": args.max_lr * args.min_lr_ratio,
                  "warmup_iters": int(args.warmup_fraction * 10_000), "cosine_cycle_iters": 10_000,
                  "schedule": args.schedule, "decay_fraction": args.decay_fraction,
                  "beta2": args.beta2, "weight_decay": args.weight_decay, "grad_clip": args.grad_clip,
                  "decay_embeddings": args.decay_embeddings},
        "eval": {"interval": 0},
        "checkpoint": {"interval": 0, "keep_last": 1, "keep_best": False, "export_safetensors": False},
        "log": {"interval": 50},
    }


def run(args, out: Path, t_start: float) -> int:
    from lm.data import read_token_file, tokenize_file
    from lm.evaluate import evaluate_tokens, token_byte_lengths
    from lm.io import atomic_write
    from lm.tokenizer import Tokenizer, save_tokenizer_dir, train_bpe
    from lm.train import Trainer, TrainingInterrupted, config_from_dict

    (out / "data").mkdir(parents=True, exist_ok=True)
    raw = (Path(args.data) / "tinyshakespeare.txt").read_bytes()
    cut = int(len(raw) * 0.9)
    (out / "data" / "train.txt").write_bytes(raw[:cut])
    (out / "data" / "val.txt").write_bytes(raw[cut:])

    vocab, merges = train_bpe(out / "data" / "train.txt", args.vocab_size, [])
    tok = Tokenizer(vocab, merges, [])
    if tok.vocab_size < args.vocab_size:  # BPE ran out of pairs: said, as lm demo says it (result.json records it)
        print(f"shakespeare.py: warning: --vocab-size: the {cut:,} training bytes give at most {tok.vocab_size:,} "
              f"tokens (BPE ran out of pairs to merge), not {args.vocab_size:,}; the run goes on with "
              f"{tok.vocab_size:,}", file=sys.stderr)
    tok_dir = save_tokenizer_dir(tok, out / "tokenizer")
    for split in ("train", "val"):
        tokenize_file(tok, out / "data" / f"{split}.txt", out / "data" / f"{split}.bin", num_workers=1)
    t_tok = time.perf_counter() - t_start

    train_seconds = args.budget - (time.perf_counter() - t_start) - args.eval_margin
    if train_seconds <= 0:
        left = max(args.budget - t_tok, 0.0)
        raise ValueError(f"--budget: {args.budget:g} s leaves {left:.1f} s once the tokenizer and the token files "
                         f"are made ({t_tok:.1f} s), not more than the {args.eval_margin:g} s kept for the final "
                         "evaluation: no time to train; raise --budget")
    cfg = config_from_dict(make_config(args, out, vocab_size=tok.vocab_size, tok_dir=tok_dir,
                                       train_seconds=train_seconds))
    # stopped by a signal, the run is thrown away (claim_dir puts back what --out held): no checkpoint
    trainer = Trainer(cfg, print_fn=functools.partial(print, flush=True), checkpoint_on_signal=False)
    status = trainer.run()
    if status != 0:  # 128 + the signal: undone as a Ctrl-C is (interruptible_script says it)
        raise TrainingInterrupted(status)
    t_train = time.perf_counter() - t_start - t_tok

    val, _ = read_token_file(out / "data" / "val.bin")
    token_bytes = token_byte_lengths(tok)  # bits per byte over the bytes of the tokens scored
    stride = args.eval_stride
    r = evaluate_tokens(trainer.model, val, batch_size=32, token_bytes=token_bytes, stride=stride)
    total = time.perf_counter() - t_start
    # for comparison, after the clock: windows that do not overlap (less context per token)
    flat = evaluate_tokens(trainer.model, val, batch_size=32, token_bytes=token_bytes)
    result = {"bits_per_byte": round(r["bits_per_byte"], 4), "val_loss": round(r["loss"], 4), "eval_stride": stride,
              "bits_per_byte_no_overlap": round(flat["bits_per_byte"], 4),
              "wall_seconds": round(total, 1), "tokenizer_seconds": round(t_tok, 1),
              "train_seconds": round(t_train, 1), "steps": trainer.step, "tokens_seen": trainer.tokens_seen,
              "vocab_size": tok.vocab_size, "parameters": trainer.model.num_parameters()}
    with atomic_write(out / "result.json") as f:
        f.write(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
