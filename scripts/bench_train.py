"""Throughput of `lm train` against the bare training step of the same model.

The bare step is the least a training loop can do: one fixed batch already on the device,
forward, cross-entropy, backward, clip, AdamW step. `lm train` adds everything a real run
needs: batches sampled from a memory-mapped token file, the schedule, console and JSONL
logging, periodic evaluation and checkpoints, and the final checkpoint and safetensors export,
all counted in its time. The target is >= 95% of the bare throughput.

Like for like: one-off compile costs are left out on both sides. With ``train.compile`` the bare
step compiles in its untimed warm-up; ``lm train`` reports its compile (the first step and the
evaluation graph) apart, as the ``compile`` record of its metrics.jsonl, and that record's
seconds and its step's tokens are taken out of its time and tokens. Everything else in
``trainer.run()`` stays counted, the steps right after the compile included. Both sides run
under the process-wide settings the Trainer switches on and never switches off (deterministic
algorithms as ``train.deterministic`` says and TF32 float32 matmuls, on CUDA): they are applied
once before the first repeat, so every repeat of either side runs under the same ones.

    flock /tmp/lm-cpu.lock python scripts/bench_train.py                      # configs/cpu-small.toml
    python scripts/bench_train.py --config configs/tinystories-17m.toml --steps 300   # on a GPU

Runs alternate (bare, train, train without eval, bare, ...); the best and median of each are compared.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from lm.cli.common import WrittenHelpParser
from lm.data import write_token_file
from lm.device import configure_matmul_precision, resolve_device
from lm.model import TransformerLM
from lm.nn import cross_entropy
from lm.optim import AdamW, clip_grad_norm_, param_groups
from lm.train import Trainer, load_config
from lm.train.determinism import configure_determinism
from lm.train.trainer import autocast_dtype


def trainer_settings(cfg) -> list[str]:
    """Switch on, for the whole process, what the Trainer does at its start and never switches off
    (deterministic CUDA algorithms as ``train.deterministic`` says, TF32 float32 matmuls on CUDA;
    nothing global on CPU), so that the bare step runs under them from its first repeat on. Call
    before any CUDA work: the cuBLAS setting is read when cuBLAS starts. Returns the log lines."""
    device = resolve_device(cfg.train.device, "train.device")
    lines = [configure_determinism(cfg.train.deterministic, device), configure_matmul_precision(device)]
    return [line for line in lines if line]


def bare_tokens_per_second(cfg, steps: int, warmup: int = 3) -> float:
    """Tokens/s of forward + backward + clip (unless ``optim.grad_clip`` is 0) + AdamW on one fixed
    batch, the model set up as the Trainer sets it (no per-step id checks), after ``warmup`` untimed
    steps (the compile with ``train.compile``). Run :func:`trainer_settings` first."""
    device = resolve_device(cfg.train.device, "train.device")
    torch.manual_seed(cfg.train.seed)
    model = TransformerLM.from_config(cfg.model).to(device)
    model.validate_ids = False  # as the Trainer sets it: no per-step read of the ids' range back to the host
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
        if cfg.optim.grad_clip > 0:  # as the Trainer: 0 means no clipping, not a clip at inf
            clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
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


def compile_records(out_dir: Path) -> list[dict]:
    """The ``compile`` records of a run's metrics.jsonl: one per step that compiled, with its seconds."""
    with open(out_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [r for r in map(json.loads, filter(str.strip, f)) if r.get("split") == "compile"]


def train_tokens_per_second(config: Path, overrides: list[str], out_dir: Path) -> float:
    """Tokens/s of a whole `lm train` run: setup and the compile the trainer reports apart excluded,
    everything else in ``run()`` included (data, logging, evaluation, checkpoints, export)."""
    cfg = load_config(config, [*overrides, f"train.out_dir={out_dir}"])
    trainer = Trainer(cfg, print_fn=lambda line: None)
    start = time.perf_counter()
    trainer.run()
    if trainer.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # The compile step's time (the evaluation graph's compile with it) and its tokens are left out,
    # as the bare step's compile is left out of its timing by its warm-up.
    compiled = compile_records(out_dir)
    seconds -= sum(r["seconds"] for r in compiled)
    return (trainer.step - len(compiled)) * trainer.tokens_per_step / seconds


def main() -> None:
    parser = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")  # one line, no usage
    parser.add_argument("--config", default="configs/cpu-small.toml")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--set", action="append", default=[], dest="overrides", metavar="SECTION.KEY=VALUE")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps: must be >= 2 (the first may compile), got {args.steps}")
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")

    try:  # a missing config, a misspelt or out-of-range --set, a device this machine lacks: one line
        cfg = load_config(args.config, args.overrides)
        resolve_device(cfg.train.device, "train.device")
    except ValueError as e:
        parser.error(str(e))

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
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
            "data.tokenizer=none",  # random ids: no tokenizer
            f"train.max_steps={args.steps}",
        ]
        cfg = load_config(args.config, overrides)
        print(
            f"{args.config}: {args.steps} steps x {cfg.train.batch_size * cfg.model.context_length} tokens, "
            f"eval every {cfg.eval.interval} ({cfg.eval.batches} batches), checkpoint every "
            f"{cfg.checkpoint.interval}, log every {cfg.log.interval}, torch threads {torch.get_num_threads()}"
        )
        for line in trainer_settings(cfg):  # before any CUDA work, for every repeat alike
            print(f"  {line}")
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
