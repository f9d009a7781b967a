"""A tokenizer's files: GPT-2's ``vocab.json`` + ``merges.txt``, Hugging Face's ``tokenizer.json``,
and the tokenizer directory that ``lm tokenizer train`` writes and every run carries.

Byte-level tokens are stored as strings through GPT-2's byte-to-character mapping
(:mod:`lm.tokenizer.byte_unicode`); special tokens as their own text where that cannot be taken
for another token (see :func:`vocab_strings`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from lm.io import (
    InterruptGuard,
    _same,
    atomic_files,
    atomic_write,
    check_not_empty,
    check_readable_file,
    read_json_object,
)
from lm.tokenizer.byte_unicode import UNICODE_TO_BYTE, bytes_to_unicode_str, unicode_str_to_bytes
from lm.tokenizer.pretokenize import GPT2_PATTERN, GPT2_REGEX, check_special_tokens
from lm.tokenizer.tokenizer import MAX_ID, Tokenizer, check_byte_level


def vocab_strings(tokenizer: Tokenizer) -> dict[str, int]:
    """``{token string: id}`` as GPT-2's ``vocab.json`` stores it, in id order; :func:`read_gpt2_files`
    reads it back to the same vocab.

    Every token is written through the byte mapping except the special tokens (by id, not by
    bytes: "@" may be both a special token and the byte ``b"@"``), which are written as their
    own text unless that is already another token's key ("é" is byte 0xE9's) or would read back
    as other bytes; then through the byte mapping ("Ã©"). A special token that fits neither way
    (a printable ASCII character, whose text is its byte's key) is refused: one key cannot hold two ids.
    """
    specials = set(tokenizer.special_tokens)
    special_ids = {i: t for t, i in tokenizer._special_ids.items()}
    needed = _bpe_tokens(tokenizer.merges)
    keys = _ordinary_keys(tokenizer, special_ids, "vocab.json")
    for i, t in special_ids.items():
        tok = tokenizer.vocab[i]
        forms = [t, bytes_to_unicode_str(tok)]
        key = next((k for k in forms if k not in keys and _token_bytes(k, specials, needed) == tok), None)
        if key is None:
            other = keys.get(t, keys.get(forms[1]))
            why = (f"{t!r} is already the key of token {other} ({tokenizer.vocab[other]!r})" if other is not None
                   else "its text would read back as other bytes")
            raise ValueError(f"special_tokens: {t!r} cannot be saved in vocab.json: {why}; "
                             "use a special token that is not also an ordinary token, such as '<|...|>'")
        keys[key] = i
    return dict(sorted(keys.items(), key=lambda kv: kv[1]))


def _ordinary_keys(tokenizer: Tokenizer, special_ids: dict[int, str], file: str) -> dict[str, int]:
    """``{byte-mapped string: id}`` of every token but the special ones, in id order, for ``file``
    (which holds one id per string: two ids of the same bytes are refused)."""
    keys: dict[str, int] = {}
    for i, tok in sorted(tokenizer.vocab.items()):
        if i in special_ids:
            continue
        key = bytes_to_unicode_str(tok)
        if key in keys:
            raise ValueError(f"vocab: ids {keys[key]} and {i} are both the token {tok!r}; "
                             f"{file} holds one id per token")
        keys[key] = i
    return keys


def _bpe_tokens(merges: Sequence[tuple[bytes, bytes]]) -> set[bytes]:
    """The tokens that BPE itself needs: the 256 single bytes and the result of every merge."""
    return {bytes([i]) for i in range(256)} | {a + b for a, b in merges}


def _token_bytes(key: str, specials: set[str], needed: set[bytes]) -> bytes:
    """The bytes of a ``vocab.json`` key: through GPT-2's byte mapping, or a special token's own text.

    A special token's text can also be a valid byte-mapped string that means other bytes:
    "é" is byte 0xE9 in GPT-2's own ``vocab.json``. It stands for those bytes when the
    tokenizer needs them (a single byte, or what a merge makes), else for the special token.
    """
    try:
        tok = unicode_str_to_bytes(key)
    except ValueError:
        if key in specials:
            return key.encode("utf-8")
        raise
    if key in specials and tok not in needed:
        return key.encode("utf-8")
    return tok


def merge_strings(tokenizer: Tokenizer) -> list[tuple[str, str]]:
    return [(bytes_to_unicode_str(a), bytes_to_unicode_str(b)) for a, b in tokenizer.merges]


def read_gpt2_files(vocab_path: str | os.PathLike, merges_path: str | os.PathLike,
                    special_tokens: Sequence[str] | None = None) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """``(vocab, merges)`` from a GPT-2 style ``vocab.json`` + ``merges.txt`` (also GPT-2's
    ``encoder.json`` + ``vocab.bpe``); one-line errors naming the file and the line."""
    special_tokens = check_special_tokens(special_tokens)
    return _parse_gpt2_files(_GPT2Files.read(vocab_path, merges_path), special_tokens)


class _GPT2Files:
    """The raw contents of a ``vocab.json`` + ``merges.txt`` pair, read once: a tokenizer folder
    without a list of special tokens needs them twice (:func:`unreachable_tokens`, then the vocab)."""

    def __init__(self, vocab_path: Path, merges_path: Path, raw: dict, merges: list[tuple[bytes, bytes]],
                 merge_lines: list[int]):
        self.vocab_path, self.merges_path, self.raw = vocab_path, merges_path, raw
        self.merges, self.merge_lines = merges, merge_lines
        self.needed = _bpe_tokens(merges)

    @classmethod
    def read(cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> _GPT2Files:
        vocab_path = check_readable_file(vocab_path, "vocab_path")
        merges_path = check_readable_file(merges_path, "merges_path")
        raw = read_json_object(vocab_path, "vocab_path:", "a JSON object {token: id}")
        return cls(vocab_path, merges_path, raw, *_read_merges(merges_path))

    def unreachable(self) -> list[str]:
        """:func:`unreachable_tokens` of these files."""
        found = []
        for key, i in self.raw.items():
            try:
                if unicode_str_to_bytes(key) in self.needed:
                    continue
            except ValueError:
                pass  # no byte-mapped string: only a special token's own text
            found.append((i if isinstance(i, int) else 0, key))  # (a bad id is read_gpt2_files' error)
        return [key for _, key in sorted(found)]


def _parse_gpt2_files(files: _GPT2Files, special_tokens: list[str]) -> tuple[dict[int, bytes],
                                                                               list[tuple[bytes, bytes]]]:
    """:func:`read_gpt2_files` of files already read, with checked ``special_tokens``."""
    vocab_file, merges_file = str(files.vocab_path), str(files.merges_path)
    merges, merge_lines, needed = files.merges, files.merge_lines, files.needed
    specials = set(special_tokens)
    vocab: dict[int, bytes] = {}
    for s, i in files.raw.items():
        if isinstance(i, bool) or not isinstance(i, int):  # JSON true is no id, though Python's True == 1
            raise ValueError(f"vocab_path: {vocab_file!r}: id of token {s!r} is {json.dumps(i)}, not an integer")
        if not 0 <= i <= MAX_ID:
            raise ValueError(f"vocab_path: {vocab_file!r}: id of token {s!r} is {i}, "
                             f"not an integer in [0, {MAX_ID}]")
        if i in vocab:
            raise ValueError(f"vocab_path: {vocab_file!r}: id {i} is used twice")
        try:  # the byte mapping, or a special token's own text
            vocab[i] = _token_bytes(s, specials, needed)
        except ValueError as e:
            raise ValueError(f"vocab_path: {vocab_file!r}: {e}") from None
    # what Tokenizer would refuse, said here with the files and the line
    tokens = set(vocab.values()) | {t.encode("utf-8") for t in special_tokens}  # Tokenizer adds missing specials
    check_byte_level(tokens, merges, vocab=f"vocab_path: {vocab_file!r}",
                     merge=lambda rank: f"merges_path: line {merge_lines[rank]} of {merges_file!r}: merge",
                     in_vocab=repr(vocab_file))
    return vocab, merges


def _read_merges(merges_path: Path) -> tuple[list[tuple[bytes, bytes]], list[int]]:
    """The merges of ``merges.txt``, and the line of each (for errors)."""
    merges: list[tuple[bytes, bytes]] = []
    merge_lines: list[int] = []
    try:
        with open(merges_path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if (lineno == 1 and line.startswith("#version")) or not line:
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"merges_path: line {lineno} of {str(merges_path)!r} is not 'left right': "
                                     f"{line!r}")
                try:
                    merges.append((unicode_str_to_bytes(parts[0]), unicode_str_to_bytes(parts[1])))
                except ValueError as e:
                    raise ValueError(f"merges_path: line {lineno} of {str(merges_path)!r}: {e}") from None
                merge_lines.append(lineno)
    except UnicodeDecodeError:
        raise ValueError(f"merges_path: {_not_utf8(merges_path)}") from None
    return merges, merge_lines


def unreachable_tokens(vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> list[str]:
    """The keys of ``vocab.json`` that BPE cannot make (neither one byte nor a merge's result), in id
    order: the special tokens of a folder that does not list them, as ``<|endoftext|>`` in GPT-2's
    own files, or the files ``Tokenizer.save`` writes."""
    return _GPT2Files.read(vocab_path, merges_path).unreachable()


def _not_utf8(path: Path) -> str:
    """``line N of 'PATH' is not UTF-8 (byte 0xFF)``: where the first invalid byte of ``path`` lies."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"line {line} of {str(path)!r} is not UTF-8 (byte 0x{data[e.start]:02x})"
    return f"{str(path)!r} is not UTF-8"  # valid now: the file changed meanwhile


def write_gpt2_files(tokenizer: Tokenizer, vocab_path: str | os.PathLike, merges_path: str | os.PathLike) -> None:
    """GPT-2 style files: ``{token_string: id}`` JSON and one merge per line, written together (both
    staged and synced before either replaces its path; a Ctrl-C once they are written waits for the
    renames), so a failure leaves the earlier pair whole."""
    check_not_empty(vocab_path, "vocab_path")
    check_not_empty(merges_path, "merges_path")
    if _same(Path(vocab_path), Path(merges_path)):  # the merges had replaced the vocab, and the call returned
        raise ValueError(f"merges_path: {str(merges_path)!r} is the same file as vocab_path {str(vocab_path)!r}; "
                         "the vocab and the merges need a file each")
    vocab = vocab_strings(tokenizer)  # may refuse a special token: before anything is written
    with InterruptGuard() as guard, atomic_files() as open_file:
        _write_gpt2(open_file, tokenizer, vocab, vocab_path, merges_path)
        guard.hold()


def _write_gpt2(open_file, tokenizer: Tokenizer, vocab: dict[str, int], vocab_path, merges_path) -> None:
    """The vocab and the merges through ``open_file`` (:func:`lm.io.atomic_files`'): staged, renamed
    with the other files of the block once all are written. Written one after the other, a full disk
    at the merges had left a new vocab beside the old merges, which loaded without a word as a
    tokenizer of the new size that encodes as the old one (faults20)."""
    f = open_file(vocab_path)
    json.dump(vocab, f, ensure_ascii=False, indent=0)
    f.write("\n")
    f = open_file(merges_path)
    f.write("#version: 0.2\n")
    for a, b in merge_strings(tokenizer):
        f.write(f"{a} {b}\n")


def hf_json(tokenizer: Tokenizer) -> dict:
    """A Hugging Face ``tokenizer.json`` document that encodes exactly like ``tokenizer``.

    Special tokens sit in the model vocab under their own text, as in GPT-2's file:
    ``tokenizers`` gives an added token the id that its text has there (else a new id past the
    end), whatever id the file records. So a special token whose text is also an ordinary
    token's byte-mapped string ("é", "Ġ" and "@" are single bytes' keys) cannot keep its own
    id there, and is refused; so is one that its byte-level decoder would decode as other text
    ("<|café|>": see :func:`_check_hf_decodes`).

    The document is in the form every ``tokenizers`` release that the project allows reads (0.15
    on): merges as ``"left right"`` strings, which are unambiguous because a byte-mapped token has
    no literal space (0.20 added the ``[left, right]`` form, which older releases fail to load),
    and no ``ignore_merges`` (0.19 added it; absent, it is false, as lm's BPE needs)."""
    vocab = hf_vocab(tokenizer)
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
            "vocab": vocab,
            "merges": [f"{a} {b}" for a, b in merge_strings(tokenizer)],
        },
    }


def hf_vocab(tokenizer: Tokenizer, *, check_decoding: bool = True) -> dict[str, int]:
    """The BPE model's ``{token string: id}`` of :func:`hf_json`: every token through the byte
    mapping, and each special token's id under its own text (as well, when BPE needs its bytes)."""
    special_ids = {i: t for t, i in tokenizer._special_ids.items()}
    needed = _bpe_tokens(tokenizer.merges)
    keys = _ordinary_keys(tokenizer, special_ids, "tokenizer.json")
    for i, t in special_ids.items():
        if tokenizer.vocab[i] in needed:  # also an ordinary token, which BPE makes or starts from
            keys.setdefault(bytes_to_unicode_str(tokenizer.vocab[i]), i)
        other = keys.setdefault(t, i)
        if other != i:
            raise ValueError(
                f"special_tokens: {t!r} cannot be saved in tokenizer.json: Hugging Face gives an added token the id "
                f"of the same string in the BPE vocab, where {t!r} is token {other} ({tokenizer.vocab[other]!r}); "
                "use a special token that is not also an ordinary token, such as '<|...|>'"
            )
        if check_decoding:
            _check_hf_decodes(t)
    return dict(sorted(keys.items(), key=lambda kv: kv[1]))


def _check_hf_decodes(special: str) -> None:
    """Refuse a special token that Hugging Face's byte-level decoder would decode as other text.

    ``tokenizers`` decodes an added token's text through the byte mapping too: a character of the
    mapping becomes its byte ("é" is 0xE9, "Ġ" is a space), any other character stays itself. Only
    printable ASCII maps to the same byte as its UTF-8 form, so "<|café|>" would come back as
    "<|caf\ufffd|>" and "Ġ<|x|>" as " <|x|>", while encoding still gave the right id."""
    decoded = b"".join(bytes([UNICODE_TO_BYTE[c]]) if c in UNICODE_TO_BYTE else c.encode("utf-8") for c in special)
    if decoded != special.encode("utf-8"):
        c = next(c for c in special if c in UNICODE_TO_BYTE and bytes([UNICODE_TO_BYTE[c]]) != c.encode("utf-8"))
        raise ValueError(
            f"special_tokens: {special!r} cannot be saved in tokenizer.json: Hugging Face's byte-level decoder "
            f"reads {c!r} as byte 0x{UNICODE_TO_BYTE[c]:02X} and would decode the token as "
            f"{decoded.decode('utf-8', 'replace')!r}; use a special token without {c!r}, such as '<|...|>'"
        )


def write_hf_json(tokenizer: Tokenizer, path: str | os.PathLike, document: dict | None = None) -> None:
    """Write :func:`hf_json` to ``path`` atomically (``tokenizers.Tokenizer.from_file`` loads it);
    ``document``: that of ``tokenizer`` when it was made already (checked before anything was written)."""
    with atomic_write(path) as f:
        json.dump(hf_json(tokenizer) if document is None else document, f, ensure_ascii=False)


def save_tokenizer_dir(tokenizer: Tokenizer, directory: str | os.PathLike, *, hf: bool = False) -> Path:
    """Write ``DIR/vocab.json``, ``DIR/merges.txt`` and ``DIR/tokenizer_config.json`` (the special
    tokens), plus ``DIR/tokenizer.json`` for Hugging Face when ``hf``, together, as
    :func:`write_gpt2_files` writes its two; :func:`load_tokenizer_dir` reads it."""
    d = Path(directory)
    blocked = next((p for p in (d, *d.parents) if os.path.lexists(p) and not p.is_dir()), None)
    if blocked is not None:  # mkdir's FileExistsError (or NotADirectoryError, for a parent) had come raw
        raise ValueError(f"directory: {str(blocked)!r} is not a directory"
                         + ("" if blocked == d else f" (saving to {str(d)!r})"))
    hf_doc = hf_json(tokenizer) if hf else None  # may refuse a special token: before anything is written
    vocab = vocab_strings(tokenizer)
    # all the files staged and renamed together (a folder made for them goes again on a failure)
    with InterruptGuard() as guard, atomic_files() as open_file:
        _write_gpt2(open_file, tokenizer, vocab, d / "vocab.json", d / "merges.txt")
        if hf_doc is not None:
            json.dump(hf_doc, open_file(d / "tokenizer.json"), ensure_ascii=False)
        json.dump({"special_tokens": tokenizer.special_tokens, "pre_tokenizer": "gpt2"},
                  open_file(d / "tokenizer_config.json"), indent=1)
        guard.hold()
    return d


def load_tokenizer_dir(directory: str | os.PathLike, special_tokens: Sequence[str] | None = None, *,
                       argument: str | None = None) -> Tokenizer:
    """Load ``DIR/vocab.json`` + ``DIR/merges.txt`` as written by ``lm tokenizer train``.

    Special tokens default to those listed in ``DIR/tokenizer_config.json``; without that file, to the
    tokens of ``vocab.json`` that BPE cannot make (:func:`unreachable_tokens`: ``<|endoftext|>`` in
    GPT-2's own files and in those :meth:`Tokenizer.save` writes). Errors are ValueErrors
    that start with the parameter at fault (``tokenizer:``, ``vocab_path:``, ``merges_path:``), or,
    with ``argument`` (``"--tokenizer"``), with that instead, which stands for all of them.
    """
    check_not_empty(directory, argument or "tokenizer")  # Path('') is the working folder
    if argument is None:
        return _load_tokenizer_dir(Path(directory), special_tokens)
    try:
        return _load_tokenizer_dir(Path(directory), special_tokens)
    except (ValueError, OSError) as e:
        message = re.sub(r"^(?:tokenizer|vocab_path|merges_path):\s*", "", str(e))
        raise ValueError(f"{argument}: {message}") from None


def _load_tokenizer_dir(d: Path, special_tokens: Sequence[str] | None) -> Tokenizer:
    if not d.is_dir():  # a path to nothing is "not found", as data.train's and --checkpoint's are
        raise ValueError(f"tokenizer: {'not a directory' if os.path.lexists(d) else 'not found'}: {str(d)!r}")
    for name in ("vocab.json", "merges.txt"):
        if not (d / name).exists():  # not "vocab_path: file not found", a name the caller never gave
            inner = d / "tokenizer"  # a run folder, say, whose tokenizer is in its tokenizer/
            hint = f"; pass {str(inner)!r}, which has one" if (inner / name).is_file() else ""
            raise ValueError(f"tokenizer: no {name} in {str(d)!r}{hint}")
    cfg = d / "tokenizer_config.json"
    if special_tokens is None and cfg.exists():
        config = read_json_object(cfg, "tokenizer:")
        if "special_tokens" not in config:
            raise ValueError(f"tokenizer: {str(cfg)!r} has no 'special_tokens'")
        special_tokens = config["special_tokens"]
        if not isinstance(special_tokens, list) or not all(isinstance(t, str) for t in special_tokens):
            raise ValueError(f"tokenizer: {str(cfg)!r}: 'special_tokens' must be a list of strings")
    files = _GPT2Files.read(d / "vocab.json", d / "merges.txt")  # once (GPT-2's: 0.15 s a read)
    if special_tokens is None:
        # Without a list, the tokens BPE cannot make are the special ones: read as ordinary text, a
        # folder of Tokenizer.save's files (or GPT-2's own) split each <|endoftext|> into 11 tokens
        # and still gave its id as eot_id (audit tokenizer9).
        special_tokens = files.unreachable()
        _check_unlisted_specials(files, special_tokens)
    special_tokens = check_special_tokens(special_tokens)
    return Tokenizer(*_parse_gpt2_files(files, special_tokens), special_tokens)


def _check_unlisted_specials(files: _GPT2Files, found: list[str]) -> None:
    """Refuse, among the tokens BPE cannot make, one that two tokens it can make spell (``Ġw`` =
    ``Ġ`` + ``w``): a learned token whose merge is missing, as in a merges.txt cut short or of another
    vocab, not a special token. Taken as one, it had matched as a special token anywhere in a text
    (apifuzz19). ``<|endoftext|>`` and the like are no two tokens of a BPE vocab."""
    def halves(key: str) -> tuple[bytes, bytes] | None:
        try:
            tok = unicode_str_to_bytes(key)
        except ValueError:
            return None  # a special token's own text
        return next(((tok[:i], tok[i:]) for i in range(1, len(tok))
                     if tok[:i] in files.needed and tok[i:] in files.needed), None)

    learned = [(key, pair) for key in found if (pair := halves(key)) is not None]
    if learned:
        key, (a, b) = learned[0]
        raise ValueError(
            f"tokenizer: {len(learned)} token(s) of {str(files.vocab_path)!r} are made by no merge of "
            f"{str(files.merges_path)!r}, though two of its tokens spell them ({key!r} = "
            f"{bytes_to_unicode_str(a)!r} + {bytes_to_unicode_str(b)!r}): is merges.txt cut short, or of "
            "another vocab? (Without a tokenizer_config.json, the tokens no merge makes are taken as the "
            "special ones; list them there under 'special_tokens' if these are.)")


def check_special_tokens_savable(special_tokens: Sequence[str]) -> None:
    """Refuse, before training, a special token that the files of a trained tokenizer could not
    keep apart from an ordinary token: one of the 256 single bytes ("@" in ``vocab.json``; "é",
    "Ġ" in ``tokenizer.json``: see :func:`vocab_strings` and :func:`hf_json`), or a token that
    training could learn, whose key would be the special token's text ("Ġthe" is the key of the
    learned token " the"): a text that is GPT-2's byte-mapped spelling of bytes that one pre-token
    can hold. Found only when the files were written, such a clash threw the whole training away.
    ``"<|endoftext|>"``, ``"<pad>"``, ``"[SEP]"`` are several pre-tokens, and ``"<sep> "`` or
    ``"\n\n"`` no byte-mapped string at all: none of them can clash."""
    from lm.tokenizer.train import build_vocab

    special_tokens = check_special_tokens(special_tokens)
    tokenizer = Tokenizer(build_vocab(special_tokens, []), [], special_tokens)
    vocab_strings(tokenizer)
    hf_vocab(tokenizer, check_decoding=False)  # decoding last: a learnable spelling ("Ġthe") is the better reason
    for t in special_tokens:
        try:
            raw = unicode_str_to_bytes(t)
        except ValueError:
            continue  # not GPT-2's spelling of any bytes: no learned token has it as its key
        if _learnable(raw):
            raise ValueError(f"special_tokens: {t!r} is how vocab.json and tokenizer.json spell the bytes "
                             f"{raw!r}, which training may learn as an ordinary token; use a special token "
                             "that is not, such as '<|...|>'")
    for t in special_tokens:
        _check_hf_decodes(t)


def _learnable(raw: bytes) -> bool:
    """Whether BPE training could learn ``raw`` as one token: bytes that one GPT-2 pre-token of
    UTF-8 text can hold. Pieces of characters count (BPE learns them inside a pre-token): up to
    three continuation bytes at the start, an unfinished character at the end. Bytes that no UTF-8
    text holds (``b'caf\\xe9|'``: a lead byte before ``|``) cannot be learned."""
    import codecs

    lead = 0
    while lead < min(3, len(raw)) and 0x80 <= raw[lead] <= 0xBF:
        lead += 1
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(raw[lead:], final=False)
    except UnicodeDecodeError:
        return False
    return len(GPT2_REGEX.findall(text)) <= 1 if text else True


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
