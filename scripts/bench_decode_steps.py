"""Milliseconds per decode step at each step size: what a server step costs with 1 … 16 rows.

    python scripts/bench_decode_steps.py            # the demo-shaped model of bench_serve.py; ~1 minute

For each size the serving engine would use (``lm.serve.engine.default_step_sizes``), eager and
compiled (the engine's own ``lm.generate.DecodeStep`` objects, the steps ``lm serve`` runs), the
median over interleaved rounds of 100 steps at positions 20 … 119 of a 256-position cache, which
sizes the engine's start-up probe keeps (a row's logits bit for bit those of the largest step)
and how long the engine took to start (with ``--compile``: its compilation). The compiled steps
run twice a round: as the engine runs them, attending over the span that holds the positions in
use (32 to 128 here), and over the whole cache. Set ``TORCHINDUCTOR_CACHE_DIR`` to an empty
folder to time a compilation from nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lm.cli.common import WrittenHelpParser
from lm.model import TransformerLM
from lm.serve.engine import Engine, default_step_sizes
from lm.train.memory import available_bytes

DEMO = dict(vocab_size=2048, context_length=256, d_model=192, num_layers=4, num_heads=6, d_ff=512)


def main() -> None:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = lambda message: ap.exit(2, f"{ap.prog}: error: {message}\n")  # one line, no usage
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for flag, value in (("--max-batch", args.max_batch), ("--rounds", args.rounds)):
        if value < 1:
            ap.error(f"{flag}: must be >= 1, got {value}")
    # two engines (eager, compiled), each with a float32 key and value cache of --max-batch rows
    # of context + 1 positions in every layer: refused in a line, not by the allocator's traceback
    need = 2 * args.max_batch * DEMO["num_layers"] * 2 * (DEMO["context_length"] + 1) * DEMO["d_model"] * 4
    have = available_bytes(torch.device("cpu"))
    if have is not None and need > have:
        ap.error(f"--max-batch: {args.max_batch:,} rows need {need / 1e9:,.1f} GB for the two engines' KV caches "
                 f"but this machine has {have / 1e9:,.1f} GB free; lower --max-batch")
    torch.manual_seed(0)
    model = TransformerLM(**DEMO).eval()
    sizes = default_step_sizes(args.max_batch)
    engines, startup = {}, {}
    for mode in ("eager", "compiled"):  # the engine's own steps (compiled: one shared compilation)
        t0 = time.perf_counter()
        engines[mode] = Engine(model, max_batch=args.max_batch, compile=mode == "compiled")
        startup[mode] = time.perf_counter() - t0
    modes = ("eager", "compiled", "compiled, whole cache")
    steps = {(mode, b): engines[mode.split(",")[0]].steps[b] for mode in modes for b in sizes}
    whole = {mode: mode.endswith("whole cache") for mode in modes}
    for (mode, b), step in steps.items():  # warm-up
        for position in range(20):
            step([1] * b, [position] * b, full_span=whole[mode])
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for _ in range(args.rounds):
        for (mode, b), step in steps.items():
            t0 = time.perf_counter()
            for position in range(20, 120):
                step([1] * b, [position] * b, full_span=whole[mode])
            times[mode, b].append((time.perf_counter() - t0) / 100 * 1e3)
    kept = {mode: engine.step_sizes for mode, engine in engines.items()}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per decode step (tokens/s)\n")
    print(f"| rows | {' | '.join(modes)} |\n|---:|---:|---:|---:|")
    for b in sizes:
        cells = []
        for mode in modes:
            ms = statistics.median(times[mode, b])
            cells.append(f"{ms:.2f} ({b * 1e3 / ms:,.0f})" + ("" if b in kept[mode.split(",")[0]] else ", dropped"))
        print(f"| {b} | {' | '.join(cells)} |")
    print(f"\nkept by the engine's probe: eager {kept['eager']}, compiled {kept['compiled']}; engine start-up "
          f"(steps made, compiled, probed): eager {startup['eager']:.1f} s, compiled {startup['compiled']:.1f} s")


if __name__ == "__main__":
    main()
