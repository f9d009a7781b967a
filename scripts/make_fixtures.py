"""Write tests/fixtures/model_small.safetensors and seq2seq_small.safetensors: reference tensors.

The weights are drawn from a seeded generator; the logits, loss and greedy continuation are
computed by the independent formulas of tests/helpers/model_reference.py (torch.nn.functional and a
plain-loop RoPE, in float64), never by ``lm``. tests/test_model.py and tests/test_seq2seq.py
load the files and check that ``lm`` reproduces every tensor, so any regression in a model shows.

    python scripts/make_fixtures.py --check        # do the committed files hold what the formulas give?
    python scripts/make_fixtures.py --overwrite    # rewrite them (only when the formulas change)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers.model_reference import encoder_decoder_ref, transformer_lm_ref  # noqa: E402

CONFIG = dict(vocab_size=64, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48, rope_theta=10000.0)
OUT = ROOT / "tests" / "fixtures" / "model_small.safetensors"
SEQ2SEQ = dict(vocab_size=40, context_length=16, d_model=32, encoder_layers=2, decoder_layers=2, num_heads=4,
               d_ff=64, dropout=0.0, label_smoothing=0.1)
SEQ2SEQ_OUT = ROOT / "tests" / "fixtures" / "seq2seq_small.safetensors"


def make_state_dict(g: torch.Generator) -> dict[str, torch.Tensor]:
    c = CONFIG
    d, f, v = c["d_model"], c["d_ff"], c["vocab_size"]

    def w(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    sd = {"token_embeddings.weight": w(v, d, scale=1.0)}
    for i in range(c["num_layers"]):
        p = f"layers.{i}."
        sd[p + "ln1.weight"] = 1 + w(d, scale=0.1)
        for name in ("q_proj", "k_proj", "v_proj", "output_proj"):
            sd[p + f"attn.{name}.weight"] = w(d, d, scale=d**-0.5)
        sd[p + "ln2.weight"] = 1 + w(d, scale=0.1)
        sd[p + "ffn.w1.weight"] = w(f, d, scale=d**-0.5)
        sd[p + "ffn.w2.weight"] = w(d, f, scale=f**-0.5)
        sd[p + "ffn.w3.weight"] = w(f, d, scale=d**-0.5)
    sd["ln_final.weight"] = 1 + w(d, scale=0.1)
    sd["lm_head.weight"] = w(v, d, scale=d**-0.5)
    return sd


def make_lm() -> tuple[dict[str, torch.Tensor], dict[str, str], Path]:
    g = torch.Generator().manual_seed(1234)
    c = CONFIG
    sd = make_state_dict(g)
    ids = torch.randint(0, c["vocab_size"], (2, c["context_length"]), generator=g)
    sd64 = {k: t.double() for k, t in sd.items()}

    def logits_of(x):
        return transformer_lm_ref(sd64, x, c["num_layers"], c["num_heads"], c["rope_theta"])

    logits = logits_of(ids)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, c["vocab_size"]), ids[:, 1:].reshape(-1))
    # Greedy continuation by re-running the whole (cropped) prefix every step.
    seq = ids[0, :5].tolist()
    for _ in range(20):
        window = torch.tensor([seq[-c["context_length"] :]])
        seq.append(int(logits_of(window)[0, -1].argmax()))
    tensors = {f"weights.{k}": t.contiguous() for k, t in sd.items()}
    tensors["input_ids"] = ids
    tensors["logits"] = logits.float()
    tensors["loss"] = loss.float().reshape(())
    tensors["greedy_prompt"] = ids[0, :5].clone()
    tensors["greedy_tokens"] = torch.tensor(seq[5:])
    OUT.parent.mkdir(parents=True, exist_ok=True)
    return tensors, {"config": json.dumps(CONFIG)}, OUT


def make_seq2seq() -> tuple[dict[str, torch.Tensor], dict[str, str], Path]:
    """A post-norm encoder–decoder on a ragged, padded batch: memory, hidden states, logits, loss."""
    g = torch.Generator().manual_seed(4321)
    c = SEQ2SEQ
    d, f, v = c["d_model"], c["d_ff"], c["vocab_size"]

    def w(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    sd = {"embeddings.weight": w(v, d, scale=d**-0.5)}
    blocks = [(f"encoder.{i}.", ["attn"], 2) for i in range(c["encoder_layers"])]
    blocks += [(f"decoder.{i}.", ["self_attn", "cross_attn"], 3) for i in range(c["decoder_layers"])]
    for p, attns, norms in blocks:
        for a in attns:
            for name in ("q_proj", "k_proj", "v_proj", "output_proj"):
                sd[p + f"{a}.{name}.weight"] = w(d, d, scale=d**-0.5)
        for j in range(1, norms + 1):
            sd[p + f"ln{j}.weight"], sd[p + f"ln{j}.bias"] = 1 + w(d, scale=0.1), w(d, scale=0.1)
        sd[p + "ffn.w1.weight"] = w(f, d, scale=d**-0.5)
        sd[p + "ffn.w2.weight"] = w(d, f, scale=f**-0.5)
    for name in ("encoder_norm", "decoder_norm"):
        sd[name + ".weight"], sd[name + ".bias"] = 1 + w(d, scale=0.1), w(d, scale=0.1)
    src = torch.randint(3, v, (2, 9), generator=g)
    tgt_in = torch.randint(3, v, (2, 7), generator=g)
    tgt_out = torch.randint(3, v, (2, 7), generator=g)
    src_mask = torch.arange(9)[None] < torch.tensor([9, 5])[:, None]
    tgt_mask = torch.arange(7)[None] < torch.tensor([7, 4])[:, None]
    src, tgt_in, tgt_out = src.masked_fill(~src_mask, 0), tgt_in.masked_fill(~tgt_mask, 0), tgt_out.masked_fill(
        ~tgt_mask, 0)
    sd64 = {k: t.double() for k, t in sd.items()}
    memory, hidden, logits = encoder_decoder_ref(sd64, src, src_mask, tgt_in, tgt_mask, num_heads=c["num_heads"],
                                                 encoder_layers=c["encoder_layers"],
                                                 decoder_layers=c["decoder_layers"])
    loss = F.cross_entropy(logits[tgt_mask], tgt_out[tgt_mask], label_smoothing=c["label_smoothing"])
    tensors = {f"weights.{k}": t.contiguous() for k, t in sd.items()}
    tensors.update(src=src, src_mask=src_mask, tgt_in=tgt_in, tgt_out=tgt_out, tgt_mask=tgt_mask,
                   memory=memory.float(), hidden=hidden.float(), logits=logits.float(), loss=loss.float().reshape(()))
    return tensors, {"config": json.dumps(SEQ2SEQ)}, SEQ2SEQ_OUT


def differences(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> list[str]:
    """What in the file at ``path`` differs from what the formulas give (bit for bit)."""
    if not path.exists():
        return [f"{path} is missing"]
    with safe_open(str(path), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
        diff = [] if f.metadata() == metadata else ["its config"]
    diff += [k for k in sorted(set(stored) | set(tensors))
             if k not in stored or k not in tensors or not torch.equal(stored[k], tensors[k])]
    return diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="compare the committed fixtures with the formulas' tensors")
    mode.add_argument("--overwrite", action="store_true", help="write the fixtures over the committed ones")
    args = ap.parse_args()
    status = 0
    for tensors, metadata, path in (make_lm(), make_seq2seq()):
        if args.check:
            diff = differences(tensors, metadata, path)
            print(f"{path.name}: " + ("up to date" if not diff else "differs: " + ", ".join(diff[:8])))
            status |= bool(diff)
        else:
            tmp = path.with_name(path.name + ".tmp")
            save_file(tensors, str(tmp), metadata=metadata)
            os.replace(tmp, path)
            print(f"wrote {path} ({path.stat().st_size} bytes)")
    return status


if __name__ == "__main__":
    sys.exit(main())
