"""Small tokenizers for tests of translation models."""

from lm.tokenizer import Tokenizer

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def pair_tokenizer() -> Tokenizer:
    """The 256 bytes after ``<pad>``, ``<bos>`` and ``<eos>`` (ids 0, 1, 2: an encoder–decoder's
    default ``pad_id``, ``bos_id`` and ``eos_id``, as ``lm tokenizer train --special-tokens`` puts
    them first): 259 tokens, byte ``b`` is id ``b + 3``."""
    return Tokenizer({0: b"<pad>", 1: b"<bos>", 2: b"<eos>", **{i + 3: bytes([i]) for i in range(256)}}, [],
                     SPECIALS)
