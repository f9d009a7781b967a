"""Multi30k English→German in a fixed wall-clock budget, through the toolkit, ending in BLEU.

    python scripts/multi30k.py --budget 300                  # data/multi30k/ of `lm data download multi30k`
    python scripts/multi30k.py --budget 300 --test SRC.gz REF.gz

The defaults are the best of the 300-second runs in docs/benchmarks.md (pre-norm, a 4,000-token joint
BPE, no dropout, a cosine schedule on elapsed time peaking at 1.5e-3, bfloat16 autocast where
the CPU computes it natively, the einsum attention); ``--norm-placement post --vocab-size 8000
--dropout 0.1 --schedule inverse_sqrt --max-lr 2e-3`` is the paper's recipe.

The clock starts before the tokenizer: a joint byte-level BPE on both sides of the training
text (with <pad>, <bos>, <eos>), the pair token files, and the encoder–decoder trained by
``lm.train.Trainer`` until the budget is spent (the learning-rate schedule runs on elapsed
time); decoding the test set comes after the clock stops. The last line printed is
``BLEU <x>`` (sacrebleu's default 13a tokenization on the detokenized output; its signature is
printed above it, with chrF).

Every option is checked before anything is trained, each error naming the option and its value
(the warm-up too: ``--warmup`` counts steps of the inverse_sqrt schedule, ``--warmup-fraction`` is
the cosine schedule's share of the training time); the test pair is read and checked then too, and
its sources against the context as soon as the tokenizer exists. A failure while testing keeps the
trained run in ``OUT/run``. On a terminal a bar shows the decoding of the test set.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

SPECIALS = ["<pad>", "<bos>", "<eos>"]
CONTEXT = 128  # the model's context length, in tokens; every Multi30k pair fits it
MARGIN = 3.0  # seconds of the budget kept for the final validation and checkpoint


def error(message: str) -> int:
    """One line on stderr, and the status of a bad argument (2), as `lm` commands give."""
    print(f"multi30k.py: error: {message}", file=sys.stderr)
    return 2


def main() -> int:
    t_start = time.perf_counter()
    from lm.cli.common import WrittenHelpParser

    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("LM_TEST_DATA") or "data",
                    help="folder holding multi30k/ (default: $LM_TEST_DATA, else data, where "
                    "`lm data download multi30k` puts it)")
    ap.add_argument("--out", default="runs/multi30k", help="the run's folder: data, tokenizer, run, result.json")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier output of this script in --out")
    ap.add_argument("--budget", type=float, default=300.0, help="wall-clock seconds, tokenizer included")
    ap.add_argument("--test", nargs=2, metavar=("SRC", "REF"), default=None,
                    help="another test pair (default: multi30k/test_2016_flickr.{en,de}.gz)")
    ap.add_argument("--vocab-size", type=int, default=4000)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3, help="encoder and decoder layers each")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=1024)
    ap.add_argument("--dropout", type=float, default=0.0, help="0 for 300 s (no epoch repeats); 0.1 for longer runs")
    ap.add_argument("--label-smoothing", type=float, default=0.1)
    ap.add_argument("--norm-placement", default="pre", choices=["post", "pre"])
    ap.add_argument("--batch-tokens", type=int, default=1024, help="padded tokens per batch (source or target)")
    ap.add_argument("--max-lr", type=float, default=1.5e-3)
    ap.add_argument("--schedule", default="cosine", choices=["inverse_sqrt", "cosine"],
                    help="cosine: on elapsed time, to zero at the end of the budget")
    ap.add_argument("--warmup", type=int, default=None,
                    help="inverse_sqrt: warm-up steps (default 200); the cosine schedule takes --warmup-fraction")
    ap.add_argument("--warmup-fraction", type=float, default=None,
                    help="cosine: the share of the training time spent warming up (default 0.03); "
                    "inverse_sqrt takes --warmup")
    ap.add_argument("--beta2", type=float, default=0.98)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="autocast dtype; auto: bfloat16 where the CPU has bfloat16 instructions (AVX512-BF16, AMX)")
    ap.add_argument("--attn-impl", default="einsum", choices=["sdpa", "einsum"],
                    help="einsum: at these lengths (under 100 tokens) faster than torch's CPU flash kernel")
    ap.add_argument("--beam", type=int, default=4, help="beam size for the test set; 1 is greedy")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.dtype == "auto":
        from lm.device import cpu_has_bfloat16

        args.dtype = "bfloat16" if cpu_has_bfloat16() else "float32"
    src_dir = Path(args.data) / "multi30k"
    if not (src_dir / "train.en.gz").is_file():
        return error(f"--data: {args.data!r} holds no multi30k/train.en.gz; run `lm data download multi30k` (it "
                     "writes data/multi30k/) or pass --data FOLDER")
    from lm.io import claim_dir, write_marker

    try:
        check_args(args)  # before any training: a typo must not cost the budget
        test = read_test(args, src_dir)
        from lm.device import set_threads

        set_threads(args.threads)  # bounded as `lm` bounds --threads (torch's own overflowed past 2**63)
    except ValueError as e:
        return error(str(e))

    out = Path(args.out)
    kept = f"the trained run is kept in {str(out / 'run')!r}"
    trained = None

    def run() -> int:
        nonlocal trained
        try:  # a Ctrl-C or SIGTERM (training's too) removes --out, or puts back the one it replaced
            with claim_dir(out, command="scripts/multi30k.py", overwrite=args.overwrite, argument="--out",
                           files=("data", "tokenizer", "run", "result.json", "test.hyp")):
                trained = train(args, src_dir, out, t_start, test)
        except ValueError as e:
            return error(str(e))
        # From here on the trained run stays, whatever happens: testing it again needs no training.
        try:
            return report(args, out, test, *trained)
        except Exception as e:
            from lm.cli.common import is_out_of_memory

            if is_out_of_memory(e):
                return error(f"--beam: decoding the test set at beam {args.beam} does not fit in memory; {kept}")
            if isinstance(e, ValueError):
                return error(f"{e}; {kept}")
            print(f"multi30k.py: {kept}", file=sys.stderr)
            raise
        finally:
            write_marker(out, "scripts/multi30k.py")  # lists test.hyp and result.json too, once written

    from lm.cli.common import interruptible_script

    return interruptible_script("multi30k.py", run, kept=lambda: kept if trained is not None else "")


# the option that sets each config key, to name it when the config refuses a value
OPTIONS = {"vocab_size": "--vocab-size", "d_model": "--d-model", "encoder_layers": "--layers",
           "decoder_layers": "--layers", "num_heads": "--heads", "d_ff": "--d-ff", "dropout": "--dropout",
           "label_smoothing": "--label-smoothing", "batch_tokens": "--batch-tokens", "max_lr": "--max-lr",
           "warmup_iters": "--warmup", "beta2": "--beta2", "weight_decay": "--weight-decay", "seed": "--seed"}


def check_args(args) -> None:
    """Every setting checked before anything runs: the budget, the beam, the threads, the warm-up
    against the schedule (its defaults filled in), and the model and optimizer settings as the config
    would check them once the tokenizer exists, each error naming the option and the value given."""
    from lm.train import config_from_dict
    from lm.train.config import name_options

    if not args.budget > MARGIN:
        raise ValueError(f"--budget: must be more than the {MARGIN:g} s kept for the final validation, "
                         f"got {args.budget:g}")
    if not math.isfinite(args.budget):  # the run's train.max_time: named here, not as that key
        raise ValueError(f"--budget: must be a finite number of seconds, got {args.budget:g}")
    if args.beam < 1:
        raise ValueError(f"--beam: must be >= 1, got {args.beam}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {args.threads}")
    if args.vocab_size < 256 + len(SPECIALS):
        raise ValueError(f"--vocab-size: must be at least {256 + len(SPECIALS)} (256 bytes and the {len(SPECIALS)} "
                         f"special tokens), got {args.vocab_size}")
    if args.schedule == "cosine":  # on elapsed time: a share of the training time, not steps
        if args.warmup is not None:
            raise ValueError(f"--warmup: counts steps of --schedule inverse_sqrt; the cosine schedule runs on "
                             f"elapsed time: give --warmup-fraction instead, got --warmup {args.warmup}")
        if args.warmup_fraction is None:
            args.warmup_fraction = 0.03
        if not 0 <= args.warmup_fraction < 1:
            raise ValueError(f"--warmup-fraction: must be in [0, 1), got {args.warmup_fraction:g}")
    else:
        if args.warmup_fraction is not None:
            raise ValueError(f"--warmup-fraction: applies to --schedule cosine; inverse_sqrt counts warm-up in "
                             f"steps: give --warmup instead, got --warmup-fraction {args.warmup_fraction:g}")
        if args.warmup is None:
            args.warmup = 200
    probe = make_config(args, vocab_size=args.vocab_size, ids=dict(zip(SPECIALS, range(len(SPECIALS)))),
                        out=Path(args.out), tok_dir=Path(args.out) / "tokenizer", train_seconds=args.budget - MARGIN)
    try:
        config_from_dict(probe)
    except ValueError as e:
        raise ValueError(name_options(str(e), OPTIONS, args)) from None


def make_config(args, *, vocab_size: int, ids: dict[str, int], out: Path, tok_dir: Path,
                train_seconds: float) -> dict:
    """The run's config (a dict for ``config_from_dict``)."""
    schedule = {"schedule": args.schedule, "max_lr": args.max_lr, "min_lr": 0.0}
    if args.schedule == "cosine":  # on elapsed time: 10,000 "iterations" stand for the training time
        schedule.update(cosine_cycle_iters=10_000, warmup_iters=round(args.warmup_fraction * 10_000))
    else:
        schedule.update(warmup_iters=args.warmup)
    data = out / "data"
    return {
        "model": {"architecture": "encoder_decoder", "vocab_size": vocab_size, "context_length": CONTEXT,
                  "d_model": args.d_model, "encoder_layers": args.layers, "decoder_layers": args.layers,
                  "num_heads": args.heads, "d_ff": args.d_ff, "dropout": args.dropout,
                  "label_smoothing": args.label_smoothing, "norm_placement": args.norm_placement,
                  "attn_impl": args.attn_impl, "pad_id": ids["<pad>"], "bos_id": ids["<bos>"],
                  "eos_id": ids["<eos>"]},
        "data": {"train": str(data / "train.bin"), "val": str(data / "val.bin"), "tokenizer": str(tok_dir)},
        "train": {"out_dir": str(out / "run"), "batch_tokens": args.batch_tokens, "max_time": train_seconds,
                  "seed": args.seed, "device": "cpu", "dtype": args.dtype},
        "optim": {**schedule, "beta1": 0.9, "beta2": args.beta2, "eps": 1e-9, "weight_decay": args.weight_decay,
                  "grad_clip": 1.0},
        "eval": {"interval": 0, "batches": 8},
        "checkpoint": {"interval": 0, "keep_last": 1, "keep_best": False, "export_safetensors": False},
        "log": {"interval": 50},
    }


def read_test(args, src_dir: Path) -> tuple[Path, Path, list[tuple[str, str]], str]:
    """The test pair (``--test``, else Multi30k's test_2016_flickr), read and checked, with the
    argument it came from, before any training."""
    from lm.data.pairs import read_parallel

    if args.test:
        src, ref = map(Path, args.test)
        arg = "--test"
    else:
        src, ref = src_dir / "test_2016_flickr.en.gz", src_dir / "test_2016_flickr.de.gz"
        arg = "--data"  # the default test pair lives in --data's multi30k/
    try:
        pairs = list(read_parallel(src, ref))  # readable, UTF-8, no empty line, aligned
    except ValueError as e:
        raise ValueError(f"{arg}: {e}") from None
    if not pairs:
        raise ValueError(f"{arg}: {str(src)!r} and {str(ref)!r} hold no lines")
    return src, ref, pairs, arg


def train(args, src_dir: Path, out: Path, t_start: float, test):
    """The tokenizer, the pair files and the trained model in ``out``: ``(trainer, tokenizer,
    tokenizer seconds, training seconds, wall seconds)``; :class:`lm.train.TrainingInterrupted` when a
    signal stopped the training."""
    from lm.data.pairs import tokenize_pairs
    from lm.generate.seq2seq import check_source_length
    from lm.tokenizer import Tokenizer, save_tokenizer_dir, train_bpe
    from lm.train import Trainer, TrainingInterrupted, config_from_dict

    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    joint = data / "train.joint.txt"
    with open(joint, "wb") as f:
        for side in ("en", "de"):
            with gzip.open(src_dir / f"train.{side}.gz") as g:
                shutil.copyfileobj(g, f)
    vocab, merges = train_bpe(joint, args.vocab_size, SPECIALS)
    tok = Tokenizer(vocab, merges, SPECIALS)
    test_src, _, test_pairs, arg = test
    lengths = [len(tok.encode(s.strip())) for s, _ in test_pairs]
    for i, n in enumerate(lengths):  # as `lm translate` refuses it, before the model trains
        check_source_length(f"{arg}: line {i + 1} of {str(test_src)!r}", n, CONTEXT)
    tok_dir = save_tokenizer_dir(tok, out / "tokenizer")
    for split in ("train", "val"):
        tokenize_pairs(tok, src_dir / f"{split}.en.gz", src_dir / f"{split}.de.gz", data / f"{split}.bin")
    t_tok = time.perf_counter() - t_start
    ids = {s: tok.token_to_id[s.encode()] for s in SPECIALS}

    train_seconds = args.budget - (time.perf_counter() - t_start) - MARGIN
    if train_seconds <= 0:
        left = max(args.budget - t_tok, 0.0)
        raise ValueError(f"--budget: {args.budget:g} s leaves {left:.1f} s once the tokenizer and the pair files "
                         f"are made ({t_tok:.1f} s), not more than the {MARGIN:g} s kept for the final validation: "
                         "no time to train; raise --budget")
    cfg = config_from_dict(make_config(args, vocab_size=tok.vocab_size, ids=ids, out=out, tok_dir=tok_dir,
                                       train_seconds=train_seconds))
    # stopped by a signal, the run is thrown away (claim_dir puts back what --out held): no checkpoint
    trainer = Trainer(cfg, print_fn=functools.partial(print, flush=True), checkpoint_on_signal=False)
    check_test_decoding(args, trainer.model, lengths)
    status = trainer.run()
    if status != 0:  # 128 + the signal: undone as a Ctrl-C is (interruptible_script says it)
        raise TrainingInterrupted(status)
    t_train = time.perf_counter() - t_start - t_tok
    wall = time.perf_counter() - t_start  # the clock stops here: decoding is not counted
    return trainer, tok, t_tok, t_train, wall


BATCH = 64  # test sentences decoded together, shortest first


def test_batches(lengths: list[int]) -> list[list[int]]:
    """The test sentences' indices in the batches they are decoded in: by source length, ``BATCH`` a batch."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[j : j + BATCH] for j in range(0, len(order), BATCH)]


def check_test_decoding(args, model, lengths: list[int]) -> None:
    """Refuse ``--beam`` when decoding the test set's largest batch cannot fit in memory, counted
    (:func:`lm.generate.seq2seq.decoding_bytes`) before training: ``--beam 1000000`` had trained for
    the whole budget, then failed."""
    from lm.cli.common import check_fits
    from lm.generate.seq2seq import decoding_bytes

    need = max(decoding_bytes(model, [lengths[i] for i in rows], args.beam) for rows in test_batches(lengths))
    check_fits(f"--beam: decoding the test set at beam {args.beam}", need,
               "decoding needs about", model.device, "lower --beam")


def report(args, out: Path, test, trainer, tok, t_tok: float, t_train: float, wall: float) -> int:
    """Translate the test sources as `lm translate` does, write ``test.hyp`` and ``result.json``, print BLEU."""
    from tqdm import tqdm

    from lm.evaluate import bleu_chrf
    from lm.generate import NonFiniteLogitsError, translate
    from lm.generate.seq2seq import line_break_ids
    from lm.io import atomic_write

    _, _, pairs, _ = test
    model = trainer.model.eval()
    sources = [tok.encode(s.strip()) for s, _ in pairs]
    banned = line_break_ids(tok)  # one hypothesis a line of test.hyp
    hyps = [""] * len(sources)
    t0 = time.perf_counter()
    with tqdm(total=len(sources), unit=" sentences", desc="translate", disable=None, file=sys.stderr) as bar:
        for rows in test_batches(list(map(len, sources))):  # the bar shows on a terminal only
            try:
                done = translate(model, [sources[i] for i in rows], beam_size=args.beam, banned_ids=banned)
            except NonFiniteLogitsError as e:  # its row in this batch, as the line of the test sources
                raise e.naming([i + 1 for i in rows], "--test source line") from None
            for i, o in zip(rows, done):
                hyps[i] = tok.decode(o).strip()
            bar.update(len(rows))
    t_decode = time.perf_counter() - t0
    with atomic_write(out / "test.hyp") as f:
        f.write("".join(h + "\n" for h in hyps))
    scores = bleu_chrf(hyps, [r.strip() for _, r in pairs])
    result = {"bleu": round(scores["bleu"], 2), "chrf": round(scores["chrf"], 2), "beam": args.beam,
              "wall_seconds": round(wall, 1), "tokenizer_seconds": round(t_tok, 1),
              "train_seconds": round(t_train, 1), "decode_seconds": round(t_decode, 1), "steps": trainer.step,
              "target_tokens_seen": trainer.tokens_seen, "vocab_size": tok.vocab_size,
              "parameters": model.num_parameters(), "bleu_signature": scores["bleu_signature"],
              "settings": {k: v for k, v in vars(args).items() if k not in ("data", "out", "overwrite")}}
    with atomic_write(out / "result.json") as f:
        f.write(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}))
    print(f"BLEU {scores['bleu']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
