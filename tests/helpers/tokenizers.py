"""Small tokenizers for tests of translation models."""

from lm.tokenizer import Tokenizer

SPECIALS = ["<pad>", "<bos>", "<eos>"]


def pair_tokenizer() -> Tokenizer:
    """The 256 bytes after ``<pad>``, ``<bos>`` and ``<eos>`` (ids 0, 1, 2: an encoder–decoder's
    default ``pad_id``, ``bos_id`` and ``eos_id``, as ``lm tokenizer train --special-tokens`` puts
    them first): 259 tokens, byte ``b`` is id ``b + 3``."""
    return Tokenizer({0: b"<pad>", 1: b"<bos>", 2: b"<eos>", **{i + 3: bytes([i]) for i in range(256)}}, [],
                     SPECIALS)


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2's ``bytes_to_unicode`` (openai/gpt-2 encoder.py), written out here: the reference for
    lm's byte mapping."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
