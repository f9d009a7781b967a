"""Throughput of `lm train` against the bare training step of the same model.

The bare step is the least a training loop can do: one fixed batch already on the device,
forward, cross-entropy, backward, clip, AdamW step. `lm train` adds everything a real run
needs: batches sampled from a memory-mapped token file, the schedule, console and JSONL
logging, periodic evaluation and checkpoints, and the final checkpoint and safetensors export,
all counted in its time. The target is >= 95% of the bare throughput.

    flock /tmp/lm-cpu.lock python scripts/bench_train.py                      # configs/cpu-small.toml
    python scripts/bench_train.py --config configs/tinystories-17m.toml --steps 300   # on a GPU

Runs alternate (bare, train, train without eval, bare, ...); the best and median of each are compared.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lm.data import write_token_file
from lm.model import TransformerLM
from lm.nn import cross_entropy
from lm.optim import AdamW, clip_grad_norm_, param_groups
from lm.train import Trainer, load_config
from lm.train.trainer import autocast_dtype


def bare_tokens_per_second(cfg, steps: int, warmup: int = 3) -> float:
    """Tokens/s of forward + backward + clip + AdamW on one fixed batch."""
    from lm.device import resolve_device

    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    model = TransformerLM.from_config(cfg.model).to(device)
    if cfg.train.compile:
        model = torch.compile(model)
    opt = AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.max_lr * 0.1)
    b, t = cfg.train.batch_size, cfg.model.context_length
    ids = torch.randint(0, cfg.model.vocab_size, (b, t + 1), device=device)
    x, y = ids[:, :-1], ids[:, 1:]
    dtype = autocast_dtype(cfg.train.dtype, device)

    # The loss exactly as the trainer computes it: the model's fused loss when it has one.
    fused = "targets" in inspect.signature(TransformerLM.forward).parameters

    def step():
        for _ in range(cfg.train.grad_accum_steps):
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(x, targets=y) if fused else cross_entropy(model(x), y)
            (loss / cfg.train.grad_accum_steps).backward()
        clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * b * t * cfg.train.grad_accum_steps / (time.perf_counter() - start)


def train_tokens_per_second(config: Path, overrides: list[str], out_dir: Path) -> float:
    """Tokens/s of a whole `lm train` run, setup excluded, everything in the loop included."""
    cfg = load_config(config, [*overrides, f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, print_fn=lambda line: None)
    start = time.perf_counter()
    trainer.run()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    return trainer.step * trainer.tokens_per_step / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/cpu-small.toml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = load_config(args.config, args.overrides)
        rng = np.random.default_rng(0)
        vocab = cfg.model.vocab_size
        n = max(2_000_000, 20 * cfg.model.context_length)
        write_token_file(tmp / "train.bin", rng.integers(0, vocab, n), vocab_size=vocab, source_bytes=4 * n)
        write_token_file(tmp / "val.bin", rng.integers(0, vocab, n // 10), vocab_size=vocab, source_bytes=4 * n // 10)
        # The config's own eval/log/checkpoint intervals, over a run of --steps steps.
        overrides = [
            *args.overrides,
            f"data.train={tmp / 'train.bin'}",
            f"data.val={tmp / 'val.bin'}",
            "data.tokenizer=''",
            f"train.max_steps={args.steps}",
        ]
        cfg = load_config(args.config, overrides)
        print(
            f"{args.config}: {args.steps} steps x {cfg.train.batch_size * cfg.model.context_length} tokens, "
            f"eval every {cfg.eval.interval} ({cfg.eval.batches} batches), checkpoint every "
            f"{cfg.checkpoint.interval}, log every {cfg.log.interval}, torch threads {torch.get_num_threads()}"
        )
        no_eval = [*overrides, "eval.interval=0"]
        bare, train, loop = [], [], []
        for i in range(args.repeats):
            bare.append(bare_tokens_per_second(cfg, args.steps))
            train.append(train_tokens_per_second(Path(args.config), overrides, tmp / f"run{i}"))
            loop.append(train_tokens_per_second(Path(args.config), no_eval, tmp / f"loop{i}"))
            print(
                f"  repeat {i + 1}: bare {bare[-1]:,.0f} tok/s   lm train {train[-1]:,.0f} tok/s   "
                f"lm train without eval {loop[-1]:,.0f} tok/s"
            )
        # On a shared machine other work only ever slows a run down, so the best of the repeats is
        # the estimate least disturbed by it; the medians are printed too.
        for name, pick in (("best", max), ("median", statistics.median)):
            b, t, lo = pick(bare), pick(train), pick(loop)
            print(
                f"{name:>6} of {args.repeats}: bare {b:,.0f} tok/s | lm train {t:,.0f} tok/s = {100 * t / b:.1f}% "
                f"(target >= 95%) | without eval {lo:,.0f} tok/s = {100 * lo / b:.1f}%"
            )


if __name__ == "__main__":
    main()
