"""The reference for ``scripts/multi30k.py``: the same 300-second Multi30k En→De task, done the
way a ``torch.nn.Transformer`` user does it, so both can be run on the same machine on the same day.

    python scripts/multi30k_reference.py --budget 300     # needs LM_TEST_DATA (multi30k/)

The recipe (issue 11's): a joint byte-level BPE of 8,000 tokens from Hugging Face ``tokenizers``
with ``<pad>``, ``<bos>``, ``<eos>``; the PyTorch tutorial's model (``nn.Embedding`` · √d +
sinusoidal positions, ``nn.Transformer`` d_model 256, 3+3 layers, 4 heads, d_ff 1024, dropout
0.1, batch-first, the three padding masks, a generator tied to the embedding); label smoothing
0.1; Adam (0.9, 0.98, eps 1e-9) with 200 warm-up steps to a peak of 2e-3 and the inverse square
root after; batches of about 1,024 target tokens of similar length, in random order; greedy
decoding that re-runs the decoder on the whole prefix. The clock starts before the tokenizer
and stops before decoding, as in ``multi30k.py``; the last line printed is ``BLEU <x>``
(sacrebleu's defaults).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_seq2seq import TutorialTransformer, lines  # noqa: E402

SPECIALS = ["<pad>", "<bos>", "<eos>"]
PAD, BOS, EOS = 0, 1, 2


def batches_of(src: list[list[int]], tgt: list[list[int]], budget: int, rng: random.Random) -> list[list[int]]:
    """Pairs sorted by length (ties broken at random), cut at ``budget`` padded target tokens."""
    order = sorted(range(len(src)), key=lambda i: (len(tgt[i]), len(src[i]), rng.random()))
    out, cur, width = [], [], 0
    for i in order:
        w = max(width, len(tgt[i]) + 1)
        if cur and w * (len(cur) + 1) > budget:
            out.append(cur)
            cur, w = [], len(tgt[i]) + 1
        cur.append(i)
        width = w
    return out + [cur]


def pad(rows: list[list[int]]) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [PAD] * (width - len(r)) for r in rows], dtype=torch.long)


def error(message: str) -> int:
    """One line on stderr, and the status of a bad argument (2)."""
    print(f"multi30k_reference.py: error: {message}", file=sys.stderr)
    return 2


def is_result(path: Path) -> bool:
    """Whether ``path`` is a result this script wrote (JSON with its keys)."""
    try:
        return {"bleu", "steps", "bleu_signature"} <= set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return False


def check_args(args) -> Path:
    """The multi30k/ folder, once every option is checked (each error naming the option and value)."""
    from lm.io import check_output_file

    if not args.data:
        raise ValueError("--data: give the folder holding multi30k/ (or set LM_TEST_DATA)")
    d = Path(args.data) / "multi30k"
    if not (d / "train.en.gz").is_file():
        raise ValueError(f"--data: {args.data!r} holds no multi30k/train.en.gz")
    if not args.budget > 0:
        raise ValueError(f"--budget: must be > 0 seconds, got {args.budget:g}")
    for name in ("batch_tokens", "warmup"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if not args.max_lr > 0:
        raise ValueError(f"--max-lr: must be > 0, got {args.max_lr:g}")
    if args.out:
        check_output_file(args.out, overwrite=args.overwrite, recognise=is_result, what="a result of this script")
    return d


def main() -> int:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.environ.get("LM_TEST_DATA"), help="folder holding multi30k/")
    ap.add_argument("--budget", type=float, default=300.0, help="wall-clock seconds, tokenizer included")
    ap.add_argument("--batch-tokens", type=int, default=1024)
    ap.add_argument("--max-lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the result as JSON to this file")
    ap.add_argument("--overwrite", action="store_true", help="replace an earlier result of this script in --out")
    args = ap.parse_args()
    try:
        d = check_args(args)  # before anything runs: a typo must not cost the budget
    except ValueError as e:
        return error(str(e))
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    en, de = lines(d / "train.en.gz"), lines(d / "train.de.gz")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(en + de, trainers.BpeTrainer(vocab_size=8000, special_tokens=SPECIALS,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    src = [e.ids for e in tok.encode_batch(en)]
    tgt = [e.ids for e in tok.encode_batch(de)]
    t_tok = time.perf_counter() - t_start
    if t_tok >= args.budget:  # decoding an untrained model would take minutes, to say BLEU 0
        return error(f"--budget: {args.budget:g} s is spent by the tokenizer ({t_tok:.1f} s): no time to train; "
                     "raise --budget")

    model = TutorialTransformer(tok.get_vocab_size(), 256, 4, 3, 1024, 0.1)
    opt = torch.optim.Adam(model.parameters(), lr=args.max_lr, betas=(0.9, 0.98), eps=1e-9)

    def lr_at(step: int) -> float:  # step from 1: linear warm-up, then ∝ step^-0.5, peak max_lr
        return args.max_lr * min(step / args.warmup, math.sqrt(args.warmup / step))

    step, tokens = 0, 0
    deadline = t_start + args.budget
    model.train()
    while time.perf_counter() < deadline:
        batches = batches_of(src, tgt, args.batch_tokens, rng)
        rng.shuffle(batches)
        for b in batches:
            if time.perf_counter() >= deadline:
                break
            s = pad([src[i] + [EOS] for i in b])
            t_in = pad([[BOS] + tgt[i] for i in b])
            t_out = pad([tgt[i] + [EOS] for i in b])
            step += 1
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            logits = model(s, t_in, s == PAD, t_in == PAD)
            targets = t_out.masked_fill(t_out == PAD, -100)  # <eos> is the last real target
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                                   label_smoothing=0.1)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            tokens += int((targets != -100).sum())
    wall = time.perf_counter() - t_start
    if step == 0:
        return error(f"--budget: {args.budget:g} s left no time for a training step after the tokenizer "
                     f"({t_tok:.1f} s); raise --budget")

    model.eval()
    test_en, test_de = lines(d / "test_2016_flickr.en.gz"), lines(d / "test_2016_flickr.de.gz")
    test_src = [e.ids for e in tok.encode_batch(test_en)]
    order = sorted(range(len(test_src)), key=lambda i: len(test_src[i]))
    hyps = [""] * len(test_src)
    t0 = time.perf_counter()
    with tqdm(total=len(order), unit=" sentences", desc="translate", disable=None, file=sys.stderr) as bar:
        for j in range(0, len(order), 64):  # the bar shows on a terminal only
            rows = order[j : j + 64]
            s = pad([test_src[i] + [EOS] for i in rows])
            ys = model.greedy(s, s == PAD, BOS, EOS, max(len(test_src[i]) for i in rows) + 50)
            for i, row in zip(rows, ys[:, 1:].tolist()):
                row = row[: row.index(EOS)] if EOS in row else row
                hyps[i] = tok.decode(row[: len(test_src[i]) + 50]).strip()
            bar.update(len(rows))
    t_decode = time.perf_counter() - t0

    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(hyps, [[r.strip() for r in test_de]])
    chrf = sacrebleu.metrics.CHRF().corpus_score(hyps, [[r.strip() for r in test_de]])
    result = {"bleu": round(score.score, 2), "chrf": round(chrf.score, 2), "steps": step,
              "target_tokens_seen": tokens, "wall_seconds": round(wall, 1), "tokenizer_seconds": round(t_tok, 1),
              "target_tokens_per_s": round(tokens / (wall - t_tok)), "decode_seconds": round(t_decode, 1),
              "bleu_signature": str(bleu.get_signature())}
    print(json.dumps(result))
    if args.out:
        from lm.io import atomic_write

        with atomic_write(args.out) as f:
            f.write(json.dumps(result, indent=1) + "\n")
    print(f"BLEU {score.score:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
