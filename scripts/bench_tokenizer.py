"""Tokenizer speed against the libraries a user would pick instead, in one process, interleaved.

    python scripts/bench_tokenizer.py                      # uses $LM_TEST_DATA/gutenberg.txt
    python scripts/bench_tokenizer.py --text FILE --reps 3

Rows:
  train      lm.train_bpe vs Hugging Face `tokenizers` BpeTrainer (byte-level, the same GPT-2
             regex, vocab size and special token), both on all cores, on the text minus a
             held-out tail; bytes/token of each on that tail.
  encode     Tokenizer.encode, one thread, GPT-2 vocab, vs tiktoken's GPT-2 encoding built
             from the same files; "cold" starts from an empty pre-token cache, "warm" encodes
             the text a second time. Ids must be identical. Again on the German side of
             Multi30k (DATA/multi30k/train.de.gz, 2.1 MB, where present): accented letters; and
             on 2 MB of the text with a no-break space for every 15th space and an emoji
             after every 40th word (characters of four bytes and Unicode spaces).
  tokenize   `lm tokenize` (tokenize_file, one process per core, text file -> token file) vs
             tiktoken's encode_batch on as many threads, given the file in the chunks `lm tokenize`
             cuts it into (the target is for this row), and vs tiktoken on one thread (reported).
  lines      Tokenizer.encode called once per sentence, the 29,000 German sentences of Multi30k
             (DATA/multi30k/train.de.gz: what `lm tokenize --target` does with a tokenizer that has
             no special token to join them with, and a server with its prompts), cold and warm, vs
             tiktoken's encode per sentence. Ids must be identical.
  longword   Tokenizer.encode of one pre-token of 100,000 random ACGT letters (a line of DNA;
             BPE cost grows with a pre-token's length, not with the text's) vs tiktoken, GPT-2
             vocab, fresh cache each time. Ids must be identical.
Speed ratios are lm / reference (higher is better for lm); for training the wall-time
ratio lm / reference is printed as well (the target is <= 2). Each row's lm and reference
runs alternate in one process; each task gets a fresh process, so that one task's heap
(or the `tokenizers` thread pool) does not slow the next.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EOT = "<|endoftext|>"
TASKS = ["train", "encode", "tokenize", "lines", "longword"]
CHUNK_BYTES = 1 << 21  # tokenize_file's default chunk size


def hf_train(path: str, vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from lm.tokenizer.pretokenize import GPT2_PATTERN

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train([path], trainer)
    return tk


def tiktoken_gpt2(data: Path):
    import tiktoken

    from lm.tokenizer.byte_unicode import unicode_str_to_bytes
    from lm.tokenizer.pretokenize import GPT2_PATTERN

    vocab = json.loads((data / "gpt2_vocab.json").read_text(encoding="utf-8"))
    ranks = {unicode_str_to_bytes(s): i for s, i in vocab.items() if s != EOT}
    return tiktoken.Encoding("gpt2-local", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT: 50256})


def tiktoken_file(enc, path: Path, threads: int) -> list[list[int]]:
    """tiktoken on ``threads`` threads: ``path`` read and cut where `lm tokenize` cuts it (chunks of
    its default size, at safe cuts, so the ids are the whole text's), the chunks encoded in one batch."""
    from lm.tokenizer.pretokenize import chunk_boundaries

    raw = path.read_bytes()
    texts = [raw[a:b].decode("utf-8") for a, b in chunk_boundaries(path, [EOT], CHUNK_BYTES)]
    return enc.encode_batch(texts, num_threads=threads, allowed_special="all")


def with_emoji_and_nbsp(text: str) -> str:
    """``text`` with a no-break space for every 15th space and an emoji after every 40th word: web
    text's characters of four UTF-8 bytes and Unicode spaces, in a fixed place."""
    emoji = ["\U0001f642", "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f389", "\U0001f436"]
    out = []
    for i, word in enumerate(text.split(" ")):
        out.append(word)
        out.append("\u00a0" if i % 15 == 7 else " ")
        if i % 40 == 20:
            out.append(emoji[i // 40 % 5] + " ")
    return "".join(out)


def heldout_cut(path: Path, size: int, holdout: int) -> int:
    """Where the held-out tail starts: the first safe cut in the last ``holdout`` bytes, or -1."""
    from lm.tokenizer.pretokenize import next_safe_cut

    with open(path, "rb") as f:
        return next_safe_cut(f, size - holdout, size, [EOT.encode()])


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace, tasks: list[str]) -> None:
    """Every value ``tasks`` need, checked before the first task starts: a bad one is one line,
    not a traceback from a task's process after the others have run."""
    if not args.data:
        ap.error("--data: not given and LM_TEST_DATA is not set; name the shared data folder")
    data = Path(args.data)
    if not data.is_dir():
        ap.error(f"--data: {args.data!r} is not a folder; name the shared data folder")
    text = Path(args.text) if args.text else data / "gutenberg.txt"
    if not text.is_file():
        ap.error(f"--text: {args.text!r} is not a file" if args.text else
                 f"--data: {args.data!r} holds no gutenberg.txt; pass --text FILE")
    size = text.stat().st_size
    if size == 0:
        ap.error(f"--text: {str(text)!r} is empty")
    if args.reps < 1:
        ap.error(f"--reps: must be >= 1, got {args.reps}")
    if any(t != "train" for t in tasks):
        for name in ("gpt2_vocab.json", "gpt2_merges.txt"):
            if not (data / name).is_file():
                ap.error(f"--data: {args.data!r} holds no {name} (the GPT-2 vocabulary the encode rows use); "
                         f"name the shared data folder or pass --skip encode tokenize lines longword")
        try:
            text.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            ap.error(f"--text: {str(text)!r} is not UTF-8 (byte {e.start:,}); the encode rows compare ids of its text")
    if "lines" in tasks and not (data / "multi30k" / "train.de.gz").is_file():
        ap.error(f"--data: {args.data!r} holds no multi30k/train.de.gz (the sentences of the lines row); "
                 "name the shared data folder or pass --skip lines")
    if "train" in tasks:
        if args.vocab_size < 257:
            ap.error(f"--vocab-size: must be >= 257 (256 bytes and {EOT}), got {args.vocab_size}")
        if not 0 < args.holdout_bytes < size:
            ap.error(f"--holdout-bytes: must be > 0 and below the text's {size:,} bytes, got {args.holdout_bytes}")
        if heldout_cut(text, size, args.holdout_bytes) == -1:  # it was taken as the text's last byte, trained on
            ap.error(f"--holdout-bytes: no line end or {EOT} in the last {args.holdout_bytes:,} bytes of "
                     f"{str(text)!r}, so nothing can be held out there; pass a larger --holdout-bytes")


def run_task(task: str, argv: list[str]) -> list[tuple]:
    """One task in its own process: its rows. If it fails, exit with its status and its last line
    of stderr (its one-line error, or the last line of its traceback), not a traceback of ours."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        prog = f"{Path(__file__).name}: "
        print(last if last.startswith(prog) else
              f"{prog}error: the {task} task failed (exit status {done.returncode}): {last}", file=sys.stderr)
        raise SystemExit(done.returncode if done.returncode > 0 else 1)
    sys.stderr.write(done.stderr)  # its progress lines
    return [tuple(r) for r in json.loads(done.stdout)]


def timed(fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - t0, out


def main() -> int:
    from lm.cli.common import WrittenHelpParser

    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = lambda message: ap.exit(2, f"{ap.prog}: error: {message}\n")  # one line, no usage
    ap.add_argument("--data", default=os.environ.get("LM_TEST_DATA"), help="folder with gutenberg.txt and gpt2_*")
    ap.add_argument("--text", default=None, help="text file (default: DATA/gutenberg.txt)")
    ap.add_argument("--vocab-size", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--holdout-bytes", type=int, default=1_000_000)
    ap.add_argument("--skip", nargs="*", default=[], choices=TASKS)
    ap.add_argument("--task", choices=TASKS, default=None, help=argparse.SUPPRESS)  # one task, rows as JSON
    args = ap.parse_args()
    tasks = [args.task] if args.task else [t for t in TASKS if t not in args.skip]
    if not tasks:  # an empty table and exit 0 read as a run that measured nothing wrong
        ap.error(f"--skip: {' '.join(args.skip)} leaves no task to run (the tasks: {' '.join(TASKS)})")
    check_args(ap, args, tasks)
    if args.task is None:
        rows = []
        for task in tasks:
            argv = [sys.executable, __file__, "--task", task, "--vocab-size", str(args.vocab_size),
                    "--reps", str(args.reps), "--holdout-bytes", str(args.holdout_bytes), "--data", args.data]
            argv += ["--text", args.text] if args.text else []
            rows += run_task(task, argv)
        print_table(rows)
        return 0
    args.skip = [t for t in TASKS if t != args.task]
    data = Path(args.data)
    text_path = Path(args.text) if args.text else data / "gutenberg.txt"

    from lm.data import tokenize_file
    from lm.tokenizer import Tokenizer, train_bpe

    raw = text_path.read_bytes()
    size = len(raw)
    rows = []
    cpus = os.cpu_count()
    print(f"text: {text_path} ({size / 1e6:.1f} MB), cpus: {cpus}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "train" not in args.skip:
            cut = heldout_cut(text_path, size, args.holdout_bytes)  # not -1: check_args saw to it
            train_file, heldout = tmp / "train.txt", raw[cut:].decode("utf-8", errors="replace")
            train_file.write_bytes(raw[:cut])
            lm_t, hf_t = [], []
            for _ in range(args.reps):
                dt, (vocab, merges) = timed(lambda: train_bpe(train_file, args.vocab_size, [EOT]))
                lm_t.append(dt)
                dt, hf = timed(lambda: hf_train(str(train_file), args.vocab_size))
                hf_t.append(dt)
            tok = Tokenizer(vocab, merges, [EOT])
            hb = len(heldout.encode("utf-8"))
            lm_bpt = hb / len(tok.encode(heldout))
            hf_bpt = hb / len(hf.encode(heldout).ids)
            lm_s, hf_s = statistics.median(lm_t), statistics.median(hf_t)
            rows.append((f"train BPE, vocab {args.vocab_size} (wall s)", f"{lm_s:.2f}", f"{hf_s:.2f}",
                         f"{lm_s / hf_s:.2f}x time", "<= 2x time"))
            rows.append(("  held-out bytes/token", f"{lm_bpt:.4f}", f"{hf_bpt:.4f}",
                         f"{(lm_bpt / hf_bpt - 1) * 100:+.2f}%", "within 1%"))
            print(f"train: lm {lm_t} tokenizers {hf_t}", file=sys.stderr)

        if any(t not in args.skip for t in ("encode", "tokenize", "lines", "longword")):
            enc = tiktoken_gpt2(data)
            gpt2 = Tokenizer.from_files(data / "gpt2_vocab.json", data / "gpt2_merges.txt", [EOT])
            text = raw.decode("utf-8")
        if "encode" not in args.skip:
            texts = [("", text)]
            german = data / "multi30k" / "train.de.gz"
            if german.is_file():  # accented letters: the fast path's two-byte characters
                import gzip

                with gzip.open(german, "rt", encoding="utf-8") as f:
                    texts.append(("German (Multi30k), ", f.read()))
            texts.append(("emoji and NBSP, ", with_emoji_and_nbsp(text[:2_000_000])))
            for label, body in texts:
                cold, warm, tik = [], [], []
                for _ in range(args.reps):
                    fresh = Tokenizer(gpt2.vocab, gpt2.merges, [EOT])  # empty cache
                    dt, ours = timed(fresh.encode, body)
                    cold.append(dt)
                    dt, ours_warm = timed(fresh.encode, body)
                    warm.append(dt)
                    dt, ref = timed(enc.encode, body, allowed_special="all")
                    tik.append(dt)
                    assert ours == ref and ours_warm == ref, "ids differ from tiktoken"
                    del fresh, ours, ours_warm, ref  # keep each repetition's heap like the first's
                    gc.collect()
                mb = len(body.encode("utf-8")) / 1e6
                t_ref = mb / statistics.median(tik)
                for name, ts in (("cold cache", cold), ("warm cache", warm)):
                    v = mb / statistics.median(ts)
                    rows.append((f"encode 1 thread, {label}GPT-2 vocab, {name} (MB/s)", f"{v:.1f}", f"{t_ref:.1f}",
                                 f"{v / t_ref:.2f}x", ">= 0.5x"))
                print(f"encode {label}: cold {cold} warm {warm} tiktoken {tik}", file=sys.stderr)

        if "tokenize" not in args.skip:
            import itertools

            import numpy as np

            ours_t, many, one = [], [], []
            for _ in range(args.reps):
                fresh = Tokenizer(gpt2.vocab, gpt2.merges, [EOT])  # empty cache
                dt, meta = timed(tokenize_file, fresh, text_path, tmp / "out.bin", num_workers=cpus)
                ours_t.append(dt)
                dt, parts = timed(tiktoken_file, enc, text_path, cpus)
                many.append(dt)
                dt, ref = timed(lambda: enc.encode(text_path.read_text(encoding="utf-8"), allowed_special="all"))
                one.append(dt)
                assert meta["num_tokens"] == len(ref), "ids differ from tiktoken"
                assert list(itertools.chain.from_iterable(parts)) == ref, "tiktoken's batch differs from its encode"
                del parts
                gc.collect()
            assert np.fromfile(tmp / "out.bin", dtype=np.uint16).tolist() == ref, "ids differ from tiktoken"
            mb = size / 1e6
            v = mb / statistics.median(ours_t)
            ours = f"lm tokenize, {cpus} process{'es' * (cpus > 1)}, GPT-2 vocab (MB/s)"
            for ref_name, ts, target in ((f"tiktoken encode_batch, {cpus} thread{'s' * (cpus > 1)}", many, ">= 1.0x"),
                                         ("tiktoken 1 thread", one, "none (threads differ)")):
                t_ref = mb / statistics.median(ts)
                rows.append((f"{ours} vs {ref_name}", f"{v:.1f}", f"{t_ref:.1f}", f"{v / t_ref:.2f}x", target))
            print(f"tokenize: lm {ours_t} tiktoken {cpus} threads {many} tiktoken 1 thread {one}", file=sys.stderr)

        if "lines" not in args.skip:
            import gzip

            with gzip.open(data / "multi30k" / "train.de.gz", "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
            def each(tok):
                return [tok.encode(line) for line in lines]

            cold, warm, tik = [], [], []
            for _ in range(args.reps):
                fresh = Tokenizer(gpt2.vocab, gpt2.merges, [EOT])  # empty cache
                dt, ours = timed(each, fresh)
                cold.append(dt)
                dt, ours_warm = timed(each, fresh)
                warm.append(dt)
                dt, ref = timed(lambda: [enc.encode(line, allowed_special="all") for line in lines])
                tik.append(dt)
                assert ours == ref and ours_warm == ref, "ids differ from tiktoken"
                del fresh, ours, ours_warm, ref
                gc.collect()
            t_ref = len(lines) / statistics.median(tik)
            for name, ts in (("cold cache", cold), ("warm cache", warm)):
                v = len(lines) / statistics.median(ts)
                rows.append((f"encode {len(lines):,} sentences one call each, German (Multi30k), GPT-2 vocab, {name} "
                             "(sentences/s)", f"{v:,.0f}", f"{t_ref:,.0f}", f"{v / t_ref:.2f}x", ">= 0.5x"))
            print(f"lines: cold {cold} warm {warm} tiktoken {tik}", file=sys.stderr)

        if "longword" not in args.skip:
            import random

            word = "".join(random.Random(0).choice("ACGT") for _ in range(100_000))
            ours_t, tik = [], []
            for _ in range(args.reps):
                fresh = Tokenizer(gpt2.vocab, gpt2.merges, [EOT])  # empty cache
                dt, ours = timed(fresh.encode, word)
                ours_t.append(dt)
                dt, ref = timed(enc.encode, word)
                tik.append(dt)
                assert ours == ref, "ids differ from tiktoken"
            lm_s, ref_s = statistics.median(ours_t), statistics.median(tik)
            rows.append(("encode one 100,000-char pre-token (s)", f"{lm_s:.3f}", f"{ref_s:.3f}",
                         f"{lm_s / ref_s:.1f}x time", "< 1 s"))
            print(f"longword: lm {ours_t} tiktoken {tik}", file=sys.stderr)

    print(json.dumps(rows))
    return 0


def print_table(rows) -> None:
    ref_names = {"train": "tokenizers", "encode": "tiktoken"}  # the `lm tokenize` rows name theirs
    print("| task | lm | reference | ratio | target |")
    print("|---|---:|---:|---:|---|")
    for name, a, b, r, target in rows:
        ref = next((v for k, v in ref_names.items() if name.startswith(k)), "")
        print(f"| {name}{' vs ' + ref if ref else ''} | {a} | {b} | {r} | {target} |")


if __name__ == "__main__":
    raise SystemExit(main())
