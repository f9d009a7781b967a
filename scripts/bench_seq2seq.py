"""The encoder–decoder against ``torch.nn.Transformer`` as its users write it, in one process, interleaved.

    python scripts/bench_seq2seq.py            # needs LM_TEST_DATA (multi30k/); about 3 minutes

Four comparisons, each printed as a ratio:

1. **training step**, the same shape (d_model 256, 3+3 layers, 4 heads, d_ff 1024, an 8K vocab,
   tied embeddings, label smoothing 0.1) on the same batches of real Multi30k pairs (at most
   1,024 padded positions each, about 850 real target tokens): lm's ``EncoderDecoder`` (fused
   loss over the real tokens) against the PyTorch tutorial's model (``nn.Embedding`` · √d +
   sinusoidal positions, ``nn.Transformer`` with the three padding masks, a tied ``nn.Linear``
   generator, ``F.cross_entropy`` with ``ignore_index`` and ``label_smoothing``), both with
   ``torch.optim.Adam``; target tokens/s;
2. **greedy decoding** of test_2016_flickr: lm's cached loop against the tutorial's loop that
   re-runs the decoder on the whole prefix every step, on the same weights; sentences/s, and
   the outputs must be identical;
3. **beam 4** against greedy, both cached: the cost of the beam;
4. **serving** (``lm serve`` with this checkpoint, in process): the translation engine given 16
   test sentences at once (continuous batching: the rows decode together) against the same 16
   one after another, and against ``greedy_decode`` of one sentence after another (what the
   engine did before it batched); target tokens/s; the texts must be the same all three ways.

Rounds alternate between the contenders; the medians are reported. Measure on an idle machine:
on 2 cores, a second busy process makes torch's two threads up to 10x slower.
"""

from __future__ import annotations

import argparse
import gzip
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lm.cli.common import WrittenHelpParser
from lm.evaluate import collate_pairs
from lm.generate import beam_search, greedy_decode
from lm.model import Seq2SeqConfig, build_model
from lm.serve.engine import Request, SamplingParams
from lm.serve.translation import TranslationEngine
from lm.tokenizer import Tokenizer, train_bpe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.model_reference import load_into_torch_transformer  # noqa: E402

SPECIALS = ["<pad>", "<bos>", "<eos>"]


class TutorialTransformer(torch.nn.Module):
    """The model of PyTorch's "Language Translation with nn.Transformer" tutorial (tied generator)."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, d_ff: int, dropout: float, max_len: int = 256):
        super().__init__()
        self.d = d
        self.emb = torch.nn.Embedding(vocab, d)
        self.transformer = torch.nn.Transformer(d, heads, layers, layers, d_ff, dropout, batch_first=True)
        self.generator = torch.nn.Linear(d, vocab)
        self.generator.weight = self.emb.weight
        pos = torch.arange(max_len)[:, None] / 10000 ** (torch.arange(0, d, 2)[None] / d)
        self.register_buffer("pe", torch.stack([pos.sin(), pos.cos()], -1).flatten(-2), persistent=False)
        self.drop = torch.nn.Dropout(dropout)
        for p in self.parameters():  # as the tutorial does: Xavier-uniform for every matrix, the embedding too
            if p.dim() > 1:
                torch.nn.init.xavier_uniform_(p)

    def embed(self, ids):
        return self.drop(self.emb(ids) * math.sqrt(self.d) + self.pe[: ids.shape[1]])

    def forward(self, src, tgt, src_pad, tgt_pad):
        t = tgt.shape[1]
        causal = torch.nn.Transformer.generate_square_subsequent_mask(t, dtype=torch.bool)
        h = self.transformer(self.embed(src), self.embed(tgt), tgt_mask=causal, src_key_padding_mask=src_pad,
                             tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, tgt_is_causal=True)
        return self.generator(h)

    @torch.no_grad()
    def greedy(self, src, src_pad, bos, eos, max_len):
        """The tutorial's loop: the decoder re-runs over the whole prefix for every new token."""
        memory = self.transformer.encoder(self.embed(src), src_key_padding_mask=src_pad)
        ys = torch.full((src.shape[0], 1), bos, dtype=torch.long)
        done = torch.zeros(src.shape[0], dtype=torch.bool)
        for _ in range(max_len):
            causal = torch.nn.Transformer.generate_square_subsequent_mask(ys.shape[1], dtype=torch.bool)
            h = self.transformer.decoder(self.embed(ys), memory, tgt_mask=causal, memory_key_padding_mask=src_pad)
            logits = self.generator(h[:, -1])
            logits[:, :2] = float("-inf")  # never <pad> or <bos>, as lm
            nxt = logits.argmax(-1)
            ys = torch.cat([ys, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
        return ys


def copy_weights(ours, theirs) -> None:
    """lm's weights into the tutorial model (its biases zero), so both decode the same."""
    with torch.no_grad():
        theirs.emb.weight.copy_(ours.embeddings.weight)  # the generator's weight too (tied)
        theirs.generator.bias.zero_()
    load_into_torch_transformer(ours, theirs.transformer)


def lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def batches_of(src, tgt, budget: int):
    """Consecutive pairs sorted by length, cut at ``budget`` padded positions (rows × the longest
    side + 1); the real target tokens are fewer."""
    order = sorted(range(len(src)), key=lambda i: (len(src[i]), len(tgt[i])))
    out, cur, width = [], [], 0
    for i in order:
        w = max(width, len(tgt[i]) + 1, len(src[i]) + 1)
        if cur and w * (len(cur) + 1) > budget:
            out.append(cur)
            cur, w = [], max(len(tgt[i]), len(src[i])) + 1
        cur.append(i)
        width = w
    return out + [cur]


def serve(engine: TranslationEngine, sources: list[list[int]], at_once: bool) -> tuple[float, list[list[int]]]:
    """Target tokens/s of ``engine`` translating ``sources`` greedily, all queued at once or each
    after the one before has finished, and the translations."""
    outs: list[list[int]] = [[] for _ in sources]
    requests = [Request(s, SamplingParams(max_tokens=engine.context_length - 1, temperature=0.0),
                        on_token=lambda _, t, out=out: out.append(t)) for s, out in zip(sources, outs)]
    t0 = time.perf_counter()
    for r in requests:
        engine.submit(r)
        if not at_once:
            while engine.step():
                pass
    while engine.step():
        pass
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def main() -> int:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.error = lambda message: ap.exit(2, f"{ap.prog}: error: {message}\n")  # one line, no usage
    ap.add_argument("--data", default=os.environ.get("LM_TEST_DATA"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="training steps per round and contender")
    ap.add_argument("--sentences", type=int, default=200, help="test sentences decoded per round")
    ap.add_argument("--clients", type=int, default=16, help="sentences given to the serving engine at once")
    ap.add_argument("--compile", action="store_true", help="the serving engine's steps compiled (lm serve --compile)")
    args = ap.parse_args()
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps), ("--sentences", args.sentences),
                        ("--clients", args.clients)):
        if value < 1:
            ap.error(f"{flag}: must be >= 1, got {value}")
    d = Path(args.data or "") / "multi30k"
    if not (d / "train.en.gz").is_file():
        ap.error(f"--data: {args.data!r} holds no multi30k/train.en.gz; --data or LM_TEST_DATA must name a folder "
                 "holding multi30k/")
    torch.manual_seed(0)
    en, de = lines(d / "train.en.gz"), lines(d / "train.de.gz")
    with tempfile.TemporaryDirectory() as tmp:  # the joint corpus is only needed to train the BPE
        corpus = Path(tmp) / "joint.txt"
        corpus.write_text("\n".join(en[:10000] + de[:10000]) + "\n", encoding="utf-8")
        vocab, merges = train_bpe(corpus, 8000, SPECIALS)
    tok = Tokenizer(vocab, merges, SPECIALS)
    pad, bos, eos = 0, 1, 2
    src = [tok.encode(s) for s in en[:4000]]
    tgt = [tok.encode(t) for t in de[:4000]]
    cfg = Seq2SeqConfig(vocab_size=tok.vocab_size, context_length=256, d_model=256, encoder_layers=3,
                        decoder_layers=3, num_heads=4, d_ff=1024, dropout=0.1, label_smoothing=0.1)
    ours = build_model(cfg)
    theirs = TutorialTransformer(tok.vocab_size, 256, 4, 3, 1024, 0.1)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    opt_theirs = torch.optim.Adam(theirs.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    batches = [collate_pairs([src[i] for i in b], [tgt[i] for i in b], pad_id=pad, bos_id=bos, eos_id=eos)
               for b in batches_of(src, tgt, 1024)]
    print(f"{len(batches)} batches, {statistics.mean(b.num_tokens for b in batches):.0f} target tokens each",
          file=sys.stderr)

    def step_ours(b):
        loss = ours(batch=b)
        opt_ours.zero_grad(set_to_none=True)
        loss.backward()
        opt_ours.step()

    def step_theirs(b):
        logits = theirs(b.src, b.tgt_in, ~b.src_mask, ~b.tgt_mask)
        targets = b.tgt_out.masked_fill(~b.tgt_mask, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100,
                               label_smoothing=0.1)
        opt_theirs.zero_grad(set_to_none=True)
        loss.backward()
        opt_theirs.step()

    rates = {"lm": [], "torch.nn.Transformer": []}
    cursor = 0
    for _ in range(args.rounds):
        chunk = [batches[(cursor + i) % len(batches)] for i in range(args.steps)]
        cursor += args.steps
        tokens = sum(b.num_tokens for b in chunk)
        for name, fn in (("lm", step_ours), ("torch.nn.Transformer", step_theirs)):
            fn(chunk[0])  # warm
            t0 = time.perf_counter()
            for b in chunk:
                fn(b)
            rates[name].append(tokens / (time.perf_counter() - t0))
    lm_rate, ref_rate = statistics.median(rates["lm"]), statistics.median(rates["torch.nn.Transformer"])

    # decoding: the same weights in both (lm's, after the steps above), dropout off
    ours.eval()
    theirs.eval()
    copy_weights(ours, theirs)
    test_en = [tok.encode(s) for s in lines(d / "test_2016_flickr.en.gz")]
    dec = {"lm greedy, cached": [], "re-running loop": [], "lm beam 4": []}
    same = True
    for r in range(args.rounds):
        chunk = test_en[(r * args.sentences) % len(test_en):][: args.sentences]
        for name in dec:
            t0 = time.perf_counter()
            outs = []
            for j in range(0, len(chunk), 32):
                part = chunk[j : j + 32]
                if name == "lm greedy, cached":
                    outs += greedy_decode(ours, part)
                elif name == "lm beam 4":
                    outs += beam_search(ours, part, beam_size=4)
                else:
                    b = collate_pairs(part, [[0]] * len(part), pad_id=pad, bos_id=bos, eos_id=eos)
                    ys = theirs.greedy(b.src, ~b.src_mask, bos, eos, max(len(s) for s in part) + 50)
                    for row, s in zip(ys[:, 1:].tolist(), part):
                        row = row[: row.index(eos)] if eos in row else row
                        outs.append(row[: len(s) + 50])  # lm's limit: source length + 50
            dec[name].append(len(chunk) / (time.perf_counter() - t0))
            if name == "lm greedy, cached":
                ours_out = outs
            elif name == "re-running loop":
                same &= ours_out == outs
    g, loop, beam = (statistics.median(dec[k]) for k in ("lm greedy, cached", "re-running loop", "lm beam 4"))

    # serving: the translation engine, its sixteen slots filled at once or one after another
    t0 = time.perf_counter()
    engine = TranslationEngine(ours, max_batch=args.clients, compile=args.compile)
    print(f"serving engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    serve(engine, test_en[-args.clients:], at_once=True)  # warm: every step size it will use
    served = {"at once": [], "one after another": [], "greedy_decode": []}
    invariant = like_greedy = True
    first: list = []  # the "at once" outputs of this round (measured first: the dict's order)
    for r in range(args.rounds):
        chunk = test_en[(r * args.clients) % len(test_en):][: args.clients]
        for name in served:
            if name == "greedy_decode":
                t0 = time.perf_counter()
                outs = [greedy_decode(ours, [s])[0] for s in chunk]
                served[name].append(sum(map(len, outs)) / (time.perf_counter() - t0))
                like_greedy &= outs == first
                continue
            rate, outs = serve(engine, chunk, at_once=name == "at once")
            served[name].append(rate)
            if name == "at once":
                first = outs
            else:
                invariant &= outs == first
    together, alone, before = (statistics.median(served[k]) for k in served)
    # a ratio between sides whose outputs differ is not a comparison of the same work: marked, exit 1
    def unless(ok: bool) -> str:
        return "" if ok else " (NOT VALID: outputs differ)"

    def per(a: float, b: float) -> str:  # a model that translates every sentence to nothing makes no tokens
        return f"{a / b:.2f}x" if b > 0 else "n/a (no target tokens: every translation empty)"

    print("| what | lm | reference | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| training step, target tokens/s | {lm_rate:,.0f} | {ref_rate:,.0f} (torch.nn.Transformer) | "
          f"{lm_rate / ref_rate:.2f}x |")
    print(f"| greedy decoding, sentences/s | {g:.1f} (cached) | {loop:.1f} (re-running loop) | {g / loop:.2f}x"
          f"{unless(same)} |")
    print(f"| beam 4 vs greedy, sentences/s | {beam:.1f} | {g:.1f} | cost {g / beam:.2f}x |")
    how = "compiled " if args.compile else ""
    print(f"| serving {args.clients} sentences, {how}target tokens/s | {together:,.0f} (at once) | {alone:,.0f} (one "
          f"after another) | {per(together, alone)}{unless(invariant)} |")
    print(f"| … against greedy_decode one by one (the engine before batching) | {together:,.0f} | {before:,.0f} | "
          f"{per(together, before)}{unless(like_greedy)} |")
    print(f"identical greedy outputs: {same}; served the same at once as one after another: {invariant}, "
          f"as greedy_decode one by one: {like_greedy} (engine steps of {engine.step_sizes} rows)")
    if not (same and invariant and like_greedy):
        print("bench_seq2seq.py: outputs differ between the sides of a comparison: its ratio is not valid",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
