"""Resident memory of `lm train` does not grow with the token file.

Writes a large token file (default 4 GB: 2^31 uint16 ids) and trains a small model on it for
200 steps, reading the process's resident set size (VmRSS, with its anonymous and file-backed
parts) before the trainer opens the file, after it has opened and checked it, and at every log
line. Batches are read with ``pread`` into a reused buffer (a memory map would fault whole
page-cache folios into the process on recent kernels), and the check of the largest id reads the
file in fixed chunks with ordinary reads, so neither makes the file resident.

    flock /tmp/lm-cpu.lock python scripts/check_train_memory.py --dir /tmp   # Linux; ~5 GB of disk

Exits non-zero when the 200 steps add 200 MB or more.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lm.cli.common import WrittenHelpParser
from lm.data import write_token_file
from lm.train import Trainer, config_from_dict


def rss_mb() -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of this process in MB (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


def fmt(r: dict[str, float]) -> str:
    return f"RSS {r['VmRSS']:7.1f} MB (anon {r['RssAnon']:6.1f}, file {r['RssFile']:6.1f})"


def error(message: str) -> int:
    print(f"check_train_memory.py: error: {message}", file=sys.stderr)
    return 2


def main() -> int:
    parser = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="folder for the token file (default: a temp folder)")
    parser.add_argument("--gb", type=float, default=4.0, help="token file size in GB (2^30 bytes)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    # one line naming the option, exit 2, before gigabytes are written
    if args.dir is not None and not Path(args.dir).is_dir():
        return error(f"--dir: {args.dir!r} is not a folder")
    if not math.isfinite(args.gb):
        return error(f"--gb: must be a finite number of GB, got {args.gb:g}")
    if not args.gb > 0 or int(args.gb * (1 << 30)) // 2 < 2 * 16 * 129:
        return error(f"--gb: must hold a few batches of 16 × 129 tokens (at least 0.0001), got {args.gb:g}")
    folder = args.dir if args.dir is not None else tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if args.gb * (1 << 30) > free:  # it would write until the disk is full
        return error(f"--gb: a {args.gb:g} GB token file does not fit in the {free / (1 << 30):,.1f} GB free in "
                     f"{folder!r}; lower --gb or pass --dir on a larger disk")
    if args.steps < 1:
        return error(f"--steps: must be >= 1, got {args.steps}")

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tmp = Path(tmp)
        vocab = 50_000
        n = int(args.gb * (1 << 30)) // 2
        chunk = 1 << 26
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        write_token_file(
            tmp / "train.bin",
            (rng.integers(0, vocab, min(chunk, n - i), dtype=np.uint16) for i in range(0, n, chunk)),
            vocab_size=vocab,
            source_bytes=4 * n,
        )
        write_token_file(tmp / "val.bin", rng.integers(0, vocab, 1 << 20), vocab_size=vocab)
        size = (tmp / "train.bin").stat().st_size
        print(f"wrote {size / (1 << 30):.2f} GB ({n:,} ids) in {time.perf_counter() - t0:.0f} s")

        raw = {
            "model": dict(vocab_size=vocab, context_length=128, d_model=64, num_layers=2, num_heads=2, d_ff=192),
            "data": dict(train=str(tmp / "train.bin"), val=str(tmp / "val.bin")),
            "train": dict(out_dir=str(tmp / "run"), batch_size=16, max_steps=args.steps, device="cpu"),
            "eval": dict(interval=50, batches=5),
            "checkpoint": dict(interval=100, keep_last=1, export_safetensors=False),
            "log": dict(interval=25),
        }
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM): writing the file is not training
        before = rss_mb()
        print(f"before the trainer        : {fmt(before)}")
        t0 = time.perf_counter()
        samples = []

        def record(line: str) -> None:
            if line.startswith("step "):
                samples.append((line.split(" |")[0], rss_mb()))

        trainer = Trainer(config_from_dict(raw), print_fn=record)
        ready = rss_mb()
        print(f"file opened and checked   : {fmt(ready)}  ({time.perf_counter() - t0:.1f} s, id scan included)")
        trainer.run()
        for step, r in samples:
            print(f"{step:<26}: {fmt(r)}")
        first, last = samples[0][1], samples[-1][1]
        grew = last["VmRSS"] - ready["VmRSS"]
        print(f"peak from the trainer on  : {last['VmHWM']:.1f} MB")
        print(
            f"{args.steps} steps added {grew:+.1f} MB of RSS "
            f"({last['VmRSS'] - first['VmRSS']:+.1f} MB after the first log line)"
        )
        ok = grew < 200
        print("PASS" if ok else "FAIL", "(limit: < 200 MB)")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
