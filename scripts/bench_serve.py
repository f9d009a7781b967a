"""Load and faults for ``lm serve``: traffic to 127.0.0.1 only, bounded in count and time.

    python scripts/bench_serve.py                      # a demo-shaped model, random weights; 40-130 s
    python scripts/bench_serve.py --rounds 1           # one concurrency round: 25-75 s
    python scripts/bench_serve.py --checkpoint runs/demo/run
    python scripts/bench_serve.py --checkpoint runs/multi30k-en-de   # a translation model: the same checks

It starts the real server (``lm serve``, a subprocess) and measures, as one table:

1. **concurrency**: 16 clients at once, each streaming up to 128 tokens (temperature 0),
   against the same 16 requests one after another, alternating for ``--rounds`` rounds (default
   3; each round a sequential pass, then a concurrent one; each round beyond the first adds about
   7-26 s for the default model on the 2-core machines of docs/benchmarks.md). Every row is the
   median over the rounds: total tokens/s and their ratio (the median of the rounds' own ratios;
   target ≥ 4x for the default server; with ``--compile`` a lone stream's compiled one-row step
   is so much cheaper that the ratio is reported only), p50/p99 time to first token and
   per-token latency; the texts of every pass of every round must be the same (batch
   invariance, greedy);
2. **faults**: 1,000 requests, 32 in flight at a time, a mix of valid ones (answers checked
   against the sequential pass), malformed ones (bad JSON, bad fields, oversized bodies: each
   must get its 4xx) and streams cancelled after their first token; then the server must hold no
   rows (``/metrics``), be healthy, and its RSS must not have grown more than the allocator's
   slack (reported);
3. **SIGTERM**: with streams in flight, SIGTERM; a new request must get 503, the streams must
   finish with their last token and [DONE], and the server must exit 0.

Without ``--checkpoint`` the model has the demo's shape (vocabulary 2,048, d_model 192, 4 layers,
6 heads) with context 256 (so 128 new tokens fit after a prompt), random weights, and a byte-level
BPE trained on synthetic stories: speed does not depend on what the weights learned.

The concurrency ratio compares ``lm serve`` with itself, concurrent against sequential: no other
serving stack (vLLM, the reference a user would pick on a GPU) runs on this CPU-only machine, so
none is measured. Needs httpx (the ``[bench]`` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from lm.cli.common import WrittenHelpParser
from lm.serve.process import free_port, start_server

PROMPTS = ["Once upon a time", "Lily and Tom", "The little dog", "One day, Ben", "Mia had a red",
           "The sun was", "Sam wanted to", "In the park"]


def make_run(d: Path) -> Path:
    import torch

    from lm.checkpoint import export_safetensors
    from lm.demo.stories import write_corpus
    from lm.model import TransformerLM
    from lm.tokenizer import EOT, Tokenizer, save_tokenizer_dir, train_bpe

    write_corpus(d / "stories.txt", 400_000, seed=0)
    vocab, merges = train_bpe(d / "stories.txt", 2048, [EOT])
    save_tokenizer_dir(Tokenizer(vocab, merges, [EOT]), d / "tokenizer")
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=2048, context_length=256, d_model=192, num_layers=4, num_heads=6,
                          d_ff=512)
    export_safetensors(model, d / "model.safetensors")
    return d


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """One streaming completion: its text, and when each piece arrived."""
    t0 = time.perf_counter()
    times, text, tokens, finish = [], [], 0, None
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for c in event["choices"]:
                finish = c.get("finish_reason") or finish
                if c["text"]:
                    times.append(time.perf_counter() - t0)
                    text.append(c["text"])
    return {"text": "".join(text), "tokens": tokens, "finish_reason": finish,
            "ttft": times[0] if times else float("nan"), "gaps": [b - a for a, b in zip(times, times[1:])],
            "end": time.perf_counter() - t0}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def _latencies(results: list[dict]) -> tuple[tuple[float, float], tuple[float, float]]:
    """p50/p99 time to first token and p50/p99 time between tokens of one pass, in ms."""
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return (1e3 * pct(ttft, 50), 1e3 * pct(ttft, 99)), (1e3 * pct(gaps, 50), 1e3 * pct(gaps, 99))


async def concurrency(url: str, clients: int, tokens: int, rounds: int) -> tuple[dict, dict[str, tuple[str, int]]]:
    """``rounds`` rounds, each the ``clients`` requests one after another, then all at once; every
    row of the table is the median over the rounds (the ratio: of each round's own ratio). The
    texts must be the same in every pass of every round. Also each prompt's answer in the first
    pass: its text and its number of tokens."""
    bodies = [{"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": tokens, "temperature": 0.0}
              for i in range(clients)]
    passes: dict[str, list[list[dict]]] = {"sequential": [], "concurrent": []}
    seconds: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    async with httpx.AsyncClient(timeout=600) as client:
        await stream_one(client, url, bodies[0])  # warm-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            passes["sequential"].append([await stream_one(client, url, b) for b in bodies])
            seconds["sequential"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            passes["concurrent"].append(await asyncio.gather(*(stream_one(client, url, b) for b in bodies)))
            seconds["concurrent"].append(time.perf_counter() - t0)
    first = [r["text"] for r in passes["sequential"][0]]
    same = all([r["text"] for r in results] == first for kind in passes for results in passes[kind])
    answers = {b["prompt"]: (r["text"], r["tokens"]) for b, r in zip(bodies, passes["sequential"][0])}
    rate = {kind: [sum(r["tokens"] for r in results) / t for results, t in zip(passes[kind], seconds[kind])]
            for kind in passes}
    lat = {kind: [_latencies(results) for results in passes[kind]] for kind in passes}

    def median_pair(pairs: list[tuple[float, float]]) -> tuple[float, float]:
        return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)

    return {
        "tokens per pass": round(statistics.median(sum(r["tokens"] for r in results)
                                                   for results in passes["concurrent"])),
        "sequential tokens/s": statistics.median(rate["sequential"]),
        "concurrent tokens/s": statistics.median(rate["concurrent"]),
        "ratio": statistics.median(s / c for s, c in zip(seconds["sequential"], seconds["concurrent"])),
        "identical texts": same,
        "concurrent TTFT p50/p99 ms": median_pair([t for t, _ in lat["concurrent"]]),
        "concurrent per-token p50/p99 ms": median_pair([g for _, g in lat["concurrent"]]),
        "sequential TTFT p50/p99 ms": median_pair([t for t, _ in lat["sequential"]]),
        "sequential per-token p50/p99 ms": median_pair([g for _, g in lat["sequential"]]),
    }, answers


async def faults(url: str, total: int, answers: dict[str, tuple[str, int]], tokens: int, seed: int = 0) -> dict:
    """``total`` requests of the mix; a valid one is correct when its text is a prefix of its prompt's
    answer (``answers``: text and tokens) and it has as many tokens as it asked for or the answer has
    (an empty text had passed as a prefix of every answer)."""
    rng = random.Random(seed)
    prompts = list(answers)
    counts = {"valid": 0, "valid correct": 0, "malformed": 0, "malformed refused": 0, "cancelled": 0,
              "unexpected": 0}
    sem = asyncio.Semaphore(32)

    async def one(i: int, client: httpx.AsyncClient) -> None:
        kind = rng.choice(["valid", "valid", "malformed", "cancelled"])
        async with sem:
            if kind == "valid":
                counts["valid"] += 1
                p = rng.choice(prompts)
                short = rng.choice([min(8, tokens), min(16, tokens), tokens])  # prefixes of the answer
                r = await client.post(url + "/v1/completions",
                                      json={"prompt": p, "max_tokens": short, "temperature": 0.0})
                # greedy and batch invariant: a shorter answer is a prefix of the long one, of its length
                text, length = answers[p]
                ok = (r.status_code == 200 and text.startswith(r.json()["choices"][0]["text"])
                      and r.json().get("usage", {}).get("completion_tokens") == min(short, length))
                counts["valid correct"] += ok
            elif kind == "malformed":
                counts["malformed"] += 1
                bad = rng.choice([
                    (b"{not json", 400), (json.dumps({"prompt": "x", "temperature": -3}).encode(), 400),
                    (json.dumps({"prompt": "x", "max_tokens": 10_000}).encode(), 400),
                    (json.dumps({"max_tokens": 3}).encode(), 400),
                    (json.dumps({"prompt": "x" * 1_100_000}).encode(), 413),
                    (json.dumps({"prompt": "x", "n": 0}).encode(), 400),
                ])
                r = await client.post(url + "/v1/completions", content=bad[0],
                                      headers={"Content-Type": "application/json"})
                counts["malformed refused"] += r.status_code == bad[1] and "error" in r.json()
            else:
                counts["cancelled"] += 1
                body = {"prompt": rng.choice(prompts), "max_tokens": tokens, "stream": True}
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            break  # leave after the first token
        return None

    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(one(i, client) for i in range(total)), return_exceptions=True)
    counts["unexpected"] = sum(isinstance(r, BaseException) for r in results)
    return counts


def is_translation(run: Path) -> bool:
    """Whether ``run`` holds an encoder-decoder (its translations end at <eos>, whatever max_tokens says)."""
    from lm.generate import load_model_and_tokenizer

    return load_model_and_tokenizer(run, need_tokenizer=False).model.config.architecture == "encoder_decoder"


def serve(run: Path, port: int, max_batch: int, compile: bool = False) -> subprocess.Popen:
    try:
        proc, _ = start_server(["--checkpoint", str(run), "--max-batch", str(max_batch), "--quiet",
                                *(["--compile"] if compile else [])], port, stderr=subprocess.PIPE, text=True)
    except RuntimeError as e:
        raise SystemExit(f"bench_serve.py: {e}") from None
    return proc


async def sigterm(proc: subprocess.Popen, url: str, translation: bool, tokens: int, streams: int) -> dict:
    """``streams`` streams decoding when the signal comes (at most the server's --max-batch), each
    asking for ``tokens`` (long enough to be caught decoding, whatever ``--tokens`` says). A
    translation ends at its <eos> (no ignore_eos there): a stream has finished when it ends with a
    finish reason; a language model's must have all its ``tokens`` tokens. If the streams were
    never decoding at once, no signal is sent and the rows say so (the other parts' rows stand)."""
    async with httpx.AsyncClient(timeout=120) as client:
        body = {"max_tokens": tokens, "temperature": 1.0}
        if not translation:
            body["ignore_eos"] = True  # still decoding when the signal comes
        streams = [asyncio.ensure_future(stream_one(client, url, {"prompt": p, **body})) for p in PROMPTS[:streams]]
        deadline = time.perf_counter() + 60
        while metrics(url).get("lm_batch_size", 0) < len(streams):  # all of them are decoding
            if time.perf_counter() > deadline or any(s.done() for s in streams):
                ended = await asyncio.gather(*streams, return_exceptions=True)
                errors = [repr(e) for e in ended if isinstance(e, BaseException)]
                never = f"not run: the {len(streams)} streams were never decoding at once" + (
                    f" ({errors[0]})" if errors else "")
                return {"new request during drain": never, "streams finished": never, "exit status": never}
            await asyncio.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        while (await client.get(url + "/health")).status_code == 200:  # until the signal is handled
            await asyncio.sleep(0.01)
        refused = await client.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        done = await asyncio.gather(*streams, return_exceptions=True)
    code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 60)

    def finished(d) -> bool:
        if not isinstance(d, dict):
            return False
        return d["finish_reason"] in ("stop", "length") if translation else d["tokens"] == tokens

    errors = [repr(d) for d in done if isinstance(d, BaseException)]
    return {"new request during drain": refused.status_code,
            "streams finished": f"{sum(finished(d) for d in done)} of {len(done)}"
                                + (f" ({errors[0]})" if errors else ""),
            "exit status": code}


def main() -> int:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = lambda message: ap.exit(2, f"{ap.prog}: error: {message}\n")  # one line, no usage
    ap.add_argument("--checkpoint", default=None, help="a run to serve (default: a demo-shaped random model)")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="concurrency rounds, each a sequential then a concurrent pass; medians reported")
    ap.add_argument("--compile", action="store_true", help="serve with lm serve --compile")
    args = ap.parse_args()
    for flag, value in (("--clients", args.clients), ("--tokens", args.tokens), ("--requests", args.requests),
                        ("--rounds", args.rounds)):
        if value < 1:
            ap.error(f"{flag}: must be >= 1, got {value}")
    translation = None
    if args.checkpoint:
        try:
            translation = is_translation(Path(args.checkpoint))
        except ValueError as e:  # its message names --checkpoint
            ap.error(str(e))
    draining = min(4, args.clients)  # streams in flight when SIGTERM comes: the server has --clients rows
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(args.checkpoint) if args.checkpoint else make_run(Path(tmp))
        if translation is None:
            translation = is_translation(run)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = serve(run, port, args.clients, args.compile)
        try:
            context = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
            most = context - 1 if translation else context - 16  # (a prompt of up to 16 tokens first)
            if args.tokens > most:
                ap.error(f"--tokens: this model's context is {context} tokens, so at most {most}, got {args.tokens}")
            # each part's rows as soon as it is measured: a later part that fails does not lose them
            flags = f"--max-batch {args.clients}" + (" --compile" if args.compile else "")
            print(f"\n## lm serve under load ({os.cpu_count()} CPUs; server: lm serve {flags}; concurrency rows: "
                  f"medians of {args.rounds} round{'s' * (args.rounds > 1)}, a sequential then a concurrent pass "
                  "each)\n")
            print("| measurement | value |\n|---|---:|")
            load, answers = asyncio.run(concurrency(url, args.clients, args.tokens, args.rounds))
            for k, v in load.items():
                print(f"| {k} | {v:.2f} |" if isinstance(v, float) else
                      f"| {k} | {v[0]:.1f} / {v[1]:.1f} |" if isinstance(v, tuple) else f"| {k} | {v} |", flush=True)
            rss_before = rss_kib(proc.pid)
            fault = asyncio.run(faults(url, args.requests, answers, args.tokens))
            t0 = time.perf_counter()  # cancelled rows leave at the engine's next step
            while (m := metrics(url)).get("lm_batch_size", 1) or m.get("lm_queue_depth", 1):
                if time.perf_counter() - t0 > 30:
                    break
                time.sleep(0.01)
            idle_after = time.perf_counter() - t0
            rss_after = rss_kib(proc.pid)
            healthy = httpx.get(url + "/health").status_code == 200
            for k, v in fault.items():
                print(f"| faults: {k} | {v} |")
            print(f"| faults: rows left / queue after | {m.get('lm_batch_size', -1):.0f} / "
                  f"{m.get('lm_queue_depth', -1):.0f} (idle {1e3 * idle_after:.0f} ms after the last response) |")
            print(f"| faults: RSS before / after, MiB | {rss_before / 1024:.1f} / {rss_after / 1024:.1f} |")
            print(f"| faults: healthy after | {healthy} |", flush=True)
            # streams long enough to be caught decoding together, whatever --tokens is (bounded: a drain
            # of four long contexts could take minutes on a CPU)
            term = asyncio.run(sigterm(proc, url, translation, min(most, max(args.tokens, 256)), draining))
            for k, v in term.items():
                print(f"| SIGTERM: {k} | {v} |")
        finally:
            if proc.poll() is None:
                proc.kill()
    # The >= 4x target is the default server's. With --compile a lone stream runs the compiled one-row
    # step, several times cheaper than the sixteen-row one (0.31 against 1.40 ms for the default model
    # here), which caps the ratio on a CPU whose sixteen-row step is bound by arithmetic: reported only.
    # The target is set for sixteen clients; fewer cannot reach it (two at once are at most 2x one).
    ratio_ok = args.compile or args.clients < 16 or load["ratio"] >= 4
    ok = (ratio_ok and load["identical texts"] and fault["valid correct"] == fault["valid"]
          and fault["malformed refused"] == fault["malformed"] and fault["unexpected"] == 0 and healthy
          and m.get("lm_batch_size") == 0 and term["new request during drain"] == 503 and term["exit status"] == 0
          and term["streams finished"] == f"{draining} of {draining}")
    target = ("no target with --compile: see the code" if args.compile else
              "target >= 4x" if args.clients >= 16 else "the >= 4x target is for 16 clients")
    print(f"\nall checks {'pass' if ok else 'FAIL'}; concurrency ratio {load['ratio']:.2f}x ({target})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
