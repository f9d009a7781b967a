"""Token ids in, text out, as the ids arrive: what streams a completion to a terminal or a client.

A byte-level BPE token can end in the middle of a UTF-8 character (an emoji is often two or
three tokens); :class:`TextStreamer` holds such bytes back until the character is complete, so
the pieces it returns always join to ``tokenizer.decode(ids)`` and no piece holds half a
character. Bytes that never form a character become U+FFFD, as in ``decode``.

>>> from lm.tokenizer import Tokenizer
>>> tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
>>> s = TextStreamer(tok)
>>> [s.push(i) for i in "é!".encode()] + [s.flush()]
['', 'é', '!', '']
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


class TextStreamer:
    """``push(id) -> str``: the text that became complete with this token ('' while a character
    is still open); ``flush() -> str``: whatever is left, at the end. ``skip`` ids (the
    end-of-text token, say) produce no text."""

    def __init__(self, tokenizer, skip: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self.skip = frozenset(int(i) for i in skip)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.length = 0  # characters returned so far
        self.start = 0  # where the last token's text starts in them (a piece of a character: their end before it)

    def push(self, token_id: int) -> str:
        if token_id in self.skip:
            self.start = self.length
            return ""
        raw = self.tokenizer.vocab[token_id]
        piece = self._decoder.decode(raw)
        before, self.length = self.length, self.length + len(piece)
        try:  # whole characters end the piece (before them: bytes they broke off, as U+FFFD)
            self.start = self.length - len(raw.decode("utf-8"))
        except UnicodeDecodeError:  # a piece of a character: the text before it
            self.start = before
        return piece

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        self.length += len(text)
        return text

    def pending(self) -> bool:
        """Whether bytes of an unfinished character are held back."""
        return bool(self._decoder.getstate()[0])
