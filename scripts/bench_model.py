"""Speed of lm's TransformerLM against Hugging Face Llama with the same shapes and weights.

Two measurements, each interleaved round by round in one process so that both sides see the
same machine state:

* training step (forward + backward + AdamW) tokens/s, eager and optionally torch.compile;
* greedy generation with the KV cache, new tokens/s, checking that the tokens are identical.

    python scripts/bench_model.py                    # eager training + generation
    python scripts/bench_model.py --compile          # also torch.compile training rows
    python scripts/bench_model.py --rounds 5 --steps 5

Both sides use torch.optim.AdamW (foreach) so the optimizer is not what is compared; the loss is
each side's own: lm.nn.cross_entropy for lm, torch's F.cross_entropy (as in transformers) for Llama.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lm.cli.common import WrittenHelpParser
from lm.export import to_transformers
from lm.generate import generate
from lm.model import TransformerLM
from lm.nn import cross_entropy

HF_GEN = "transformers generate (sdpa)"
SHAPE = dict(vocab_size=10_000, context_length=256, d_model=256, num_layers=4, num_heads=8, d_ff=688)
GEN_CONTEXT = 512  # the generation model's positions: prompt + new tokens must fit, or the sides differ


def llama_like(model: TransformerLM, attn_implementation: str = "sdpa"):
    return to_transformers(model, attn_implementation=attn_implementation).train()


def train_step_fn(model, kind: str):
    """``kind``: "hf" (Llama logits + torch's cross-entropy, as transformers computes its loss),
    "logits" (lm: ``cross_entropy(model(x), y)``) or "loss" (lm: ``model.loss(x, y)``, the fused
    lm_head + cross-entropy that never materialises the logits)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(x, y):
        loss = loss_of(model, kind, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def loss_of(model, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean next-token loss of a row of :func:`train_step_fn`'s ``kind``."""
    if kind == "hf":
        return F.cross_entropy(model(x).logits.float().flatten(0, 1), y.flatten())
    if kind == "logits":
        return cross_entropy(model(x), y)
    return model.loss(x, y)


HF_ROW = "transformers LlamaForCausalLM (sdpa), logits + F.cross_entropy"
MAX_LOSS_DIFFERENCE = 1e-4  # relative: float32 rounding of one loss, not another model


def loss_difference(contestants: dict, x: torch.Tensor, y: torch.Tensor) -> float:
    """The largest relative difference between a row's loss on the batch, before any step, and the
    transformers row's: the rows train the same model on the same batch only if it is small."""
    with torch.no_grad():
        losses = {name: loss_of(m, kind, x, y).item() for name, (m, kind) in contestants.items()}
    ref = losses[HF_ROW]
    return max(abs(loss - ref) / abs(ref) for loss in losses.values())


def bench_training(args) -> tuple[list[tuple[str, float]], float]:
    """Tokens/s of each row, interleaved rounds, medians; and :func:`loss_difference` before the steps."""
    torch.manual_seed(0)
    base = TransformerLM(**SHAPE)
    contestants = {}
    for impl in args.attn_impls:
        for kind, how in (("loss", "model.loss (fused lm_head + CE)"), ("logits", "model(x) + cross_entropy")):
            m = TransformerLM(**SHAPE, attn_impl=impl)
            m.load_state_dict(base.state_dict())
            contestants[f"lm, attn_impl={impl}, {how}"] = (m, kind)
    contestants[HF_ROW] = (llama_like(base), "hf")
    if args.compile:  # separate copies, so the eager rows stay eager
        for name, (m, kind) in list(contestants.items()):
            if "einsum" in name:
                continue  # compile time on a small CPU box: the sdpa rows and Llama only
            m = copy.deepcopy(m)
            if kind == "loss":
                m.loss = torch.compile(m.loss)
            else:
                m = torch.compile(m)
            contestants[name + " + torch.compile"] = (m, kind)
    steps = {name: train_step_fn(m, kind) for name, (m, kind) in contestants.items()}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, SHAPE["vocab_size"], (args.batch, SHAPE["context_length"] + 1), generator=g)
    x, y = x[:, :-1], x[:, 1:]
    difference = loss_difference(contestants, x, y)
    tokens = x.numel()
    for name, step in steps.items():  # warm-up (and compilation)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            step(x, y)
        print(f"  warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(x, y)
            rates[name].append(tokens * args.steps / (time.perf_counter() - t0))
        print(f"  round {r + 1}/{args.rounds} done", flush=True)
    return [(name, statistics.median(v)) for name, v in rates.items()], difference


def bench_generation(args) -> tuple[list[tuple[str, float]], bool, list[tuple[str, float]], bool]:
    """One stream, then ``args.streams`` streams at once: new tokens/s, interleaved rounds, medians.
    Every row's greedy tokens must equal transformers' for the same prompt."""
    torch.manual_seed(0)
    shape = {**SHAPE, "context_length": GEN_CONTEXT}  # prompt + new tokens fit (main checks): no window slides
    ours = {impl: TransformerLM(**shape, attn_impl=impl).eval() for impl in args.attn_impls}
    first = next(iter(ours.values()))
    for m in ours.values():
        m.load_state_dict(first.state_dict())
    compiled = ours.get("einsum", first)  # the compiled step: torch.compile of the fixed-shape decode
    hf = llama_like(first).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, shape["vocab_size"], (args.streams, args.prompt_len), generator=g)
    prompt = prompts[0]
    n = args.new_tokens

    def hf_generate(batch):
        with torch.no_grad():
            # every id is a token: with no attention_mask, generate would take the id 0 (pad_token_id) for padding
            out = hf.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False)
        return out[:, batch.shape[1]:].tolist()

    def timed(runners: dict, tokens: int) -> tuple[list[tuple[str, float]], dict]:
        outputs = {name: fn() for name, fn in runners.items()}  # warm-up (and compilation), the tokens
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.gen_rounds):
            for name, fn in runners.items():
                t0 = time.perf_counter()
                fn()
                rates[name].append(tokens / (time.perf_counter() - t0))
        return [(name, statistics.median(v)) for name, v in rates.items()], outputs

    one = {f"lm generate (attn_impl={impl})": (lambda m=m: generate(m, prompt.tolist(), n, temperature=0))
           for impl, m in ours.items()}
    one["lm generate, compiled step (compile=True)"] = lambda: generate(compiled, prompt.tolist(), n,
                                                                         temperature=0, compile=True)
    one[HF_GEN] = lambda: hf_generate(prompt[None])[0]
    rows, outputs = timed(one, n)
    identical = all(o == outputs[HF_GEN] for o in outputs.values())

    batch = prompts.tolist()
    many = {
        f"lm generate, {args.streams} streams (attn_impl={next(iter(ours))})":
            lambda: generate(first, batch, n, temperature=0),
        f"lm generate, {args.streams} streams, compiled step": lambda: generate(compiled, batch, n, temperature=0,
                                                                                 compile=True),
        f"{HF_GEN}, {args.streams} streams": lambda: hf_generate(prompts),
    }
    batch_rows, batch_outputs = timed(many, n * args.streams)
    reference = batch_outputs[f"{HF_GEN}, {args.streams} streams"]
    batch_identical = all(o == reference for o in batch_outputs.values()) and reference[0] == outputs[HF_GEN]
    return rows, identical, batch_rows, batch_identical


def print_table(title: str, rows: list[tuple[str, float]], unit: str, reference: str, valid: bool = True,
                differ: str = "the tokens differ") -> None:
    """``valid`` False (the sides' tokens, or losses, ``differ``): the ratio column says the ratios are
    not comparisons."""
    ref = dict(rows)[reference]
    print(f"\n{title}\n")
    print(f"| implementation | {unit} | vs transformers{'' if valid else f' (NOT VALID: {differ})'} |")
    print("|---|---:|---:|")
    for name, rate in rows:
        print(f"| {name} | {rate:,.0f} | {rate / ref:.2f}× |")


def too_large(args) -> str | None:
    """The error naming --batch or --streams when its tensors certainly cannot fit in memory (a lower
    bound: one model's training step; lm's key and value cache of the streams), else None. Such a
    size was the allocator's traceback, or torch's overflow past 2**63."""
    from lm.model import ModelConfig
    from lm.train.memory import available_bytes, step_bytes

    have = available_bytes(torch.device("cpu"))
    if have is None:
        return None
    needs = []
    if not args.skip_train:
        needs.append(("--batch", step_bytes(ModelConfig(**SHAPE), args.batch)["total"],
                      f"a training step of {args.batch:,} x {SHAPE['context_length']} tokens"))
    if not args.skip_generate:
        positions = args.prompt_len + args.new_tokens
        cache = args.streams * SHAPE["num_layers"] * 2 * positions * SHAPE["d_model"] * 4
        needs.append(("--streams", cache,
                      f"the key and value cache of {args.streams:,} streams of {positions} positions"))
    for flag, need, what in needs:
        if need > have:
            return (f"{flag}: {what} needs at least {need / 1e9:,.1f} GB but this machine has {have / 1e9:,.1f} GB "
                    f"free; lower {flag}")
    return None


def main() -> int:
    p = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: p.exit(2, f"{p.prog}: error: {message}\n")  # one line, no usage
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds (median reported)")
    p.add_argument("--steps", type=int, default=1, help="training steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="add torch.compile training rows")
    p.add_argument("--attn-impls", nargs="+", default=["sdpa", "einsum"], choices=["sdpa", "einsum"])
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--gen-rounds", type=int, default=5)
    p.add_argument("--streams", type=int, default=16, help="streams decoded at once in the batched rows")
    args = p.parse_args()
    for flag, value in (("--batch", args.batch), ("--rounds", args.rounds), ("--steps", args.steps),
                        ("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens),
                        ("--gen-rounds", args.gen_rounds), ("--streams", args.streams)):
        if value < 1:
            p.error(f"{flag}: must be >= 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup: must be >= 0, got {args.warmup}")
    if args.prompt_len + args.new_tokens > GEN_CONTEXT:  # past it lm slides its window, transformers does not
        p.error(f"--prompt-len + --new-tokens: must be <= the generation model's {GEN_CONTEXT} positions, got "
                f"{args.prompt_len} + {args.new_tokens} = {args.prompt_len + args.new_tokens}")
    if args.skip_train and args.skip_generate:
        p.error("--skip-train and --skip-generate: together they leave nothing to run; give one at most")
    problem = too_large(args)
    if problem:
        p.error(problem)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, cpu")
    status = 0  # 1: a table's sides did not do the same work
    if not args.skip_train:
        rows, difference = bench_training(args)
        same = difference <= MAX_LOSS_DIFFERENCE
        print_table(
            f"Training step (fwd+bwd+AdamW), batch {args.batch} × ctx {SHAPE['context_length']}, "
            f"vocab 10k, d 256, 4 layers, 8 heads, d_ff 688",
            [r for r in rows if "compile" not in r[0]],
            "tokens/s",
            HF_ROW,
            same,
            "the losses differ",
        )
        if args.compile:
            compiled_ref = HF_ROW + " + torch.compile"
            print_table(
                "torch.compile rows against compiled transformers",
                [r for r in rows if "compile" in r[0]],
                "tokens/s",
                compiled_ref,
                same,
                "the losses differ",
            )
        print(f"\nsame loss before the first step (every row against transformers'): {same} (relative difference "
              f"{difference:.1e})")
        if not same:
            print(f"bench_model.py: the rows' losses differ from transformers' by {difference:.1e} (more than "
                  f"{MAX_LOSS_DIFFERENCE:g}): the training ratios are not comparisons of the same work",
                  file=sys.stderr)
            status = 1
    if not args.skip_generate:
        rows, identical, batch_rows, batch_identical = bench_generation(args)
        print_table(
            f"Greedy generation, prompt {args.prompt_len}, {args.new_tokens} new tokens, batch 1 "
            f"(ctx {GEN_CONTEXT} model)",
            rows,
            "new tokens/s",
            HF_GEN,
            identical,
        )
        print(f"\nidentical tokens: {identical}")
        print_table(f"{args.streams} streams at once (prompts of {args.prompt_len}, {args.new_tokens} new tokens each)",
                    batch_rows, "new tokens/s, all streams", f"{HF_GEN}, {args.streams} streams", batch_identical)
        single = dict(rows)
        eager_one = single[f"lm generate (attn_impl={args.attn_impls[0]})"]
        compiled_one = single["lm generate, compiled step (compile=True)"]
        eager_many, compiled_many = batch_rows[0][1], batch_rows[1][1]
        print(f"\n{args.streams} streams against one: eager {eager_many / eager_one:.2f}×, "
              f"compiled {compiled_many / compiled_one:.2f}×; compiled {args.streams} streams against eager one "
              f"stream {compiled_many / eager_one:.2f}×")
        print(f"identical tokens ({args.streams} streams, each against transformers): {batch_identical}")
        if not (identical and batch_identical):
            print("bench_model.py: the generated tokens differ from transformers': the generation ratios are not "
                  "comparisons of the same work", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
