"""Safe output: every file and folder that lm writes goes through this module.

The rules, which every command follows:

- a file appears complete under its final name or not at all (:func:`atomic_write`: a
  temporary name beside it, fsync, rename);
- no command writes over one of its own inputs (:func:`check_not_input`: resolved paths and
  inodes are compared, and a folder output may not contain an input or the working directory);
- an existing output is replaced only with ``--overwrite``, and only when it is recognisably a
  previous output of the same command (:func:`check_output_file`, :func:`check_output_dir`):
  a folder carries a marker file :data:`MARKER` naming the command that made it, and a folder
  that holds anything the command does not write (a file the user added to it) is never replaced;
- a folder output is built beside its final name and swapped in only once it is complete
  (:func:`replace_dir`), so a failed or interrupted command leaves the previous output as it was;
  one killed (SIGKILL) while the previous output was set aside leaves it in a hidden sibling, which the
  next run finds: it refuses, saying where it is, unless ``--overwrite`` discards it (:func:`_set_aside`);
  the temporary copy such a kill leaves is named in a warning and kept (:func:`warn_leftover_temps`).

Files and folders get the modes the user's umask gives (not ``mkstemp``'s 0600/0700).
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, NamedTuple

MARKER = ".lm-output.json"  # in every folder lm makes as a command's output: {"command": ..., "complete": ...}

Inputs = Iterable[tuple[str, str | os.PathLike]]  # (argument, path) pairs, e.g. ("--input", "a.txt")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new file gets from ``open``: 0666 less the umask."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode a new folder gets from ``mkdir``: 0777 less the umask."""
    return 0o777 & ~_umask()


def lock_file(path: str | os.PathLike) -> int | None:
    """An fd of ``path`` (made if missing, 0666 less the umask) holding an exclusive ``flock`` for
    this process; None where there is no ``flock`` (not POSIX: nothing is locked). Raises
    BlockingIOError when another process holds it. The kernel drops the lock when its process
    dies. The file locked is the one at ``path`` on return: one that its holder removed or renamed
    after this opened it is let go, and the new one tried (``lm train``'s run lock, a download's
    ``.part``)."""
    try:
        import fcntl
    except ImportError:
        return None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success fsync it and rename it to ``path``.

    On any exception the temporary file is removed, and the folders made for ``path`` where
    still empty, and ``path`` is left untouched, so an interrupted run never leaves a file that
    looks complete. An OSError of the temporary file names ``path``, the file the caller asked for.
    """
    with atomic_files() as open_file:
        yield open_file(path, mode, encoding)


@contextlib.contextmanager
def atomic_files() -> Iterator[Callable[..., IO]]:
    """Several files that appear together (ids, offsets, sidecar): ``open(path, mode="w",
    encoding="utf-8")`` gives a temporary file beside ``path``; when the block ends without an
    error, all of them are fsynced and only then renamed to their paths, the last opened first. A
    writer opens last the file its output is known by (a sidecar): a kill between two renames (SIGKILL,
    a power cut) then leaves an output that is known, which readers refuse for its sizes and
    ``--overwrite`` replaces, not a first write's ids without a sidecar, which nothing would replace
    (faults20).

    On any exception every temporary file is removed, and the folders made for them where still
    empty, and no ``path`` is touched: a failure while writing the last file (a name it cannot
    hold, a full disk) leaves the earlier output whole, not its first files replaced beside its
    old sidecar. An OSError of a temporary file names its ``path``.
    """
    staged: list[list] = []  # [file object or None, temporary name, path]
    with contextlib.ExitStack() as dirs:

        def open_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> IO:
            path = Path(path)
            dirs.enter_context(removing_made_dirs(path.parent))
            path.parent.mkdir(parents=True, exist_ok=True)
            with _naming(path):
                fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=path.parent)
            staged.append([None, tmp, path])
            try:
                with _naming(path):
                    os.chmod(tmp, file_mode())  # mkstemp creates 0600; give the file the usual mode
                staged[-1][0] = os.fdopen(fd, mode, encoding=None if "b" in mode else encoding)
            except BaseException:
                os.close(fd)
                raise
            return _NamedWrites(staged[-1][0], path)

        try:
            yield open_file
            for f, _, path in staged:
                with _naming(path):
                    f.flush()
                    os.fsync(f.fileno())
                    f.close()
            for _, tmp, path in reversed(staged):  # the last opened first: see the docstring
                with _naming(path):
                    os.replace(tmp, path)
        except BaseException:
            for f, tmp, _ in staged:
                if f is not None:
                    with contextlib.suppress(Exception):
                        f.close()
                with contextlib.suppress(FileNotFoundError):  # renamed already: the rename itself failed later
                    os.unlink(tmp)
            raise


class _NamedWrites:
    """A staged file whose write errors name ``path``, the file the caller asked for: a full disk had
    been "[Errno 28] No space left on device" naming no file (faults20), as ``write`` gives no name.
    Everything else is the file's own."""

    def __init__(self, file: IO, path: Path):
        self._file, self._path = file, path

    # a try, not _naming's context manager: json.dump writes a piece a token (a generator context
    # manager a write had doubled the time of saving GPT-2's tokenizer, 0.36 to 0.72 s: review20)
    def write(self, data):
        try:
            return self._file.write(data)
        except OSError as e:
            raise _named(e, self._path) from None

    def writelines(self, lines):
        try:
            return self._file.writelines(lines)
        except OSError as e:
            raise _named(e, self._path) from None

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as e:
            raise _named(e, self._path) from None

    def __getattr__(self, name: str):
        return getattr(self._file, name)


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError that names the temporary file (``.x.bin.lr28spfr.tmp``) names ``path`` instead."""
    try:
        yield
    except OSError as e:
        raise _named(e, path) from None


def _named(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` (``e`` itself when it has no errno to rebuild it from)."""
    return type(e)(e.errno, e.strerror, str(path)) if e.errno else e


@contextlib.contextmanager
def writing_out(out: str | os.PathLike, argument: str = "--out") -> Iterator[None]:
    """An OSError of writing an output (its folder, or the hidden temporary one built beside it) as one
    line naming the argument and the path the user gave: ``--out: '/sys/x' cannot be written: Operation
    not permitted``, not "[Errno 1] Operation not permitted: '/sys/.x.hzy8iri8.tmp'"."""
    try:
        yield
    except OSError as e:
        raise ValueError(f"{argument}: {str(out)!r} cannot be written: {e.strerror or e}") from None


def clear_error_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames on ``error``'s traceback and on those of the errors it
    was raised from or during (a full disk's OSError is wrapped twice, each traceback holding what was
    being written); a frame still running is left as it is. For an error kept beyond the work that
    raised it (a thread's, raised later): its frames would keep that work's objects alive, or make a
    cycle with the object that keeps the error. The lines stay, for a traceback printed later."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]


class InterruptGuard:
    """Ctrl-C as usual, until :meth:`hold`: from then to the end of the ``with`` block an
    interrupt is remembered and raised when the block ends.

    For outputs that are more than one file (ids and their sidecar): the long work stays
    interruptible, and the few renames that make the output complete happen together or
    not at all. Outside the main thread (where no signal handler can be set) it does nothing.
    """

    def __init__(self) -> None:
        self._held = False
        self._pending = False
        self._previous = None

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            if self._previous is signal.default_int_handler:  # someone else's handler: leave it alone
                signal.signal(signal.SIGINT, self._handle)
            else:
                self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        if not self._held:
            raise KeyboardInterrupt
        self._pending = True

    def hold(self) -> None:
        """From here to the end of the block, a Ctrl-C waits."""
        self._held = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self._pending and exc[0] is None:
            raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """A Ctrl-C inside the block is handed, once the block ends, to the SIGINT handler that was
    there before (whatever it is: Python's, an :class:`InterruptGuard`'s, a trainer's); ignored, if
    it was ignored. For short teardown that the interpreter may run in a finalizer (a weakref
    callback, ``__del__``), where a KeyboardInterrupt is printed as "Exception ignored" and lost.
    Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    frames = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: frames.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if frames:
            if callable(previous):
                previous(signal.SIGINT, frames[0])
            elif previous == signal.SIG_DFL:
                signal.raise_signal(signal.SIGINT)


def silence_stdout() -> None:
    """Point stdout's file descriptor at /dev/null, so that no later write or flush fails on a pipe
    whose reader went away (``| head``), the interpreter's last flush included (its "Exception
    ignored ... BrokenPipeError"): the Python docs' "Note on SIGPIPE"."""
    import sys

    with contextlib.suppress(OSError, ValueError, AttributeError):  # captured or replaced stdout: no descriptor
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)


def text_name(path: str | os.PathLike) -> str:
    """``path`` as text that a UTF-8 file (a sidecar, a summary) can hold: the bytes of a name that
    is not UTF-8 (a Latin-1 file name, which Python holds as lone surrogates) written ``\\xff``.

    >>> text_name("caf\\udce9.en"), text_name("café.en")
    ('caf\\\\xe9.en', 'café.en')
    """
    name = os.fspath(path)
    name = os.fsdecode(name) if isinstance(name, bytes) else name
    try:
        return os.fsencode(name).decode("utf-8", errors="backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that no file name gives
        return name.encode("utf-8", errors="backslashreplace").decode("utf-8")


def check_no_symlink_loop(path: str | os.PathLike, argument: str) -> None:
    """Refuse, naming ``argument``, a ``path`` that is a symlink loop or lies below one (``ln -s a b;
    ln -s b a``): ``Path.resolve`` raises RuntimeError for it on Python 3.10-3.12 (a traceback),
    and every other check calls it missing ("file not found") or a file."""
    path = Path(path)
    try:
        os.stat(path)
        return
    except OSError as e:
        if e.errno != errno.ELOOP:
            return
    for p in (*reversed(path.parents), path):  # the first component that loops
        try:
            os.stat(p)
        except OSError as e:
            if e.errno == errno.ELOOP:
                if p == path:
                    raise ValueError(f"{argument}: {str(path)!r} is a symlink loop") from None
                raise ValueError(f"{argument}: {str(path)!r} lies below {str(p)!r}, a symlink loop") from None


def check_not_empty(path: str | os.PathLike, argument: str) -> None:
    """Refuse an empty path, naming ``argument``: ``Path('')`` is ``Path('.')``, so a script's unset
    variable (``--checkpoint "$CKPT"``) read whatever the working folder held, or was refused naming
    ``'.'``, which the user never typed (clifuzz9 #3). Unix tools take ``''`` for no file, too."""
    if os.fspath(path) == "":
        raise ValueError(f"{argument}: must not be empty")


def check_readable_file(path: str | os.PathLike, argument: str, *, stream: bool = False) -> Path:
    """Return ``path`` as a Path, or raise ValueError naming the argument when it is not a readable file.

    With ``stream``, for a caller that reads the file once from its start, anything readable that is
    not a directory passes too: a named pipe, ``/dev/stdin``, a shell's ``<(cmd)`` (``/dev/fd/N``)."""
    check_not_empty(path, argument)
    p = Path(path)
    if not p.exists():
        check_no_symlink_loop(p, argument)
        raise ValueError(f"{argument}: file not found: {str(p)!r}")
    if stream and p.is_dir():
        raise ValueError(f"{argument}: is a directory: {str(p)!r}")
    if not stream and not p.is_file():
        raise ValueError(f"{argument}: not a regular file: {str(p)!r}")
    if not os.access(p, os.R_OK):
        raise ValueError(f"{argument}: file is not readable: {str(p)!r}")
    return p


# -- text --------------------------------------------------------------------------------------

def _count_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    _count_replace.count += err.end - err.start  # type: ignore[attr-defined]
    return "\ufffd", err.end


_count_replace.count = 0  # type: ignore[attr-defined]
codecs.register_error("lm-count-replace", _count_replace)


def decode_utf8(data: bytes) -> tuple[str, int]:
    """``data`` as text and the number of bytes that were not valid UTF-8 (each run became U+FFFD).

    >>> decode_utf8(b"caf\\xc3\\xa9 \\xff\\xfe!")
    ('café \\ufffd\\ufffd!', 2)
    """
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        _count_replace.count = 0  # type: ignore[attr-defined]
        text = data.decode("utf-8", errors="lm-count-replace")
        return text, _count_replace.count  # type: ignore[attr-defined]


def read_json_object(path: str | os.PathLike, label: str, expect: str = "a JSON object") -> dict:
    """The JSON object in the file ``path``; a one-line ValueError ``LABEL 'PATH' is not valid JSON:
    ...`` or ``LABEL 'PATH' must hold EXPECT`` otherwise."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{label} {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{label} {str(path)!r} must hold {expect}")
    return value


class FileChangedError(ValueError):
    """A file read in parts (by offsets, in chunks, by worker processes) changed while it was read:
    what was read is not one file's text."""


def read_text_range(path: str | os.PathLike, start: int, end: int) -> tuple[str, int]:
    """Bytes ``[start, end)`` of a file as UTF-8 text, and how many of them were invalid (now U+FFFD).
    :class:`FileChangedError` when the file ends before ``end`` (it had been truncated since the
    offsets were cut: a short read had been taken as the whole range)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
        if len(data) != end - start:
            raise FileChangedError(f"{str(path)!r} is {os.fstat(f.fileno()).st_size:,} bytes, shorter than the "
                                   f"range [{start:,}, {end:,}) read from it: was it changed while it was read?")
    return decode_utf8(data)


class FileState(NamedTuple):
    """What :func:`check_unchanged` compares: a file's device, inode, size and modification time."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def file_state(path: str | os.PathLike) -> FileState:
    """The :class:`FileState` of ``path`` now."""
    st = os.stat(path)
    return FileState(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def check_unchanged(path: str | os.PathLike, before: FileState, argument: str, doing: str) -> None:
    """Raise :class:`FileChangedError` naming ``argument`` when ``path`` is not the file it was
    (``before``: its :func:`file_state` when the reading began): written to, truncated, replaced
    (a new inode: an atomic rename over it) or gone. ``doing``: what was being done (``"tokenized"``)."""
    try:
        now = file_state(path)
    except FileNotFoundError:
        raise FileChangedError(f"{argument}: {str(path)!r} was deleted or moved while it was {doing}; "
                               f"nothing was written") from None
    if now != before:
        what = "replaced by another file" if (now.device, now.inode) != (before.device, before.inode) else "changed"
        sizes = f"{before.size:,} bytes then, {now.size:,} now" if now.size != before.size else \
            f"{now.size:,} bytes, as before"
        raise FileChangedError(f"{argument}: {str(path)!r} was {what} while it was {doing} ({sizes}); "
                               f"nothing was written")


@contextlib.contextmanager
def unchanged_while(states: dict[str, FileState], argument: str, doing: str) -> Iterator[None]:
    """The files of ``states`` (path -> its :func:`file_state` before the block), read by offsets
    within the block (in chunks, by worker processes), must stay those files: a read that found one
    shorter or gone is told as the change it is, and at the block's end each is checked again
    (:func:`check_unchanged`, naming ``argument``), so that nothing is made of another file's text."""
    try:
        yield
    except (FileChangedError, FileNotFoundError):
        for path, state in states.items():
            check_unchanged(path, state, argument, doing)
        raise
    for path, state in states.items():
        check_unchanged(path, state, argument, doing)


def utf8_error_place(data: bytes) -> tuple[int, int, int] | None:
    """``(line, column, byte)`` of the first byte of ``data`` that is not valid UTF-8, line and column
    counted from 1 (the column in bytes), as editors' "go to line:column" and every reader here say it;
    None when there is none.

    >>> utf8_error_place(b"line one\\nline two \\xff end\\n")
    (2, 10, 255)
    """
    at = _first_invalid_utf8(data)
    if at is None:
        return None
    return data.count(b"\n", 0, at) + 1, at - data.rfind(b"\n", 0, at), data[at]


def _first_invalid_utf8(data: bytes) -> int | None:
    """The offset of the first byte of ``data`` that is not valid UTF-8; None when there is none."""
    try:
        data.decode("utf-8")
        return None
    except UnicodeDecodeError as e:
        return e.start


def invalid_utf8_place(path: str | os.PathLike, start: int, end: int) -> tuple[int, int] | None:
    """``(line, column)``, from 1, of the first byte in ``[start, end)`` of the file ``path`` that is
    not valid UTF-8 (its column counted in bytes), None when there is none: where a reader that
    replaced bad bytes by U+FFFD tells the user to look. Read again only when there was one."""
    with open(path, "rb") as f:
        f.seek(start)
        first = _first_invalid_utf8(f.read(end - start))
    if first is None:
        return None
    at = start + first
    line, last_newline, offset = 1, -1, 0
    with open(path, "rb") as f:
        while offset < at:  # the line breaks before it, a block at a time
            block = f.read(min(1 << 20, at - offset))
            line += block.count(b"\n")
            if (i := block.rfind(b"\n")) >= 0:
                last_newline = offset + i
            offset += len(block)
    return line, at - last_newline


def replaced_utf8_message(argument: str, counts: dict[str, int], first: str, line: int, column: int,
                          after: str = "") -> str:
    """The warning of a reader that replaced bytes that are not valid UTF-8 by U+FFFD (``lm tokenize``,
    ``lm tokenizer train``, ``lm eval``): how many, of which file (``counts``: their number per file),
    and where the first is, in ``first`` at ``line`` and ``column`` (from 1); ``after`` ends the line.

    >>> replaced_utf8_message("input", {"a.txt": 1}, "a.txt", 2, 7)
    "input: 1 byte of 'a.txt' is not valid UTF-8 (the first at line 2, column 7); it was replaced by U+FFFD"
    """
    total = sum(counts.values())
    at = f"at line {line:,}, column {column:,}"
    of, where = (repr(first), f"the first {at}") if len(counts) == 1 else \
        (f"{len(counts)} files", f"the first in {first!r} {at}")
    noun, verb, were = ("byte", "is", "it was") if total == 1 else ("bytes", "are", "they were")
    return f"{argument}: {total:,} {noun} of {of} {verb} not valid UTF-8 ({where}); {were} replaced by U+FFFD{after}"


def looks_like_text(path: str | os.PathLike, sample: int = 1 << 16) -> bool:
    """True when the first ``sample`` bytes are mostly (75%) valid UTF-8 and hold no NUL byte, or
    a stray one (at most one in a thousand bytes) in what is otherwise valid UTF-8 (99%).

    Token files and arrays of numbers are full of NUL bytes (every id below 256 has a zero high
    byte), and where they hold few, most of the rest is not UTF-8. A NUL is valid UTF-8, which
    tokenizers encode like any other byte. Text in another encoding (Latin-1, say) still counts as
    text: its readers warn about it.
    """
    with open(path, "rb") as f:
        head = f.read(sample)
    nul = head.count(b"\0")
    if nul > len(head) // 1000:
        return False
    _, bad = decode_utf8(head[: len(head) - 3] if len(head) == sample else head)  # a cut character is fine
    return bad <= len(head) // (100 if nul else 4)


# -- outputs -----------------------------------------------------------------------------------

def _resolved(path: Path) -> Path:
    """``path.resolve()``, or ``path`` made absolute where a symlink loop stops the resolving
    (RuntimeError on Python 3.10-3.12, OSError later): callers refuse a loop first, naming it."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return Path(os.path.abspath(path))


def _same(a: Path, b: Path) -> bool:
    """The same file or folder: equal resolved paths, or (both existing) the same inode."""
    if _resolved(a) == _resolved(b):
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


GZIP_MAGIC = b"\x1f\x8b"  # the first two bytes of every gzip file


def is_gzip(path: str | os.PathLike) -> bool:
    """``path`` (a regular file) is gzip-compressed: told by its first two bytes, whatever its name,
    as every ``lm`` command that reads text tells it."""
    with open(path, "rb") as f:
        return f.read(len(GZIP_MAGIC)) == GZIP_MAGIC


def decompressed_copies(paths: Iterable[Path], stack: contextlib.ExitStack, argument: str = "--input") -> list[Path]:
    """``paths`` with every gzip file (:func:`is_gzip`: by content, not by a ``.gz`` name)
    decompressed into a private temporary folder (removed with ``stack``): what ``lm tokenizer
    train`` and ``lm demo --data`` read. A corrupt one is a ValueError naming ``argument``."""
    import gzip
    import zlib

    out, tmp = [], None
    for i, p in enumerate(paths):
        if not is_gzip(p):
            out.append(p)
            continue
        if tmp is None:
            _warn_stale_copies(argument)
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"lm-text-{os.getpid()}-")))
        text = tmp / f"{i}-{p.stem}"
        try:
            with gzip.open(p, "rb") as src, open(text, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{argument}: {str(p)!r} is not a valid gzip file: {e}") from None
        out.append(text)
    return out


_TEXT_COPY = re.compile(r"lm-text-(\d+)-\w+")  # decompressed_copies' folder: its process id, then mkdtemp's


def _warn_stale_copies(argument: str) -> None:
    """Warn (one line naming ``argument``) of the decompressed copies that runs killed meanwhile
    (SIGKILL, the OOM killer) left in the temporary folder, each as large as its corpus: named after a
    process that no longer runs here. Not removed: a process of another PID namespace sharing the
    folder (a container) may be reading one (faults20)."""
    stale = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(tempfile.gettempdir()):
            m = _TEXT_COPY.fullmatch(entry.name)
            if m and entry.is_dir(follow_symlinks=False) and not _running(int(m.group(1))):
                stale.append(Path(entry.path))
    if stale:
        size = sum(_disk_size(t) for t in stale)
        warnings.warn(f"{argument}: {spoken_list([repr(str(t)) for t in sorted(stale)])} ({size:,} bytes) "
                      f"{'hold the decompressed copies' if len(stale) > 1 else 'holds the decompressed copy'} of a "
                      f"gzip input that {'runs' if len(stale) > 1 else 'a run'} killed while reading left behind; "
                      f"rm -r {' '.join(shlex.quote(str(t)) for t in sorted(stale))}", stacklevel=3)


def _running(pid: int) -> bool:
    """A process ``pid`` runs here (or may: one of another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def check_text_input(path: Path, content: Path, argument: str = "--input") -> None:
    """``path`` must be text (``content``: the file, or a .gz input's decompressed copy): a token or
    pair file, or other binary data, had only drawn a warning about invalid UTF-8 and been tokenized
    (or trained on) as if it were text. A ValueError naming ``argument`` otherwise."""
    from lm.data.pairs import is_pair_file
    from lm.data.token_file import is_token_file

    if is_token_file(path) or is_pair_file(path):
        raise ValueError(f"{argument}: {str(path)!r} is a token file written by `lm tokenize`, not text; pass the "
                         "text it was made from")
    if not looks_like_text(content):
        raise ValueError(f"{argument}: {str(path)!r} is not text (it holds NUL bytes, or is mostly not UTF-8); "
                         "pass a UTF-8 text file")


def _inside(inner: Path, outer: Path) -> bool:
    """``inner`` is ``outer`` or lies somewhere below it (after resolving links)."""
    inner, outer = _resolved(inner), _resolved(outer)
    return inner == outer or outer in inner.parents


def check_not_input(out: str | os.PathLike, inputs: Inputs, argument: str = "--out", *, folder: bool = False) -> None:
    """Refuse an output that is one of the inputs, or (a folder) holds an input or the working directory,
    or a symlink loop (:func:`check_no_symlink_loop`), or an empty path (:func:`check_not_empty`)."""
    check_not_empty(out, argument)
    out = Path(out)
    check_no_symlink_loop(out, argument)
    for arg, inp in inputs:
        inp = Path(inp)
        if _same(out, inp):
            which = " itself" if str(out) == str(inp) else f" {str(inp)!r} (the same file)"  # a link, another spelling
            raise ValueError(f"{argument}: {str(out)!r} is the input {arg}{which}; choose another output")
        if folder and _inside(inp, out):
            raise ValueError(f"{argument}: {str(out)!r} contains the input {arg} {str(inp)!r}; choose another output")
    if folder and _inside(Path.cwd(), out):
        raise ValueError(f"{argument}: {str(out)!r} contains the current directory; choose a folder below it")


def check_parents(out: str | os.PathLike, argument: str = "--out") -> None:
    """Refuse, naming ``argument``, an ``out`` below a file (``notes.txt/x.png``), which no folder can be made for."""
    out = Path(out)
    for p in out.parents:
        if p.is_dir():
            return
        if p.exists() or p.is_symlink():
            raise ValueError(f"{argument}: {str(p)!r} is a file, not a folder, so {str(out)!r} cannot be made")


_RANDOM = r"[a-z0-9_]{8}"  # the random part of tempfile.mkstemp's and mkdtemp's names
_NAME_MAX = 255  # bytes in a file name (Linux, macOS)


def temp_prefix(name: str) -> str:
    """The start of the temporary (or set-aside) names beside an output called ``name``:
    ``.NAME.``, then ``tempfile``'s 8 random characters and ``.tmp`` or ``.old``. A name within 14
    bytes of the longest a file may have (255) is cut, with 8 hex digits of its hash after it (so
    that two long names do not share temporaries): such a name had failed "File name too long",
    though ``mkdir`` of it worked (tokexp22).

    >>> temp_prefix("out.bin")
    '.out.bin.'
    >>> p = temp_prefix("é" * 127); p[:4], p[-10:], len(os.fsencode(p + "abcdefgh.tmp")) <= 255
    ('.ééé', '~2e3eba0a.', True)
    """
    prefix = f".{name}."
    if len(os.fsencode(prefix)) + 8 + 4 <= _NAME_MAX:
        return prefix
    tag = "~" + hashlib.sha256(os.fsencode(name)).hexdigest()[:8] + "."
    room = _NAME_MAX - 8 - 4 - len(tag) - 1
    cut = name
    while len(os.fsencode(cut)) > room:  # whole characters: a cut never splits one
        cut = cut[:-1]
    return f".{cut}{tag}"


def _leftover_temps(out: Path) -> list[Path]:
    """The temporary files or folders that a killed writer of ``out`` left beside it: ``.OUT.XXXXXXXX.tmp``
    (:func:`atomic_write`, :func:`replace_dir`). A parent folder that cannot be read lists none."""
    name = re.compile(re.escape(temp_prefix(out.name)) + _RANDOM + r"\.tmp")
    with contextlib.suppress(OSError):
        return sorted(out.parent / e.name for e in os.scandir(out.parent if str(out.parent) else ".")
                      if name.fullmatch(e.name))
    return []


def _disk_size(path: Path) -> int:
    """The bytes of a file, or of every file under a folder (links not followed); what cannot be read counts 0."""
    if not path.is_dir() or path.is_symlink():
        with contextlib.suppress(OSError):
            return os.lstat(path).st_size
        return 0
    total = 0
    for root, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, n)).st_size
    return total


def warn_leftover_temps(out: str | os.PathLike, argument: str = "--out") -> None:
    """Warn (one line naming ``argument``) of the temporary files or folders a writer of ``out`` killed
    mid-write (SIGKILL, a power cut) left beside it, with their size and how to remove them. They are
    not removed: one may belong to another run writing ``out`` right now."""
    out = Path(out)
    temps = _leftover_temps(out)
    if not temps:
        return
    size = sum(_disk_size(t) for t in temps)
    what = (f"{str(temps[0])!r} and {len(temps) - 1} more ({size:,} bytes), beside {str(out)!r}, are the temporary "
            "copies of runs" if len(temps) > 1 else
            f"{str(temps[0])!r} ({size:,} bytes), beside {str(out)!r}, is the temporary copy of a run")
    warnings.warn(
        f"{argument}: {what} killed while writing it (or writing it now); once none is running: "
        f"rm -r {' '.join(shlex.quote(str(t)) for t in temps)}",
        stacklevel=2,  # one place for every caller: the same leftovers are named once per process
    )


def check_output_file(
    out: str | os.PathLike,
    *,
    argument: str = "--out",
    overwrite: bool = False,
    inputs: Inputs = (),
    recognise=None,
    what: str = "an output of this command",
) -> Path:
    """Check that ``out`` may be written; return it as a Path.

    A missing file is fine. An existing one is replaced only with ``overwrite`` and only when
    ``recognise(path)`` says it is ``what`` (a previous output of the same command). A path that
    cannot even be looked at (a name too long) is one line naming ``argument`` (:func:`writing_out`).
    """
    out = Path(out)
    with writing_out(out, argument):
        check_not_input(out, inputs, argument)
        check_parents(out, argument)
        if out.is_dir():
            raise ValueError(f"{argument}: {str(out)!r} is a folder; give a file name")
        if out.exists() or out.is_symlink():
            if recognise is not None and not recognise(out):
                raise ValueError(f"{argument}: {str(out)!r} exists and is not {what}; refusing to replace it")
            if not overwrite:
                raise ValueError(f"{argument}: {str(out)!r} exists; pass --overwrite to replace it")
    warn_leftover_temps(out, argument)
    return out


def read_marker(folder: Path) -> dict | None:
    """The marker of a folder that lm made as a command's output, or None."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("command"), str) else None


def write_marker(folder: Path, command: str, complete: bool = True) -> None:
    """Mark ``folder`` as ``command``'s output; once ``complete``, the marker lists every file in it
    (relative paths), so that a file added later, at any depth, is known not to be the command's."""
    marker = {"format": "lm-output", "command": command, "complete": complete}
    if complete:
        marker["files"] = sorted(p for p in _tree(folder) if p != MARKER)
    with atomic_write(folder / MARKER) as f:
        json.dump(marker, f)
        f.write("\n")


def _tree(folder: Path) -> list[str]:
    """Every file (and symlink) under ``folder``, as POSIX paths relative to it."""
    found = []
    for root, dirs, names in os.walk(folder):  # symlinks to folders are listed, not followed
        rel = Path(root).relative_to(folder)
        found += [(rel / n).as_posix() for n in names]
        found += [(rel / d).as_posix() for d in dirs if (Path(root) / d).is_symlink()]
    return found


def _written_by(name: str, files: Iterable[str]) -> bool:
    """``name`` is an entry the command writes into its output folder: one of ``files``, the marker,
    or the temporary name :func:`atomic_write` gives one of them (left by a killed run)."""
    names = (*files, MARKER)
    return name in names or any(
        name.startswith(temp_prefix(f)) and name.endswith(".tmp") for f in names
    )


def _temp_of(path: str, known: set[str]) -> bool:
    """``path`` is the temporary name :func:`atomic_write` gives a file of ``known`` (a killed writer's)."""
    p = Path(path)
    return p.name.endswith(".tmp") and any(
        p.name.startswith(temp_prefix(Path(k).name)) and Path(k).parent == p.parent for k in known)


def check_output_dir(
    out: str | os.PathLike,
    *,
    command: str,
    argument: str = "--out",
    overwrite: bool = False,
    inputs: Inputs = (),
    files: Iterable[str] = (),
) -> bool:
    """Check that the folder ``out`` may be made (or replaced); True when there is one to replace.

    A missing or empty folder is fine. A folder is replaced only with ``overwrite``, and only when
    it is an output of ``command``: its marker names ``command`` (a folder without one is never
    replaced, whatever its names: a user's ``data/`` and ``run/`` are a demo's names too, and an
    output of an lm before the marker cannot be told from them), every entry in it is one of
    ``files``, the names ``command`` writes (or the marker), and every file at any depth is one the
    marker lists (a complete output's marker lists its files). A folder that holds anything else (a
    file the user added beside the output or inside one of its subfolders) is never replaced: the
    error names the first such entry. Without ``overwrite``, an earlier output of ``command`` that a
    run killed while replacing ``out`` left set aside beside it (:func:`_set_aside`) is refused too,
    whatever ``out`` holds: the error says where it is and how to put it back, or to pass
    ``--overwrite`` to discard it. A path that cannot even be looked at (a name too long) is one
    line naming ``argument`` (:func:`writing_out`).
    """
    with writing_out(out, argument):
        return _check_output_dir(Path(out), command=command, argument=argument, overwrite=overwrite,
                                 inputs=inputs, files=files)


def _check_output_dir(out: Path, *, command: str, argument: str, overwrite: bool, inputs: Inputs,
                      files: Iterable[str]) -> bool:
    """:func:`check_output_dir`, its OSErrors left to the caller."""
    check_not_input(out, inputs, argument, folder=True)
    check_parents(out, argument)
    if out.is_symlink():  # the new folder, renamed into place, would replace the link, not the folder it points to
        raise ValueError(_symlink_message(out, argument))
    if out.exists() and not out.is_dir():
        raise ValueError(f"{argument}: {str(out)!r} exists and is not a folder")
    files = tuple(files)
    replacing = out.exists() and any(out.iterdir())
    if replacing:
        marker = read_marker(out)
        foreign = _not_written(out, files, marker)
        if marker is None and not foreign:  # names alone prove nothing: a user's data/ and run/, transformers' files
            raise ValueError(
                f"{argument}: {str(out)!r} holds files and no {MARKER} naming `{command}` (it was not written by "
                f"`{command}`, or by a version of lm before the marker); refusing to replace it: choose a new or "
                "empty folder, or remove it yourself"
            )
        if foreign or (marker and marker["command"] != command):
            why = [f"{foreign[0]!r}" + (f" and {len(foreign) - 1} more" if len(foreign) > 1 else "")] if foreign else []
            if marker and marker["command"] != command:
                why.append(f"it is an output of `{marker['command']}`")
            raise ValueError(
                f"{argument}: {str(out)!r} holds files that `{command}` did not write ({'; '.join(why)}); "
                "refusing to replace it: choose a new or empty folder"
            )
    if not overwrite:
        set_aside = _set_aside(out, command, files)
        if set_aside:
            raise ValueError(_set_aside_message(out, set_aside, command, argument, replacing))
    if replacing and not overwrite:
        if marker is not None and marker.get("complete") is not True:  # killed part way (SIGKILL, power), or running
            raise ValueError(f"{argument}: {str(out)!r} exists and is incomplete (a `{command}` killed part way, or "
                             "one still writing it); pass --overwrite to replace it once none is")
        raise ValueError(f"{argument}: {str(out)!r} exists; pass --overwrite to replace it")
    warn_leftover_temps(out, argument)
    return replacing


def _symlink_message(out: Path, argument: str) -> str:
    """Why an output folder given as a symlink is refused, and the way out: "exists and is not a
    folder" was wrong for a link to a folder, which ``test -d`` calls one (cli21 F3)."""
    target = os.readlink(out)
    if out.is_dir():
        return (f"{argument}: {str(out)!r} is a symlink (to {target!r}); give the folder itself: the output would "
                "replace the link, not the folder it points to")
    return f"{argument}: {str(out)!r} is a symlink (to {target!r}), not a folder; refusing to replace it"


def _not_written(folder: Path, files: tuple[str, ...], marker: dict | None) -> list[str]:
    """The entries of ``folder`` that its command does not write: at the top, those not among ``files``
    (:func:`_written_by`); below, when the marker lists the files (a complete output), any not listed."""
    foreign = [name for name in sorted(p.name for p in folder.iterdir()) if not _written_by(name, files)]
    listed = marker.get("files") if marker else None
    if not foreign and isinstance(listed, list):  # a complete output lists its files: anything added since,
        known = set(listed) | {MARKER}             # at any depth (a note in a demo's run/), is not the command's
        foreign = [p for p in sorted(_tree(folder)) if p not in known and not _temp_of(p, known)]
    return foreign


def _set_aside(out: Path, command: str, files: tuple[str, ...]) -> list[Path]:
    """The earlier outputs of ``command`` that a killed run left set aside beside ``out``.

    :func:`claim_dir` and :func:`replace_dir` move the output they replace to a hidden sibling
    ``.OUT.XXXXXXXX.old`` (``tempfile.mkdtemp``'s name) while they run; a run killed meanwhile
    (SIGKILL, a power cut) leaves it there. Listed is each such folder (not a link) whose marker
    names ``command`` and that holds only what ``command`` writes (:func:`_not_written`), complete
    outputs first, then the newest first. One without a marker is not listed, and removed if it is
    empty (killed before the move: it had been left for ever); another command's, or one holding
    anything else, is not listed, and so never touched.
    A parent folder that cannot be read lists none.
    """
    name = re.compile(re.escape(temp_prefix(out.name)) + _RANDOM + r"\.old")
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(out.parent if str(out.parent) else "."):
            if not name.fullmatch(entry.name):
                continue
            folder = out.parent / entry.name
            with contextlib.suppress(OSError):
                if not entry.is_dir(follow_symlinks=False):
                    continue
                marker = read_marker(folder)
                if marker is None:  # empty: a run killed after making it and before moving its output in
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)  # (only if empty: it holds nothing to lose; faults20)
                    continue
                if marker["command"] != command or _not_written(folder, files, marker):
                    continue
                found.append((marker.get("complete") is True, entry.stat(follow_symlinks=False).st_mtime, folder))
    return [folder for *_, folder in sorted(found, key=lambda f: (f[0], f[1]), reverse=True)]


def _set_aside_message(out: Path, set_aside: list[Path], command: str, argument: str, present: bool) -> str:
    """The refusal, without ``--overwrite``, of an ``out`` whose earlier output a killed run left set
    aside (:func:`_set_aside`): one line naming ``argument``, where that output is, and how to get it back."""
    old = set_aside[0]
    more = f" (and {len(set_aside) - 1} more like it)" if len(set_aside) > 1 else ""
    if (read_marker(old) or {}).get("complete") is True:
        what = "the previous complete output"
        clear = ""  # mv onto a folder would move it inside: the one in its place goes first
        if present or out.is_dir():
            clear = f"{'rm -r' if present else 'rmdir'} {shlex.quote(str(out))} && "
        how = f"to put it back: {clear}mv {shlex.quote(str(old))} {shlex.quote(str(out))}"
    else:
        what = "an earlier incomplete output"
        how = f"to remove it: rm -r {shlex.quote(str(old))}"
    return (f"{argument}: a run of `{command}` was killed while replacing {str(out)!r}, and {what} is still set "
            f"aside in {str(old)!r}{more}; {how}; or pass --overwrite to discard it")


def _remove_set_aside(folders: list[Path]) -> None:
    """Remove the earlier outputs a killed run left set aside (:func:`_set_aside`), once ``--overwrite``
    has replaced them."""
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def make_dir(path: str | os.PathLike) -> Path:
    """``mkdir -p`` with the usual modes."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def replace_dir(
    out: str | os.PathLike,
    *,
    command: str,
    argument: str = "--out",
    overwrite: bool = False,
    inputs: Inputs = (),
    files: Iterable[str] = (),
) -> Iterator[Path]:
    """Build a folder output beside ``out`` and swap it in when the block ends without an error.

    Yields the temporary folder to write into. The checks of :func:`check_output_dir` come
    first, so nothing is written when they refuse. The new folder gets the usual mode, or, where
    a folder is already at ``out`` (an empty one the user made, say private, or the output it
    replaces), that folder's group and mode (plus the owner's rwx, to write into it). On success
    it gets the marker, the previous output (if any) is moved aside, the new one renamed into
    place, and the old one deleted, with any earlier output of ``command`` a killed run left set aside
    (:func:`_set_aside`: with ``overwrite`` only, the checks refuse them otherwise); on failure the
    temporary folder goes and ``out`` and those are as they were.
    A folder that cannot be made is one line naming ``argument`` and ``out``, not the temporary name.
    """
    out = Path(out)
    files = tuple(files)
    replacing = check_output_dir(
        out, command=command, argument=argument, overwrite=overwrite, inputs=inputs, files=files
    )
    set_aside = _set_aside(out, command, files)  # a killed run's: listed before this run sets its own aside
    before = os.lstat(out) if out.is_dir() and not out.is_symlink() else None
    with removing_made_dirs(out.parent):
        with writing_out(out, argument):
            make_dir(out.parent)
            tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), suffix=".tmp", dir=out.parent))
        try:
            if before is None:
                os.chmod(tmp, dir_mode())
            else:  # renamed over it: keep who may read it, not the usual mode
                with contextlib.suppress(OSError):  # a group this user is not in: the mode still holds
                    os.chown(tmp, -1, before.st_gid)
                os.chmod(tmp, stat.S_IMODE(before.st_mode) | stat.S_IRWXU)
            yield tmp
            write_marker(tmp, command)
            _fsync_dir(tmp)
            if replacing:
                old = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), suffix=".old", dir=out.parent))
                os.replace(out, old)  # a folder onto an empty folder: allowed, atomic
                try:
                    os.replace(tmp, out)
                except BaseException:
                    os.replace(old, out)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out)  # onto a missing or empty folder
            _remove_set_aside(set_aside)
            _fsync_dir(out.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def missing_dirs(path: Path) -> list[Path]:
    """The folders of ``path`` (itself and its parents) that do not exist yet, deepest first."""
    missing = []
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing.append(p)
    return missing


@contextlib.contextmanager
def removing_made_dirs(folder: Path) -> Iterator[None]:
    """Run the block; if it fails (or is interrupted), remove the folders it made for ``folder``
    (those :func:`missing_dirs` names on entry), where still empty."""
    made = missing_dirs(folder)
    try:
        yield
    except BaseException:
        remove_made_dirs(made)
        raise


def remove_made_dirs(folders: list[Path]) -> None:
    """Remove the folders a failed command made for its output (:func:`missing_dirs`, deepest
    first), where still empty: one never made is passed over; one not empty is kept, with its parents."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            if os.path.isdir(p):  # not empty: something else wrote there meanwhile
                return


def _empty(folder: Path) -> None:
    """Remove everything in ``folder`` (symlinks themselves, never what they point to), keeping the folder."""
    try:
        entries = list(folder.iterdir())
    except OSError:  # gone meanwhile: nothing to empty
        return
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                p.unlink()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def claim_dir(
    out: str | os.PathLike,
    *,
    command: str,
    argument: str = "--out",
    overwrite: bool = False,
    inputs: Inputs = (),
    files: Iterable[str] = (),
) -> Iterator[Path]:
    """Like :func:`replace_dir` for an output that must be built in place (its files record their paths).

    After the checks, a previous output is moved aside to a hidden sibling and ``out`` is made
    anew, marked incomplete. When the block succeeds the marker says complete and the old
    output is deleted, with any earlier output of ``command`` that a run killed meanwhile left set
    aside (:func:`_set_aside`: with ``overwrite`` only, the checks refuse them otherwise); when it
    fails the new folder is removed and the old one put back, and those are kept. An
    empty folder that was there before (one the user made for the output) is written into in
    place and, on failure, emptied of what was written, not removed: no command removes a
    folder it did not make. A folder that cannot be made (or set aside) is one line naming
    ``argument`` and ``out``, as :func:`replace_dir` says it.
    """
    out = Path(out)
    files = tuple(files)
    replacing = check_output_dir(
        out, command=command, argument=argument, overwrite=overwrite, inputs=inputs, files=files
    )
    set_aside = _set_aside(out, command, files)  # a killed run's: listed before this run sets its own aside
    old = None
    if replacing:
        with writing_out(out, argument):
            old = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), suffix=".old", dir=out.parent))
            try:
                os.replace(out, old)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.rmdir(old)
                raise
    existed = out.is_dir()  # empty (the checks refused anything else), and not this command's
    with removing_made_dirs(out.parent):
        try:
            with writing_out(out, argument):
                _claim(out, existed, argument)
        except BaseException:  # another process's now: nothing of it is touched
            if old is not None:  # back in place if it can be; else left set aside, where later runs name it
                with contextlib.suppress(OSError):
                    os.replace(old, out)
            raise
        try:
            with writing_out(out, argument):
                write_marker(out, command, complete=False)
            yield out
            write_marker(out, command, complete=True)
        except BaseException:
            if existed:
                _empty(out)
            else:
                shutil.rmtree(out, ignore_errors=True)
            if old is not None:
                os.replace(old, out)
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _remove_set_aside(set_aside)


def _claim(out: Path, existed: bool, argument: str) -> None:
    """Make ``out``, or claim the empty folder that was there (its marker created exclusively), for
    this process alone. Between the checks and this another process may have done it (two ``lm demo
    --out X`` at once): both had written into one folder, and the one that failed emptied it under
    the other (faults20)."""
    try:
        if existed:
            os.close(os.open(out / MARKER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, file_mode()))
        else:
            make_dir(out.parent)
            os.mkdir(out)
    except FileExistsError:
        raise ValueError(f"{argument}: {str(out)!r} was taken by another process after it was checked (another "
                         "run writing the same output?); run again once that one is done") from None


def spoken_list(items: list[str]) -> str:
    """``'a'``, ``'a' and 'b'``, ``'a', 'b' and 'c'``: a list in a message."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def per_cpu_cap(floor: int) -> int:
    """The most threads or processes a count option accepts: 4 per CPU, and at least ``floor``."""
    return max(floor, 4 * (os.cpu_count() or 1))


def check_count(value, argument: str, floor: int) -> None:
    """``value`` a whole number in [1, :func:`per_cpu_cap` (``floor``)], else a ValueError naming
    ``argument`` (``--threads``, ``--num-workers``: a count that no machine needs, which would start
    that many threads or processes)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument}: must be a whole number >= 1, got {value!r}")
    if value > per_cpu_cap(floor):
        raise ValueError(f"{argument}: must be at most {per_cpu_cap(floor)} (4 per CPU, {os.cpu_count()} CPUs here, "
                         f"and at least {floor}), got {value}")


THREADS_FLOOR = 1024  # the least cap on a thread count, whatever the CPU count (lm.device.max_threads says why)


def check_threads(threads: int | None, argument: str = "--threads") -> None:
    """A count of CPU threads for torch's intra-op work: None (torch's default) or a whole number in
    [1, :func:`per_cpu_cap` (:data:`THREADS_FLOOR`)] (:func:`lm.device.max_threads`). Without torch,
    so that a command refuses a bad ``--threads`` before it spends seconds importing torch."""
    if threads is not None:
        check_count(threads, argument, floor=THREADS_FLOOR)
