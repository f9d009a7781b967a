"""The first thing to run on a GPU machine: every check that needs a device, in one call, one table.

    PYTHONPATH=. python scripts/gpu_check.py                 # CUDA: within --budget, 540 s by default
    PYTHONPATH=. python scripts/gpu_check.py --device cpu    # a short version of every part but the tests (~1 minute)
    PYTHONPATH=. python scripts/gpu_check.py --parts tests,ddp   # some parts only (a rerun on a warm machine)

The whole run keeps to ``--budget`` seconds (default 540 on CUDA: a rented machine's 10-minute
limit, less a margin): each part gets what is left, training ``--seconds`` (default 60 on CUDA)
at most, a part that cannot fit is reported as skipped, every subprocess is bounded by the time
left, and with ``--json FILE`` (a new file, or ``--overwrite``) the rows are rewritten after every
part, so a run cut short keeps what it measured. Parts, each run even if one before failed, the most wanted first:

1. **parity**: the same weights on the device and on the CPU in float32 (logits), bfloat16
   autocast against float32 (loss), ``torch.compile`` against eager (logits), ``torch.func``'s
   per-sample gradients against autograd's, and compiled against eager;
2. **decoding**: the compiled fixed-shape step (a CUDA graph on CUDA) against the eager loop,
   tokens identical; new tokens/s for one stream and for 16 (eager and compiled alternating, the
   median of 5 rounds) and their ratio (issue 12's target on CUDA: >= 8x); where a call's time goes
   (the compiled step alone at 1 and 16 rows, the greedy pick, a prompt's prefill); the serving
   engine's step sizes
   (which ones give a row the same bits as sixteen rows, in every slot, on this device), the
   engine ``lm serve`` runs by default there (bfloat16 autocast on CUDA): a seeded request alone
   and beside fifteen others, and, on CUDA, its compiled steps (CUDA graphs) against eager
   generation;
3. **transformers**: one stream, greedy, of ``scripts/bench_model.py``'s generation model: lm's
   compiled step against ``transformers``' ``generate`` on the same weights, tokens identical, new
   tokens/s and their ratio (issue 12's target on CUDA: >= 1.5x);
4. **training**: ``configs/tinystories-17m.toml`` for ``--seconds`` on the data it can find
   (``$LM_TEST_DATA/tinystories_sample.txt``, else the demo's synthetic stories), bfloat16 where
   the device has it, compiled: tokens/s, MFU, peak memory, the loss on a held-out twentieth of the
   text, and on CUDA the host–device syncs per step (``torch.cuda.set_sync_debug_mode``);
5. **determinism**: ``train.deterministic`` (the default) on the device, eager, the training
   part's config and data: two runs of 24 steps give the same losses, weights and AdamW moments
   bit for bit, and a third resumed from the first one's step-8 checkpoint ends with the same;
6. **tests**: the model, generation and serving-engine tests (the model's device tests run on
   CUDA when it is there); skipped with ``--device cpu``, where the test suite runs them anyway.
   They need pytest, and hypothesis (tests/test_generate.py) and uvicorn (tests/test_serve.py):
   a file whose package is missing is left out and named, not allowed to stop the others;
7. **translation** (engine): the encoder–decoder's batched decode steps (compiled on CUDA, with
   each row's source in a static cross-attention cache) against ``greedy_decode``, tokens equal;
8. **ddp**: ``torchrun`` with every visible GPU (nccl), or 2 CPU processes (gloo).

The machine has no internet: nothing here downloads. ``--device cpu`` shrinks the model and the
times so that ``tests/test_gpu_check.py`` runs it in the test suite, and the script cannot rot
between the rare sessions with a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lm.cli.common import WrittenHelpParser  # noqa: E402
from lm.generate import generate  # noqa: E402
from lm.model import TransformerLM  # noqa: E402
from lm.nn import cross_entropy  # noqa: E402

SPECIAL = "<|endoftext|>"
# --parts, in run order
PARTS = ("parity", "decoding", "transformers", "training", "determinism", "tests", "translation", "ddp")


class Report:
    def __init__(self, json_path: str | None = None, budget: float = float("inf")):
        self.rows: list[tuple[str, bool | None, str]] = []
        self.json_path = json_path
        self.deadline = time.monotonic() + budget

    def left(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()

    def add(self, part: str, ok: bool | None, detail: str) -> None:
        self.rows.append((part, ok, detail))
        mark = "pass" if ok else "skip" if ok is None else "FAIL"
        print(f"[{mark}] {part}: {detail}", flush=True)
        if self.json_path:  # after every row: a run cut short keeps what it measured
            self.write_json()

    def write_json(self) -> None:
        """The rows so far to ``json_path`` (the file this run made: see ``json_output``), through a
        temporary name. A failed write is said once and ends the writes; the table still comes."""
        path = Path(self.json_path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps([dict(part=p, ok=o, detail=d) for p, o, d in self.rows], indent=1))
            os.replace(tmp, path)
        except OSError as e:
            print(f"gpu_check.py: --json: cannot write {str(path)!r} ({e.strerror or e}); no more rows go there, "
                  "the table at the end has them all", file=sys.stderr, flush=True)
            tmp.unlink(missing_ok=True)
            self.json_path = None

    def table(self) -> str:
        lines = ["| part | result | measured |", "|---|---|---|"]
        for part, ok, detail in self.rows:
            lines.append(f"| {part} | {'pass' if ok else 'skipped' if ok is None else '**FAIL**'} | {detail} |")
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        return all(ok is not False for _, ok, _ in self.rows)


def guarded(report: Report, part: str, fn, needs: float = 0.0) -> None:
    """Run one part; a failure is a row, not the end. A part that needs more seconds than are left is skipped."""
    if report.left() < needs:
        return report.add(part, None, f"not run: {max(report.left(), 0):.0f} s of the budget left, it needs "
                                      f"about {needs:.0f} s (raise --budget)")
    try:
        fn()
    except subprocess.TimeoutExpired as e:
        report.add(part, False, f"stopped after {e.timeout:.0f} s, at the end of the budget")
    except Exception as e:  # one failing part must not hide the others
        report.add(part, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_tests(report: Report, device: torch.device, reserve: float = 0.0) -> None:
    """The tests, given the time left less ``reserve`` (the later parts' share)."""
    if device.type != "cuda":
        return report.add("tests", None, "the test suite runs them on CPU")
    if importlib.util.find_spec("pytest") is None:
        return report.add("tests", None, "not run: pytest is not installed (pip install pytest hypothesis uvicorn)")
    # each file with the packages it imports besides the project's: one missing must not stop the others
    files = {"tests/test_model.py": (), "tests/test_optim.py": (), "tests/test_generate.py": ("hypothesis",),
             "tests/test_serve.py": ("uvicorn", "starlette", "httpx")}
    tests, left_out = [], []
    for path, packages in files.items():
        missing = [p for p in packages if importlib.util.find_spec(p) is None]
        (left_out.append(f"{path} (no {', '.join(missing)})") if missing else tests.append(path))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO,
                       capture_output=True, text=True, timeout=max(report.left() - reserve, 30))
    lines = r.stdout.strip().splitlines() or ["(no output) " + (r.stderr.strip().splitlines() or [""])[-1][:200]]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))][:5]
    detail = "; ".join([lines[-1], *failed]) + (f"; left out {', '.join(left_out)}" if left_out else "")
    report.add("tests (model and AdamW on cuda, generation, serving engine)", r.returncode == 0, detail)


def part_parity(report: Report, device: torch.device, shape: dict) -> None:
    torch.manual_seed(0)
    cpu_model = TransformerLM(**shape).eval()
    model = TransformerLM(**shape).to(device).eval()
    model.load_state_dict(cpu_model.state_dict())
    ids = torch.randint(0, shape["vocab_size"], (4, shape["context_length"]))
    with torch.no_grad():
        want = cpu_model(ids).double()
        got = model(ids.to(device)).double().cpu()
        err = (got - want).abs().max().item()
        report.add("float32 logits, device vs CPU", err < 1e-3, f"max abs diff {err:.1e} (bound 1e-3)")
        x, y = ids[:, :-1].to(device), ids[:, 1:].to(device)
        full = cross_entropy(model(x).float(), y).item()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            half = cross_entropy(model(x).float(), y).item()
        report.add("bfloat16 autocast loss vs float32", abs(half - full) < 0.02,
                   f"{half:.4f} vs {full:.4f} (bound 0.02)")
        compiled = torch.compile(model)
        err = (compiled(ids.to(device)).double().cpu() - got).abs().max().item()
        report.add("torch.compile logits vs eager", err < 1e-3, f"max abs diff {err:.1e} (bound 1e-3)")
    per_sample, args, per, row = per_sample_gradients(model, ids[:2, :32].to(device))
    report.add(*row)  # before compiling: a compile that fails keeps this row
    report.add(*compiled_per_sample_gradients(per_sample, args, per))


def per_sample_gradients(model, ids: torch.Tensor) -> tuple[Callable, tuple, dict, tuple[str, bool, str]]:
    """``torch.func``'s per-sample gradients (``vmap(grad(loss))``, the formulas lm runs under a
    transform) against autograd through the hand-written backward passes, one sample at a time:
    the largest difference over every parameter, relative to its gradient's largest entry (float32:
    other sums, the fused loss's chunks; 1e-7 on a CPU). Returns the transform, its arguments and
    gradients (for :func:`compiled_per_sample_gradients`), and the row."""
    from torch.func import functional_call, grad, vmap

    params = {name: p.detach() for name, p in model.named_parameters()}
    x, y = ids[:, :-1], ids[:, 1:]

    def loss(p, xs, ys):
        return cross_entropy(functional_call(model, p, (xs[None],)), ys[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    per = per_sample(params, x, y)
    worst = 0.0
    for b in range(x.shape[0]):
        model.zero_grad()
        cross_entropy(model(x[b:b + 1]), y[b:b + 1]).backward()
        for name, p in model.named_parameters():
            scale = p.grad.abs().max().item() or 1.0
            worst = max(worst, (per[name][b] - p.grad).abs().max().item() / scale)
    model.zero_grad()
    return per_sample, (params, x, y), per, (
        "per-sample gradients (torch.func vmap(grad)) vs autograd", worst < 1e-4,
        f"largest difference {worst:.1e} of a gradient's largest entry (bound 1e-4), {x.shape[0]} samples")


def compiled_per_sample_gradients(per_sample: Callable, args: tuple, per: dict) -> tuple[str, bool, str]:
    """The same transform compiled (``torch.compile(vmap(grad(loss)))``) against the eager one's
    gradients ``per``: the largest difference relative to each gradient's largest entry."""
    compiled = torch.compile(per_sample)(*args)
    worst = max(((compiled[k] - per[k]).abs().max() / per[k].abs().max().clamp_min(1e-30)).item() for k in per)
    return ("per-sample gradients compiled (torch.compile(vmap(grad))) vs eager", worst < 1e-4,
            f"largest difference {worst:.1e} of a gradient's largest entry (bound 1e-4)")


def interleaved(device: torch.device, runs: dict, rounds: int = 5) -> dict[str, float]:
    """``runs``: {name: (fn, tokens a call makes)}. Each called once to warm it (compiling), then
    once per round, in turn (so that a drift of clocks or load falls on all of them alike): the
    median tokens/s of each."""
    for fn, _ in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, _) in runs.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: runs[name][1] / statistics.median(t) for name, t in times.items()}


def step_breakdown(model, device: torch.device, prompts: list[list[int]], new_tokens: int) -> str:
    """A compiled ``generate`` call of 1 and of 16 rows, taken apart: the compiled step alone (the one
    ``generate`` made, rows at mid-context), a prompt's eager prefill, and the greedy pick with its
    read to the host, each the median of 50 timed calls (the prefill's of 10)."""
    from lm.generate.engine import decode_step_for
    from lm.generate.sampling import next_token_and_finite

    def timed(fn, calls: int = 50) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(calls):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    need = len(prompts[0]) + new_tokens
    max_len = min(model.config.context_length, 64 * -(-need // 64))  # as generate's compiled path rounds it
    parts = []
    with torch.inference_mode(), model.trusted_ids():
        for rows in (1, 16):
            step = decode_step_for(model, rows, max_len)
            ids, lengths = [1] * rows, [need // 2] * rows
            ms = timed(lambda step=step, ids=ids, lengths=lengths: step(ids, lengths))
            logits = step(ids, lengths)
            pick = timed(lambda logits=logits: torch.stack(
                [t.to(torch.long) for t in next_token_and_finite(logits, temperature=0)]).tolist())
            parts.append(f"{rows} row{'s' if rows > 1 else ''}: step {ms:.3f} ms, greedy pick and read {pick:.3f} ms")
        prompt = torch.tensor([prompts[0]], device=device)
        prefill = timed(lambda: model(prompt, kv_cache=model.new_cache(1, max_len=prompt.shape[1]), last_only=True), 10)
    return "; ".join(parts) + f"; one {len(prompts[0])}-token prompt's eager prefill {prefill:.3f} ms"


def part_decoding(report: Report, device: torch.device, shape: dict, new_tokens: int) -> None:
    torch.manual_seed(0)
    model = TransformerLM(**shape).to(device).eval()
    prompts = torch.randint(0, shape["vocab_size"], (16, 32)).tolist()
    eager = generate(model, prompts[0], new_tokens, temperature=0)
    same_one = generate(model, prompts[0], new_tokens, temperature=0, compile=True) == eager
    same_many = generate(model, prompts, new_tokens, temperature=0, compile=True)[0] == eager

    runs = {"one eager": lambda: generate(model, prompts[0], new_tokens, temperature=0),
            "one compiled": lambda: generate(model, prompts[0], new_tokens, temperature=0, compile=True),
            "16 eager": lambda: generate(model, prompts, new_tokens, temperature=0),
            "16 compiled": lambda: generate(model, prompts, new_tokens, temperature=0, compile=True)}
    rate = interleaved(device, {name: (fn, (16 if name.startswith("16") else 1) * new_tokens)
                                for name, fn in runs.items()})
    ratio = rate["16 compiled"] / rate["one compiled"]
    report.add("decoding: compiled step tokens == eager tokens (1 and 16 streams)", same_one and same_many,
               f"new tokens/s, interleaved medians of 5: 1 stream {rate['one eager']:,.0f} eager / "
               f"{rate['one compiled']:,.0f} compiled; 16 streams {rate['16 eager']:,.0f} eager / "
               f"{rate['16 compiled']:,.0f} compiled")
    # issue 12's target, on CUDA (a CPU's cores bound it lower: see the README's decoding table)
    report.add("decoding: 16 compiled streams >= 8x one compiled stream", ratio >= 8 if device.type == "cuda" else None,
               f"{ratio:.1f}x" + ("" if device.type == "cuda" else " (the target is for CUDA; not judged here)"))
    guarded(report, "decoding: where a call's time goes",  # (a failure here must not cost the engine's rows)
            lambda: report.add("decoding: where a call's time goes", True,
                               step_breakdown(model, device, prompts, new_tokens)))
    from lm.serve.engine import Engine, SamplingParams

    engine = Engine(model, max_batch=16)  # eager: its start-up probe, on this device
    report.add("serving engine: a row's logits the same in every slot (eager step sizes)", engine.slot_invariant,
               f"sizes kept {engine.step_sizes}, dropped {engine.dropped_sizes}")
    from lm.device import resolve_dtype

    # lm serve's default engine here, bfloat16 autocast on CUDA (--dtype auto; on a CPU asked for),
    # eager and (on CUDA) with --compile: a seeded request's tokens alone and beside fifteen others.
    dtype = resolve_dtype("auto", device) or torch.bfloat16

    def seeded(engine: Engine, companions: int) -> list[int]:
        target = [(prompts[0][:8], SamplingParams(max_tokens=24, temperature=1.0, seed=5))]
        others = [(prompts[k + 1][: 4 + k], SamplingParams(max_tokens=30, temperature=0.8, seed=k))
                  for k in range(companions)]
        return run_requests(engine, target + others)[0]

    for compiled in (False, True) if device.type == "cuda" else (False,):
        engine = Engine(model, max_batch=16, dtype=dtype, compile=compiled)
        alone, beside = seeded(engine, 0), seeded(engine, 15)
        report.add(f"serving engine, bfloat16 autocast{', compiled' if compiled else ''}: a seeded request alone "
                   "== beside 15 others", len(alone) == 24 and alone == beside,
                   f"sizes kept {engine.step_sizes}, dropped {engine.dropped_sizes}; "
                   f"steps by size {dict(engine.stats.steps)}")
    if device.type == "cuda":  # the compiled steps (CUDA graphs, one compilation shared by the sizes)
        t0 = time.perf_counter()
        engine = Engine(model, max_batch=4, compile=True)
        seconds = time.perf_counter() - t0
        greedy = SamplingParams(max_tokens=24, temperature=0.0)
        got = run_requests(engine, [(prompts[k][: 8 + 8 * k], greedy) for k in range(3)])
        want = [generate(model, prompts[k][: 8 + 8 * k], 24, temperature=0) for k in range(3)]
        report.add("serving engine, compiled: greedy tokens == eager generate", got == want,
                   f"sizes kept {engine.step_sizes}, dropped {engine.dropped_sizes}; start-up {seconds:.0f} s")


def run_requests(engine, requests: list) -> list[list[int]]:
    """Each (prompt, SamplingParams) submitted to ``engine`` at once, stepped until idle: its tokens."""
    from lm.serve.engine import Request

    tokens: list[list[int]] = [[] for _ in requests]
    for k, (prompt, params) in enumerate(requests):
        engine.submit(Request(prompt, params, on_token=lambda _, t, k=k: tokens[k].append(t)))
    while engine.step():
        pass
    return tokens


def part_transformers(report: Report, device: torch.device, cpu: bool) -> None:
    """Issue 12's one-stream claim on this device: ``scripts/bench_model.py``'s generation model (8M
    parameters, 32-token prompt), greedy, lm's compiled step against ``transformers``' ``generate``
    on the same weights (sdpa), new tokens/s, the median of 5 interleaved calls; tokens identical. On
    CUDA the target is >= 1.5x; on a CPU (the test suite's short run) only the tokens are checked."""
    if importlib.util.find_spec("transformers") is None:
        return report.add("one stream vs transformers generate", None, "not run: transformers is not installed")
    from lm.export.hf import to_transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=10_000, context_length=512, d_model=256, num_layers=4, num_heads=8, d_ff=688)
    if cpu:
        shape.update(vocab_size=2048, context_length=128, d_model=64, num_layers=2, num_heads=4, d_ff=192)
    model = TransformerLM(**shape).to(device).eval()
    hf = to_transformers(model, attn_implementation="sdpa").to(device).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    prompt = torch.randint(0, shape["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(1))
    n = 32 if cpu else 256

    def ours() -> list[int]:
        return generate(model, prompt[0].tolist(), n, temperature=0, compile=True)

    def theirs() -> list[int]:
        ids = prompt.to(device)  # every id is a token: without the mask, id 0 (pad_token_id) would be padding
        with torch.no_grad():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False)[0, ids.shape[1]:].tolist()

    same = ours() == theirs()
    rate = interleaved(device, {"ours": (ours, n), "theirs": (theirs, n)})
    rate_ours, rate_theirs = rate["ours"], rate["theirs"]
    ratio = rate_ours / rate_theirs
    report.add("one stream vs transformers generate (greedy, tokens identical" + ("" if cpu else ", >= 1.5x") + ")",
               same and (cpu or ratio >= 1.5),
               f"new tokens/s: lm compiled step {rate_ours:,.0f}, transformers generate {rate_theirs:,.0f} "
               f"({ratio:.2f}x); tokens {'identical' if same else 'DIFFER'}")


def part_translation(report: Report, device: torch.device, cpu: bool) -> None:
    """The translation engine's batched steps (compiled on CUDA) against greedy_decode, one sentence at a time."""
    from lm.generate import greedy_decode
    from lm.model import Seq2SeqConfig, build_model
    from lm.serve.engine import SamplingParams
    from lm.serve.translation import TranslationEngine

    torch.manual_seed(0)
    cfg = Seq2SeqConfig(vocab_size=1000, context_length=64, d_model=64 if cpu else 256, encoder_layers=2,
                        decoder_layers=2, num_heads=4, dropout=0.0)
    model = build_model(cfg).to(device).eval()
    with torch.no_grad():  # sharper distributions than the init's, so that sentences differ
        model.embeddings.weight.mul_(6.0)
    sources = [torch.randint(3, cfg.vocab_size, (6 + 5 * k,)).tolist() for k in range(4)]
    t0 = time.perf_counter()
    engine = TranslationEngine(model, max_batch=4, compile=not cpu)
    seconds = time.perf_counter() - t0
    got = run_requests(engine, [(src, SamplingParams(max_tokens=40, temperature=0.0)) for src in sources])
    want = [greedy_decode(model, [src])[0][:40] for src in sources]
    report.add(f"translation engine{'' if cpu else ', compiled'}: greedy tokens == greedy_decode", got == want,
               f"sizes kept {engine.step_sizes}, dropped {engine.dropped_sizes}; start-up {seconds:.0f} s; "
               f"steps by size {dict(engine.stats.steps)}")


def find_corpus(work: Path, size: int) -> tuple[Path, Path | None]:
    """The training text and its held-out text: ``$LM_TEST_DATA``'s TinyStories sample and the head of
    TinyStories' own validation split beside it; else the demo's synthetic stories and None (the
    caller holds out their end)."""
    data = os.environ.get("LM_TEST_DATA")
    if data and (Path(data) / "tinystories_sample.txt").exists():
        valid = Path(data) / "tinystories_valid_head.txt"
        return Path(data) / "tinystories_sample.txt", valid if valid.exists() else None
    from lm.demo.stories import write_corpus

    write_corpus(work / "stories.txt", size, seed=0)
    return work / "stories.txt", None


def lm(*args, env=None, timeout: float | None = None) -> None:
    """``lm ARGS --quiet``; a failure raises with the command's own last line (its one-line error)."""
    r = subprocess.run([sys.executable, "-m", "lm", *map(str, args), "--quiet"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["(no message)"])[-1][:300]
        raise RuntimeError(f"lm {' '.join(map(str, args[:2]))} exited {r.returncode}: {last}")


def split_corpus(corpus: Path, work: Path) -> tuple[Path, Path]:
    """The corpus's last twentieth of documents (at least one) held out as validation text:
    ``work/train.txt``, ``work/val.txt``. Documents end at end-of-text markers where the corpus has
    20 or more, else at line ends; blank ones are left out, and each keeps its marker. A corpus of
    fewer than two documents has nothing to hold out: refused. (The validation loss was the
    training data's: 0.33 after 30 epochs of the sample in 10 s on an H200.)"""
    text = corpus.read_text(encoding="utf-8")
    by_marker = text.count(SPECIAL) >= 20
    pieces = [p + SPECIAL if by_marker else p for p in
              (text.split(SPECIAL) if by_marker else text.splitlines(keepends=True)) if p.strip()]
    if len(pieces) < 2:
        raise ValueError(f"corpus: {str(corpus)!r} holds {len(pieces)} document(s) (lines that are not blank); "
                         "need at least 2 to hold one out as validation text")
    cut = len(pieces) - max(1, len(pieces) // 20)
    (work / "train.txt").write_text("".join(pieces[:cut]), encoding="utf-8")
    (work / "val.txt").write_text("".join(pieces[cut:]), encoding="utf-8")
    return work / "train.txt", work / "val.txt"


def prepare_data(work: Path, cpu: bool, report: Report) -> Path:
    """A tokenizer trained on the training text, and both texts tokenized (train.bin, val.bin), each
    command bounded by the budget left when it starts."""
    corpus, valid = find_corpus(work, 2_000_000 if cpu else 20_000_000)
    train, val = (corpus, valid) if valid is not None else split_corpus(corpus, work)
    lm("tokenizer", "train", "--input", train, "--vocab-size", "1024", "--special-token", SPECIAL,
       "--out", work / "tok", timeout=max(report.left() - 5, 1))
    for text, out in ((train, "train.bin"), (val, "val.bin")):
        lm("tokenize", "--tokenizer", work / "tok", "--input", text, "--out", work / out,
           timeout=max(report.left() - 5, 1))
    return corpus


def train_overrides(work: Path, out: str, device: torch.device, seconds: float, cpu: bool) -> list[str]:
    sets = [f"data.train={work / 'train.bin'}", f"data.val={work / 'val.bin'}", f"data.tokenizer={work / 'tok'}",
            f"train.out_dir={work / out}", f"train.max_time={seconds}", "optim.cosine_cycle_iters=20000",
            "checkpoint.interval=100000", "eval.batches=10", "log.interval=10", f"train.device={device}",
            "train.dtype=auto", "train.deterministic=false", "wandb.mode=disabled"]
    if cpu:  # a short version: a small model, no compile
        sets += ["model.d_model=64", "model.num_heads=4", "model.d_ff=192", "model.context_length=64",
                 "train.batch_size=4", "train.compile=false", "eval.interval=20", "log.interval=5"]
    else:
        sets += ["eval.interval=1000"]
    return sets


def part_training(report: Report, device: torch.device, work: Path, seconds: float, cpu: bool) -> None:
    from lm.train import Trainer, load_config, read_metrics

    cfg = load_config(REPO / "configs" / "tinystories-17m.toml", train_overrides(work, "run", device, seconds, cpu))
    syncs = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        status = Trainer(cfg, print_fn=lambda *a: None).run()
    wall = time.perf_counter() - t0
    if status != 0:  # 128 + the signal the trainer stopped for: the check stops too, not a FAIL row and on (demo21)
        from lm.train import TrainingInterrupted

        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        report.add("training", None, f"interrupted (status {status}) after {wall:.0f} s")
        raise TrainingInterrupted(status)
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message)]
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        memory = f"peak {peak:.1f} GiB allocated"
    else:
        memory = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    records = read_metrics(work / "run")
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    last = train[-1]
    compiled = [r["seconds"] for r in records if r["split"] == "compile"]
    compile_s = f"compile {compiled[0]:.0f} s, " if compiled else ""
    per_step = f"; {len(syncs) / max(last['step'], 1):.1f} host-device syncs per step" if device.type == "cuda" else ""
    # the run's means over its training time (the trainer leaves compiling and evaluation out of it)
    tokens_per_step = cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.model.context_length
    mean_rate = last["step"] * tokens_per_step / last["time"]
    # MFU is null on a GPU of no known peak (lm.train.flops.GPU_PEAK_TFLOPS)
    mfu = ("MFU ? (no known peak)" if last["mfu"] is None
           else f"MFU {100 * last['mfu'] * mean_rate / last['tok_per_s']:.1f}%")
    report.add(f"training: tinystories-17m config{' (shrunk)' if cpu else ''}, {seconds:.0f} s",
               status == 0 and bool(val),
               f"{last['step']} steps in {last['time']:.1f} s of training: {1000 * last['time'] / last['step']:.1f} "
               f"ms/step, {mean_rate:,.0f} tokens/s, {mfu} (the last log window: "
               f"{last['tok_per_s']:,.0f} tokens/s), {memory}, val loss {val[-1]['loss']:.3f} (held-out text; "
               f"train {last['loss']:.3f}); {compile_s}{wall:.0f} s in all{per_step}")


def part_determinism(report: Report, device: torch.device, work: Path, cpu: bool, left: float) -> None:
    """``train.deterministic`` (the default) on this device: two runs of the same config take the
    same steps bit for bit, and a third resumed from the first one's middle checkpoint ends with
    its weights (issue 10; on CUDA: torch's deterministic algorithms and CUBLAS_WORKSPACE_CONFIG).
    Each run is ``lm train`` in a process of its own, as a user starts one: cuBLAS reads its
    workspace setting when a process first uses it, and deterministic mode, once on, stays on for
    the rest of a process (the later parts of this one measure what ``lm serve`` runs). Eager, so
    that the three runs cost seconds, not three compilations."""
    from lm.checkpoint.io import read_checkpoint
    from lm.train import read_metrics

    steps, every = 24, 8
    sets = [f"train.max_steps={steps}", "train.max_time=none", f"optim.cosine_cycle_iters={steps}",
            "train.deterministic=true", "train.compile=false", f"checkpoint.interval={every}",
            "checkpoint.keep_last=0", f"eval.interval={every}", "log.interval=1"]
    config = REPO / "configs" / "tinystories-17m.toml"
    t0 = time.perf_counter()

    def run(name: str, *resume: str) -> tuple[dict[int, float], dict]:
        overrides = [x for item in [*train_overrides(work, name, device, 60.0, cpu), *sets] for x in ("--set", item)]
        lm("train", "--config", config, *overrides, *resume, timeout=max(left - (time.perf_counter() - t0), 1))
        losses = {r["step"]: r["loss"] for r in read_metrics(work / name) if r["split"] == "train"}
        return losses, read_checkpoint(work / name / "checkpoints" / f"step_{steps:08d}.pt")

    first, a = run("det_a")
    second, b = run("det_b")
    middle = work / "det_a" / "checkpoints" / f"step_{steps // 2 // every * every:08d}.pt"
    resumed, c = run("det_c", "--resume", str(middle))

    def differ(x: dict, y: dict) -> list[str]:
        names = [k for k in x["model"] if not torch.equal(x["model"][k], y["model"][k])]
        pairs = zip(x["optimizer"]["state"].values(), y["optimizer"]["state"].values())
        moments = [i for i, (mx, my) in enumerate(pairs)
                   if not all(torch.equal(mx[m], my[m]) for m in ("exp_avg", "exp_avg_sq"))]
        return names + [f"AdamW moments of parameter {i}" for i in moments]

    same_losses = first == second and len(first) == steps
    after = {s: v for s, v in first.items() if s in resumed}
    same_resumed = bool(resumed) and after == resumed
    ab, ac = differ(a, b), differ(a, c)
    dtype = "bfloat16 autocast" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    report.add(f"deterministic training: 2 runs of {steps} steps and one resumed at step {int(middle.stem[5:])}",
               same_losses and same_resumed and not ab and not ac,
               f"{dtype}, eager, a process each; losses equal: {same_losses} (last {first.get(steps, float('nan')):.6f}"
               f" vs {second.get(steps, float('nan')):.6f}), resumed run's losses equal: {same_resumed}; weights and "
               f"AdamW moments at step {steps}: " + ("equal in all three" if not ab and not ac else
                                                    f"differ: {(ab + ac)[:3]}") + f"; {time.perf_counter() - t0:.0f} s")


def part_ddp(report: Report, device: torch.device, work: Path, seconds: float, cpu: bool) -> None:
    procs = torch.cuda.device_count() if device.type == "cuda" else 2
    sets = train_overrides(work, "ddp", "cuda" if device.type == "cuda" else "cpu", seconds, cpu)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "-m", "lm",
            "train", "--config", str(REPO / "configs" / "tinystories-17m.toml"), "--quiet"]
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # a hang (ranks waiting in different collectives) must fail this part, not stall the script
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=max(min(report.left() - 5, 240 if cpu else 600), 1))
    from lm.train import read_metrics

    ok = r.returncode == 0
    detail = f"exit {r.returncode}"
    if ok:
        train = [x for x in read_metrics(work / "ddp") if x["split"] == "train"]
        detail = f"{procs} processes ({'nccl' if device.type == 'cuda' else 'gloo'}), {train[-1]['step']} steps, " \
                 f"{train[-1]['tok_per_s']:,.0f} tokens/s"
    else:
        detail += ": " + (r.stderr.strip().splitlines() or [""])[-1][:200]
    report.add("DDP through torchrun", ok, detail)


def json_output(value: str, overwrite: bool) -> str | None:
    """``--json``'s file, resolved against the caller's folder (``GPU_CHECK_CWD``, set by
    gpu_check.sh before it changes to the checkout); or None with the one-line error printed.
    An existing file is an earlier session's rows: kept unless ``--overwrite`` (then replaced at
    the first row). A new one is made now, empty, so that a bad folder is found before any part."""
    path = Path(os.environ.get("GPU_CHECK_CWD") or os.getcwd(), value)
    error = None
    if not path.parent.is_dir():
        error = f"the folder {str(path.parent)!r} does not exist; make it first"
    elif path.is_dir():
        error = f"{str(path)!r} is a folder; name a file in it"
    elif path.exists() and not overwrite:
        error = f"{str(path)!r} exists (an earlier run's rows?); pass --overwrite to replace it, or name a new file"
    elif path.exists():
        if not os.access(path.parent, os.W_OK):
            error = f"cannot write in the folder {str(path.parent)!r}"
    else:
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write("[]\n")
        except OSError as e:
            error = f"cannot write {str(path)!r} ({e.strerror or e})"
    if error:
        print(f"gpu_check.py: --json: {error}", file=sys.stderr)
        return None
    return str(path)


def run_parts(report: Report, parts: list[str], device: torch.device, cpu: bool, small: dict, seconds: float,
              overhead: float, ddp_seconds: float) -> None:
    """The parts asked for, in order, each a row of ``report`` (see :func:`guarded`); a signal that
    stops the training part stops them all (KeyboardInterrupt, for :func:`main`)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "parity" in parts:
            guarded(report, "parity", lambda: part_parity(report, device, small))
        if "decoding" in parts:
            guarded(report, "decoding", lambda: part_decoding(report, device, small, 32 if cpu else 256))
        if "transformers" in parts:
            guarded(report, "one stream vs transformers generate", lambda: part_transformers(report, device, cpu),
                    needs=overhead)
        data = False
        if {"training", "determinism", "ddp"} & set(parts):
            try:
                prepare_data(work, cpu, report)
            except Exception as e:
                report.add("data", False, f"{type(e).__name__}: {e}")
            else:
                data = True
        # the later parts' shares of the budget, kept from the ones before them
        # (on an H200: the tests 138 s, the translation engine about 20, DDP's start-up about 15)
        ddp_share = (ddp_seconds + overhead) if data and "ddp" in parts else 0.0
        translation_share = overhead if "translation" in parts else 0.0
        determinism_share = overhead if data and "determinism" in parts else 0.0  # three eager runs of 24 steps
        tests_share = (150.0 if not cpu else 0.0) if "tests" in parts else 0.0
        if data and "training" in parts:  # training gets what is left after the later parts' shares, up to --seconds
            train_seconds = min(seconds, max(report.left() - determinism_share - tests_share - translation_share
                                             - ddp_share - overhead, 10.0))
            guarded(report, "training", lambda: part_training(report, device, work, train_seconds, cpu),
                    needs=train_seconds + overhead)
        if data and "determinism" in parts:
            guarded(report, "deterministic training",
                    lambda: part_determinism(report, device, work, cpu, report.left() - tests_share
                                             - translation_share - ddp_share), needs=determinism_share)
        if "tests" in parts:
            guarded(report, "tests", lambda: part_tests(report, device, reserve=translation_share + ddp_share),
                    needs=overhead)
        if "translation" in parts:
            guarded(report, "translation engine", lambda: part_translation(report, device, cpu), needs=overhead)
        if data and "ddp" in parts:
            guarded(report, "DDP through torchrun", lambda: part_ddp(report, device, work, ddp_seconds, cpu),
                    needs=ddp_seconds + overhead)


def main(argv: list[str] | None = None) -> int:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--seconds", type=float, default=None,
                    help="training time, at most (default 60 on cuda, 15 on cpu; less when the budget is short)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole run (default 540 on cuda, 900 on cpu)")
    ap.add_argument("--json", metavar="FILE", help="also write the table's rows as JSON (after every part); "
                                                   "relative to the folder gpu_check.sh was called from")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --json FILE")
    ap.add_argument("--parts", default=",".join(PARTS), metavar="NAMES",
                    help=f"the parts to run, comma-separated, in their own order (default: all of {','.join(PARTS)}); "
                         "a second call on a warm machine can rerun the one that failed")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = next((p for p in parts if p not in PARTS), None)
    if unknown is not None or not parts:
        print(f"gpu_check.py: --parts: {unknown if unknown is not None else args.parts!r} is not a part; "
              f"name some of {', '.join(PARTS)}", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py: --device: 'cuda' is not available here; use --device cpu", file=sys.stderr)
        return 2
    cpu = device.type == "cpu"
    seconds = args.seconds if args.seconds is not None else (15.0 if cpu else 60.0)
    budget = args.budget if args.budget is not None else (900.0 if cpu else 540.0)
    for flag, value in (("--seconds", seconds), ("--budget", budget)):
        if not value > 0:
            print(f"gpu_check.py: {flag}: must be > 0, got {value}", file=sys.stderr)
            return 2
    json_path = json_output(args.json, args.overwrite) if args.json else None
    if args.json and json_path is None:
        return 2
    name = torch.cuda.get_device_name(device) if not cpu else "CPU"
    print(f"torch {torch.__version__}, {name}, {torch.get_num_threads()} CPU threads", flush=True)
    small = dict(vocab_size=2048 if cpu else 10_000, context_length=128 if cpu else 512, d_model=64 if cpu else 256,
                 num_layers=2 if cpu else 4, num_heads=4 if cpu else 8, d_ff=192 if cpu else 688)
    report = Report(json_path, budget)
    # seconds a part needs beyond its timed work (start-up, compiling), to decide whether to start it
    overhead = 10.0 if cpu else 45.0
    ddp_seconds = min(seconds, 30.0)
    try:
        run_parts(report, parts, device, cpu, small, seconds, overhead, ddp_seconds)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (the training part's, or Python's own Ctrl-C): the table so far
        status = getattr(e, "status", 130)
        print("\n" + report.table())
        print(f"\ngpu_check: {'terminated' if status == 143 else 'interrupted'} "
              f"({budget - report.left():.0f} s of the {budget:.0f} s budget)", file=sys.stderr)
        return status
    print("\n" + report.table())
    print(f"\ngpu_check: {'all parts passed' if report.ok else 'SOME PARTS FAILED'}"
          f" ({budget - report.left():.0f} s of the {budget:.0f} s budget)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
