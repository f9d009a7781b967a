"""The first thing to run on a GPU machine: every check that needs a device, in one call, one table.

    PYTHONPATH=. python scripts/gpu_check.py                 # CUDA: about 10 minutes on one H200
    PYTHONPATH=. python scripts/gpu_check.py --device cpu    # a short version of every part (~1 minute)

Parts, each run even if one before failed:

1. **tests**: the model, generation and serving-engine tests (the model's device tests run on
   CUDA when it is there); skipped with ``--device cpu``, where the test suite runs them anyway;
2. **parity**: the same weights on the device and on the CPU in float32 (logits), bfloat16
   autocast against float32 (loss), ``torch.compile`` against eager (logits);
3. **decoding**: the compiled fixed-shape step (a CUDA graph on CUDA) against the eager loop,
   tokens identical; new tokens/s for one stream and for 16; the serving engine's step sizes
   (which ones give a row the same bits as sixteen rows, in every slot, on this device), the
   engine ``lm serve`` runs by default there (bfloat16 autocast on CUDA): a seeded request alone
   and beside fifteen others, and, on CUDA, its compiled steps (CUDA graphs) against eager
   generation;
4. **translation engine**: the encoder–decoder's batched decode steps (compiled on CUDA, with
   each row's source in a static cross-attention cache) against ``greedy_decode``, tokens equal;
5. **training**: ``configs/tinystories-17m.toml`` for ``--seconds`` on the data it can find
   (``$LM_TEST_DATA/tinystories_sample.txt``, else the demo's synthetic stories), bfloat16 where
   the device has it, compiled: tokens/s, MFU, peak memory, validation loss, and on CUDA the
   host–device syncs per step (``torch.cuda.set_sync_debug_mode``);
6. **DDP**: ``torchrun`` with every visible GPU (nccl), or 2 CPU processes (gloo).

The machine has no internet: nothing here downloads. ``--device cpu`` shrinks the model and the
times so that ``tests/test_gpu_check.py`` runs it in the test suite, and the script cannot rot
between the rare sessions with a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lm.generate import generate  # noqa: E402
from lm.model import TransformerLM  # noqa: E402
from lm.nn import cross_entropy  # noqa: E402

SPECIAL = "<|endoftext|>"


class Report:
    def __init__(self):
        self.rows: list[tuple[str, bool | None, str]] = []

    def add(self, part: str, ok: bool | None, detail: str) -> None:
        self.rows.append((part, ok, detail))
        mark = "pass" if ok else "skip" if ok is None else "FAIL"
        print(f"[{mark}] {part}: {detail}", flush=True)

    def table(self) -> str:
        lines = ["| part | result | measured |", "|---|---|---|"]
        for part, ok, detail in self.rows:
            lines.append(f"| {part} | {'pass' if ok else 'skipped' if ok is None else '**FAIL**'} | {detail} |")
        return "\n".join(lines)

    @property
    def ok(self) -> bool:
        return all(ok is not False for _, ok, _ in self.rows)


def guarded(report: Report, part: str, fn) -> None:
    try:
        fn()
    except Exception as e:  # one failing part must not hide the others
        report.add(part, False, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_tests(report: Report, device: torch.device) -> None:
    if device.type != "cuda":
        return report.add("tests", None, "the test suite runs them on CPU")
    tests = ["tests/test_model.py", "tests/test_optim.py", "tests/test_generate.py", "tests/test_serve.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=REPO,
                       capture_output=True, text=True, timeout=1200)
    last = (r.stdout.strip().splitlines() or ["(no output)"])[-1]
    report.add("tests (model and AdamW on cuda, generation, serving engine)", r.returncode == 0, last)


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


def part_decoding(report: Report, device: torch.device, shape: dict, new_tokens: int) -> None:
    torch.manual_seed(0)
    model = TransformerLM(**shape).to(device).eval()
    prompts = torch.randint(0, shape["vocab_size"], (16, 32)).tolist()
    eager = generate(model, prompts[0], new_tokens, temperature=0)
    same_one = generate(model, prompts[0], new_tokens, temperature=0, compile=True) == eager
    same_many = generate(model, prompts, new_tokens, temperature=0, compile=True)[0] == eager

    def rate(**kw) -> float:
        batch = prompts if kw.pop("many", False) else prompts[0]
        rows = 16 if batch is prompts else 1
        generate(model, batch, new_tokens, temperature=0, **kw)  # warm (compiled once per shape)
        sync(device)
        t0 = time.perf_counter()
        generate(model, batch, new_tokens, temperature=0, **kw)
        sync(device)
        return rows * new_tokens / (time.perf_counter() - t0)

    one, one_c, many, many_c = rate(), rate(compile=True), rate(many=True), rate(many=True, compile=True)
    report.add("decoding: compiled step tokens == eager tokens (1 and 16 streams)", same_one and same_many,
               f"new tokens/s: 1 stream {one:,.0f} eager / {one_c:,.0f} compiled; 16 streams {many:,.0f} eager / "
               f"{many_c:,.0f} compiled ({many_c / one_c:.1f}x one compiled stream)")
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


def find_corpus(work: Path, size: int) -> Path:
    data = os.environ.get("LM_TEST_DATA")
    if data and (Path(data) / "tinystories_sample.txt").exists():
        return Path(data) / "tinystories_sample.txt"
    from lm.demo.stories import write_corpus

    write_corpus(work / "stories.txt", size, seed=0)
    return work / "stories.txt"


def lm(*args, env=None) -> None:
    subprocess.run([sys.executable, "-m", "lm", *map(str, args), "--quiet"], check=True, cwd=REPO, env=env,
                   capture_output=True, text=True)


def prepare_data(work: Path, cpu: bool) -> Path:
    corpus = find_corpus(work, 2_000_000 if cpu else 40_000_000)
    lm("tokenizer", "train", "--input", corpus, "--vocab-size", "1024", "--special-token", SPECIAL,
       "--out", work / "tok")
    lm("tokenize", "--tokenizer", work / "tok", "--input", corpus, "--out", work / "train.bin")
    return corpus


def train_overrides(work: Path, out: str, device: torch.device, seconds: float, cpu: bool) -> list[str]:
    sets = [f"data.train={work / 'train.bin'}", f"data.val={work / 'train.bin'}", f"data.tokenizer={work / 'tok'}",
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
    report.add(f"training: tinystories-17m config{' (shrunk)' if cpu else ''}, {seconds:.0f} s",
               status == 0 and bool(val),
               f"{last['step']} steps, {1000 * last['time'] / last['step']:.1f} ms/step, {last['tok_per_s']:,.0f} "
               f"tokens/s, MFU {100 * last['mfu']:.1f}%, {memory}, val loss {val[-1]['loss']:.3f} (train "
               f"{last['loss']:.3f}); {compile_s}{wall:.0f} s in all{per_step}")


def part_ddp(report: Report, device: torch.device, work: Path, seconds: float, cpu: bool) -> None:
    procs = torch.cuda.device_count() if device.type == "cuda" else 2
    sets = train_overrides(work, "ddp", "cuda" if device.type == "cuda" else "cpu", seconds, cpu)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", "-m", "lm",
            "train", "--config", str(REPO / "configs" / "tinystories-17m.toml"), "--quiet"]
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    # a hang (ranks waiting in different collectives) must fail this part, not stall the script
    r = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=240 if cpu else 1200)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--seconds", type=float, default=None, help="training time (default 300 on cuda, 15 on cpu)")
    ap.add_argument("--json", metavar="FILE", help="also write the table's rows as JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py: --device: 'cuda' is not available here; use --device cpu", file=sys.stderr)
        return 2
    cpu = device.type == "cpu"
    seconds = args.seconds if args.seconds is not None else (15.0 if cpu else 300.0)
    name = torch.cuda.get_device_name(device) if not cpu else "CPU"
    print(f"torch {torch.__version__}, {name}, {torch.get_num_threads()} CPU threads", flush=True)
    small = dict(vocab_size=2048 if cpu else 10_000, context_length=128 if cpu else 512, d_model=64 if cpu else 256,
                 num_layers=2 if cpu else 4, num_heads=4 if cpu else 8, d_ff=192 if cpu else 688)
    report = Report()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        guarded(report, "tests", lambda: part_tests(report, device))
        guarded(report, "parity", lambda: part_parity(report, device, small))
        guarded(report, "decoding", lambda: part_decoding(report, device, small, 32 if cpu else 256))
        guarded(report, "translation engine", lambda: part_translation(report, device, cpu))
        try:
            prepare_data(work, cpu)
        except Exception as e:
            report.add("data", False, f"{type(e).__name__}: {e}")
        else:
            guarded(report, "training", lambda: part_training(report, device, work, seconds, cpu))
            guarded(report, "DDP through torchrun", lambda: part_ddp(report, device, work, min(seconds, 60.0), cpu))
    print("\n" + report.table())
    print(f"\ngpu_check: {'all parts passed' if report.ok else 'SOME PARTS FAILED'}")
    if args.json:
        Path(args.json).write_text(json.dumps([dict(part=p, ok=o, detail=d) for p, o, d in report.rows], indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
