"""A run directory as `lm train` leaves it (model.safetensors + tokenizer/), for the CLI tests."""

import torch

from lm.checkpoint import export_safetensors
from lm.model import TransformerLM
from lm.tokenizer import Tokenizer, save_tokenizer_dir, train_bpe


def make_run_dir(d, text: str, vocab_size: int, **model_kwargs):
    """Train a tokenizer on ``text``, build a seeded model, and save both under ``d``; return (d, model, tokenizer)."""
    (d / "corpus.txt").write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(d / "corpus.txt", vocab_size, ["<|endoftext|>"])
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    save_tokenizer_dir(tok, d / "tokenizer")
    torch.manual_seed(0)
    model = TransformerLM(vocab_size=vocab_size, **model_kwargs)
    return d, model, tok


def save_model(d, model) -> None:
    export_safetensors(model, d / "model.safetensors")
