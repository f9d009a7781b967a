"""A tokenizer's files: GPT-2's ``vocab.json`` + ``merges.txt``, Hugging Face's ``tokenizer.json``,
and the tokenizer directory that ``lm tokenizer train`` writes and every run carries.

Byte-level tokens are stored as strings through GPT-2's byte-to-character mapping
(:mod:`lm.tokenizer.byte_unicode`); special tokens are stored as their own text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from lm.io import atomic_write, check_readable_file, read_json_object
from lm.tokenizer.byte_unicode import bytes_to_unicode_str, unicode_str_to_bytes
from lm.tokenizer.pretokenize import GPT2_PATTERN
from lm.tokenizer.tokenizer import Tokenizer


def vocab_strings(tokenizer: Tokenizer) -> dict[str, int]:
    """``{token string: id}`` as GPT-2's ``vocab.json`` (and Hugging Face's BPE model) store it."""
    specials = {t.encode("utf-8") for t in tokenizer.special_tokens}
    return {(tok.decode("utf-8") if tok in specials else bytes_to_unicode_str(tok)): i
            for i, tok in sorted(tokenizer.vocab.items())}


def merge_strings(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    return [(bytes_to_unicode_str(a), bytes_to_unicode_str(b)) for a, b in tokenizer.merges]


def read_gpt2_files(vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                    special_tokens: Sequence[str] | None = None) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``(vocab, merges)`` from a GPT-2 style ``vocab.json`` + ``merges.txt`` (also GPT-2's
    ``encoder.json`` + ``vocab.bpe``); one-line errors naming the file and the line."""
    vocab_path = check_readable_file(vocab_path, "vocab_path")
    merges_path = check_readable_file(merges_path, "merges_path")
    raw = read_json_object(vocab_path, "vocab_path:", "a JSON object {token: id}")
    specials = set(special_tokens or [])
    vocab: dict[int, bytes] = {}
    for s, i in raw.items():
        if not isinstance(i, int):
            raise ValueError(f"vocab_path: id of token {s!r} is {i!r}, not an integer")
        if i in vocab:
            raise ValueError(f"vocab_path: id {i} is used twice")
        try:  # special tokens are stored as plain text; every other token in the byte mapping
            vocab[i] = s.encode("utf-8") if s in specials else unicode_str_to_bytes(s)
        except ValueError as e:
            raise ValueError(f"vocab_path: {e}") from None
    merges: list[tuple[bytes, bytes]] = []
    with open(merges_path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if (lineno == 1 and line.startswith("#version")) or not line:
                continue
            parts = line.split(" ")
            if len(parts) != 2:
                raise ValueError(f"merges_path: line {lineno} of {str(merges_path)!r} is not 'left right': {line!r}")
            merges.append((unicode_str_to_bytes(parts[0]), unicode_str_to_bytes(parts[1])))
    return vocab, merges


def write_gpt2_files(tokenizer: Tokenizer, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
    """GPT-2 style files, each written atomically: ``{token_string: id}`` JSON and one merge per line."""
    with atomic_write(vocab_path) as f:
        json.dump(vocab_strings(tokenizer), f, ensure_ascii=False, indent=0)
        f.write("\n")
    with atomic_write(merges_path) as f:
        f.write("#version: 0.2\n")
        for a, b in merge_strings(tokenizer):
            f.write(f"{a} {b}\n")


def hf_json(tokenizer: Tokenizer) -> dict:
    """A Hugging Face ``tokenizer.json`` document that encodes exactly like ``tokenizer``.

    Special tokens sit in the model vocab under their own text too, as in GPT-2's file:
    ``tokenizers`` gives an added token the id it has there (else a new id past the end)."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": tokenizer.token_to_id[t.encode("utf-8")], "content": t, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
            for t in tokenizer.special_tokens
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": GPT2_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab_strings(tokenizer),
            "merges": [list(pair) for pair in merge_strings(tokenizer)],
        },
    }


def write_hf_json(tokenizer: Tokenizer, path: str | os.PathLike) -> None:
    """Write :func:`hf_json` to ``path`` atomically (``tokenizers.Tokenizer.from_file`` loads it)."""
    with atomic_write(path) as f:
        json.dump(hf_json(tokenizer), f, ensure_ascii=False)


def save_tokenizer_dir(tokenizer: Tokenizer, directory: str | os.PathLike, *, hf: bool = False) -> Path:
    """Write ``DIR/vocab.json``, ``DIR/merges.txt`` and ``DIR/tokenizer_config.json`` (the special
    tokens), plus ``DIR/tokenizer.json`` for Hugging Face when ``hf``; :func:`load_tokenizer_dir` reads it."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tokenizer.save(d / "vocab.json", d / "merges.txt")
    if hf:
        tokenizer.save_hf(d / "tokenizer.json")
    with atomic_write(d / "tokenizer_config.json") as f:
        json.dump({"special_tokens": tokenizer.special_tokens, "pre_tokenizer": "gpt2"}, f, indent=1)
    return d


def load_tokenizer_dir(directory: str | os.PathLike, special_tokens: Sequence[str] | None = None) -> Tokenizer:
    """Load ``DIR/vocab.json`` + ``DIR/merges.txt`` as written by ``lm tokenizer train``.

    Special tokens default to those listed in ``DIR/tokenizer_config.json``.
    """
    d = Path(directory)
    if not d.is_dir():
        raise ValueError(f"tokenizer: not a directory: {str(d)!r}")
    if special_tokens is None:
        cfg = d / "tokenizer_config.json"
        special_tokens = []
        if cfg.exists():
            config = read_json_object(cfg, "tokenizer:")
            if "special_tokens" not in config:
                raise ValueError(f"tokenizer: {str(cfg)!r} has no 'special_tokens'")
            special_tokens = config["special_tokens"]
            if not isinstance(special_tokens, list) or not all(isinstance(t, str) for t in special_tokens):
                raise ValueError(f"tokenizer: {str(cfg)!r}: 'special_tokens' must be a list of strings")
    return Tokenizer.from_files(d / "vocab.json", d / "merges.txt", special_tokens)


def check_tokenizer_checksum(got: str, expected: str, *, argument: str, what: str, against: str) -> None:
    """Raise a one-line ValueError when two recorded tokenizer checksums differ.

    ``got`` is the checksum of ``what`` (a tokenizer, a token file's sidecar), ``expected`` that
    recorded by ``against`` (a checkpoint, another token file). An empty checksum means "not
    recorded" and is not checked. The one check behind training, evaluation and sampling.
    """
    if got and expected and got != expected:
        raise ValueError(
            f"{argument}: {what} is not the tokenizer of {against} "
            f"(tokenizer checksum {got[:12]}… instead of {expected[:12]}…)"
        )
