"""Resumable HTTP downloads with a size and checksum check, and the TinyStories files.

A download goes to ``FILE.part`` and is renamed to ``FILE`` only once its size (and its
SHA-256, when the server states one) is right, so a file under the final name is always
complete. An interrupted or dropped download resumes from the bytes already on disk with
an HTTP range request.

Hugging Face serves large files from LFS: the ``/resolve/`` URL answers with a redirect
that carries the file's size (``X-Linked-Size``) and SHA-256 (``X-Linked-ETag``); they are
read before the redirect is followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from tqdm import tqdm

from lm.io import check_no_symlink_loop, check_parents, lock_file, removing_made_dirs

TINYSTORIES_URL = "https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main"
TINYSTORIES_FILES = {"train": "TinyStoriesV2-GPT4-train.txt", "valid": "TinyStoriesV2-GPT4-valid.txt"}
# Multi30k task 1 (En-De image captions), raw, at a fixed commit of its public repository
MULTI30K_COMMIT = "a3d2e0d26b56f3846f66a952536ffed4e401d05a"
MULTI30K_URL = f"https://github.com/multi30k/dataset/raw/{MULTI30K_COMMIT}/data/task1/raw"
MULTI30K_FILES = {  # name: (bytes, SHA-256)
    "train.en.gz": (568929, "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f"),
    "train.de.gz": (637044, "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6"),
    "val.en.gz": (21650, "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28"),
    "val.de.gz": (24681, "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a"),
    "test_2016_flickr.en.gz": (21077, "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9"),
    "test_2016_flickr.de.gz": (22890, "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8"),
}
_BLOCK = 1 << 20


class DownloadError(OSError):
    """A download failed for what the server answered, or did not (as opposed to this machine's disk):
    the error an environment variable's URL is named in."""


@dataclass
class RemoteFile:
    url: str  # where the bytes are (after a redirect)
    size: int | None
    sha256: str | None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D401
        return None


def _clean_etag(value: str | None) -> str | None:
    if not value:
        return None
    v = value.strip().removeprefix("W/").strip('"')
    return v.lower() if len(v) == 64 and all(c in "0123456789abcdefABCDEF" for c in v) else None


def probe(url: str, timeout: float = 30.0) -> RemoteFile:
    """HEAD the URL without following redirects; read size and checksum from the first answer.

    An answer that may differ on the next try (503, 429, ...) is raised as the ``HTTPError`` itself;
    any other failure status as a one-line :class:`DownloadError`."""
    opener = urllib.request.build_opener(_NoRedirect)
    seen = set()
    size = sha = None
    for _ in range(10):
        req = urllib.request.Request(url, method="HEAD", headers={"Accept-Encoding": "identity"})
        try:
            resp = opener.open(req, timeout=timeout)
            code, headers = resp.status, resp.headers
            resp.close()
        except urllib.error.HTTPError as e:  # 3xx arrive here when redirects are not followed
            code, headers = e.code, e.headers
            if code in _RETRY_STATUS:
                raise
            if code in (405, 501):  # a server that does not do HEAD may still serve the file: GET tells
                return RemoteFile(url, size, sha)
            if code not in (301, 302, 303, 307, 308):
                raise DownloadError(f"{url} answered HTTP {code} {e.reason}".rstrip()) from None
        size = size or _int(headers.get("X-Linked-Size"))
        sha = sha or _clean_etag(headers.get("X-Linked-ETag"))
        if code in (301, 302, 303, 307, 308):
            if not headers.get("Location"):
                raise DownloadError(f"{url} answered HTTP {code} (a redirect) without a Location header")
            url = urllib.parse.urljoin(url, headers["Location"])
            if url in seen:
                raise DownloadError(f"redirect loop at {url}")
            seen.add(url)
            continue
        return RemoteFile(url, size or _int(headers.get("Content-Length")), sha)
    raise DownloadError(f"too many redirects, the last to {url}")


def _transient(error: Exception) -> bool:
    """A failure that may not happen on the next try: a timeout, a dropped connection. Not a name that
    does not resolve or a refused connection (offline, or no server there): those are said at once."""
    reason = getattr(error, "reason", error) if isinstance(error, urllib.error.URLError) else error
    return isinstance(reason, (TimeoutError, HTTPException, ConnectionResetError, ConnectionAbortedError,
                               BrokenPipeError))


def _probe_again(url: str, timeout: float, retries: int) -> RemoteFile:
    """:func:`probe`, asked again up to ``retries`` times, as the download itself is, after an answer
    or a failure that may differ on the next try (one 503 had failed the whole download)."""
    attempt = 0
    while True:
        try:
            return probe(url, timeout)
        except urllib.error.HTTPError as e:  # probe raises only the statuses of _RETRY_STATUS as such
            if attempt >= retries:
                raise DownloadError(f"{url} answered HTTP {e.code} {e.reason}".rstrip()
                                    + f" {retries + 1} times; run again later") from None
        except (TimeoutError, urllib.error.URLError, ConnectionError, HTTPException) as e:
            if attempt >= retries or not _transient(e):
                raise
        attempt += 1
        time.sleep(_retry_wait(attempt))


def _int(v: str | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def _sha256_of(path: Path) -> hashlib._Hash:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            h.update(block)
    return h


def check_out_dir(out_dir: str | os.PathLike, argument: str = "--out") -> Path:
    """``out_dir`` as a Path; a one-line ValueError naming ``argument`` when it, or a folder above
    it, exists and is not a folder (so it cannot hold the downloads)."""
    out_dir = Path(out_dir)
    check_no_symlink_loop(out_dir, argument)  # not "a file, not a folder"
    if not out_dir.is_dir() and (out_dir.exists() or out_dir.is_symlink()):
        raise ValueError(f"{argument}: {str(out_dir)!r} is a file, not a folder; give a folder")
    check_parents(out_dir, argument)
    return out_dir


def check_download_dest(dest: Path, argument: str = "--out") -> None:
    """Refuse a download whose file, or its ``.part``, is in the way as something other than a file."""
    check_out_dir(dest.parent, argument)
    for p in (dest, dest.with_name(dest.name + ".part")):
        if p.is_dir():
            raise ValueError(f"{argument}: {str(p)!r} is a folder, not a file; move it away to download "
                             f"{dest.name} into {str(dest.parent)!r}")
        if p.exists() and not p.is_file():
            raise ValueError(f"{argument}: {str(p)!r} is not a regular file; move it away to download {dest.name}")


def download(
    url: str,
    dest: str | os.PathLike,
    *,
    expected_size: int | None = None,
    expected_sha256: str | None = None,
    retries: int = 5,
    timeout: float = 30.0,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Download ``url`` to ``dest``, resuming ``dest.part`` if present; verify size and checksum.

    Returns ``dest``. A file already at ``dest`` is kept when it has the right size and, where a
    SHA-256 is known (``expected_sha256``, or the server's), the right checksum: without any request
    when ``expected_size`` and ``expected_sha256`` vouch for it; with a warning and no check when
    there is nothing to vouch for it and the server cannot be reached. Any other file there is
    replaced only with ``overwrite``, and only once the new one is complete and verified (it is
    downloaded to ``dest.part`` and renamed over it). An answer or a failure that may differ on the
    next try (503, 429, a timeout, a dropped connection) is retried up to ``retries`` times, the first
    request (HEAD) as the download. Raises ``OSError`` with one line on failure (:class:`DownloadError`
    for what the server answered, or did not); the partial file stays, for the next attempt, and a
    folder made for ``dest`` is removed again when nothing is in it.
    """
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    check_download_dest(dest)
    if (expected_size is not None and dest.is_file() and dest.stat().st_size == expected_size
            and (expected_sha256 is None or _sha256_of(dest).hexdigest() == expected_sha256.lower())):
        return dest  # complete and verified: no need for the network
    with removing_made_dirs(dest.parent):  # where still empty: a .part that resumes keeps its folder
        return _download(url, dest, part, expected_size=expected_size, expected_sha256=expected_sha256,
                         retries=retries, timeout=timeout, progress=progress, overwrite=overwrite)


def _download(url: str, dest: Path, part: Path, *, expected_size: int | None,
              expected_sha256: str | None, retries: int, timeout: float, progress: bool, overwrite: bool) -> Path:
    """:func:`download` from the probe on."""
    try:
        remote = _probe_again(url, timeout, retries)
    except (TimeoutError, urllib.error.URLError, ConnectionError, HTTPException) as e:
        reason = getattr(e, "reason", e)
        local = urllib.parse.urlsplit(url).scheme == "file"  # a local copy: it has no host, nothing is offline
        failed = f"cannot read {url}" if local else f"cannot reach {urllib.parse.urlsplit(url).netloc or url}"
        reason = (getattr(reason, "strerror", None) or reason) if local else reason
        if dest.is_file() and expected_size is None and expected_sha256 is None:
            # it came here by a rename after a verified download (or the user put it here): keep it
            warnings.warn(f"{failed} ({reason}) to check {str(dest)!r}; "
                          f"kept the {dest.stat().st_size:,} bytes there as they are", stacklevel=3)
            return dest
        raise DownloadError(f"{failed}: {reason}" + ("" if local else " (offline?)")) from None
    if expected_size is not None and remote.size is not None and remote.size != expected_size:
        # another file (a proxy's or a portal's page, a mirror's other version): refused before any byte comes
        raise DownloadError(f"{remote.url} has {remote.size:,} bytes, not the {expected_size:,} of {dest.name}: "
                            "another file")
    size = expected_size or remote.size
    sha = (expected_sha256 or remote.sha256 or "").lower() or None
    if dest.exists():
        have = dest.stat().st_size
        if size is not None and have != size:
            why = f"with {have:,} bytes, not the {size:,} of {dest.name}"
        elif sha is not None and _sha256_of(dest).hexdigest() != sha:
            why = f"with the size of {dest.name} but another SHA-256"
        else:
            return dest
        if not overwrite:
            raise ValueError(f"--out: {str(dest)!r} exists {why}; pass --overwrite to download it again")

    attempt = 0
    bar = tqdm(total=size, unit="B", unit_scale=True, desc=dest.name,
               disable=None if progress else True, file=sys.stderr)
    lock: list[int] = []  # the fd that holds the .part for this process, once it writes (_hold)
    try:
        while True:
            if not lock and part.exists():  # a .part to resume: held before it is read
                lock = _hold(part, dest)
            have = part.stat().st_size if part.exists() else 0
            if size is not None and have > size:
                part.unlink()
                have = 0
                for fd in lock:  # the unlinked file's: the next .part is another file, held when made
                    os.close(fd)
                lock = []
            bar.n = have
            bar.refresh()
            if size is not None and have == size:
                break
            headers = {"Accept-Encoding": "identity"}
            if have:
                headers["Range"] = f"bytes={have}-"
            try:
                with urllib.request.urlopen(urllib.request.Request(remote.url, headers=headers), timeout=timeout) as r:
                    mode = "ab" if have and r.status == 206 else "wb"  # 200: the server ignored the range
                    whole = _int(r.headers.get("Content-Length")) if mode == "wb" else None  # the file's own size
                    if mode == "wb":
                        bar.n = 0
                    try:  # once the server answers with the file
                        dest.parent.mkdir(parents=True, exist_ok=True)
                    except OSError as e:
                        raise ValueError(f"--out: cannot make the folder {str(dest.parent)!r}: "
                                         f"{e.strerror or e}") from None
                    if not lock:
                        lock = _hold(part, dest)
                        if part.stat().st_size != have:  # another process made and wrote it meanwhile
                            continue
                    with open(part, mode) as f:
                        while block := r.read(_BLOCK):
                            f.write(block)
                            bar.update(len(block))
                if size is None:
                    break
                got = part.stat().st_size
                if got > size or (whole is not None and got == whole != size):
                    # the whole of another file: asked again, it comes again (a longer one had been fetched
                    # without end, a shorter one "failed after 5 retries: no data received; run again")
                    part.unlink()
                    raise DownloadError(f"{remote.url} sent {got:,} bytes{'' if got > size else ', the whole file'}, "
                                        f"not the {size:,} of {dest.name}: another file")
                if got == have:  # the server closed without sending anything
                    raise ConnectionError("no data received")
            except urllib.error.HTTPError as e:
                if e.code not in _RETRY_STATUS:  # a 404 or 403 is the answer: asking again would not change it
                    raise DownloadError(f"{remote.url} answered HTTP {e.code} {e.reason}".rstrip()) from None
                attempt = _retry_or_raise(attempt, retries, url, part, e)
            except (TimeoutError, urllib.error.URLError, ConnectionError, HTTPException) as e:
                attempt = _retry_or_raise(attempt, retries, url, part, e)
        got = part.stat().st_size
        if size is not None and got != size:
            raise DownloadError(f"{dest.name}: got {got} bytes, expected {size}")
        if sha is not None:
            digest = _sha256_of(part).hexdigest()
            if digest != sha:
                part.unlink()
                raise DownloadError(f"{dest.name}: SHA-256 {digest} does not match the expected {sha}; removed, "
                                    "run again")
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(part, dest)
        return dest
    finally:
        bar.close()
        for fd in lock:
            os.close(fd)


def _hold(part: Path, dest: Path) -> list[int]:
    """The fds that hold ``part`` (made if missing) locked for this process (:func:`lm.io.lock_file`;
    none where nothing can be locked): two downloads of one file had written the same ``.part`` at
    once, each truncating and appending to the other's bytes, and the loser failed with a raw "No
    such file or directory: ... .part" (faults20)."""
    try:
        fd = lock_file(part)
    except BlockingIOError:
        raise DownloadError(f"{dest.name}: another process is downloading it into {str(part)!r} now; "
                            "run again once it is done") from None
    return [] if fd is None else [fd]


_RETRY_STATUS = (408, 425, 429, 500, 502, 503, 504)  # answers that may differ on the next try


def _retry_or_raise(attempt: int, retries: int, url: str, part: Path, error: Exception) -> int:
    """Count a failed request; wait before the next one, or raise after ``retries`` of them."""
    attempt += 1
    if attempt > retries:
        reason = getattr(error, "reason", error)
        resume = f"; run again to resume from {part}" if part.is_file() and part.stat().st_size else "; run again"
        raise DownloadError(f"download of {url} failed after {retries} retries: {reason}{resume}") from None
    time.sleep(_retry_wait(attempt))
    return attempt


def _retry_wait(attempt: int) -> float:
    """Seconds to wait before try ``attempt + 1``: 0.2, 0.4, 0.8, ... up to 5."""
    return min(2.0**attempt * 0.1, 5.0)


def download_tinystories(split: str = "valid", out_dir: str | os.PathLike = "data", *,
                         base_url: str | None = None, progress: bool = True, overwrite: bool = False) -> Path:
    """Fetch TinyStoriesV2-GPT4 ``train`` (2.2 GB) or ``valid`` (22 MB) text into ``out_dir``."""
    if split not in TINYSTORIES_FILES:
        raise ValueError(f"split: {split!r} is not one of {sorted(TINYSTORIES_FILES)}")
    base = _base_url(base_url, "LM_TINYSTORIES_URL", TINYSTORIES_URL)
    name = TINYSTORIES_FILES[split]
    with _naming_env(base_url, "LM_TINYSTORIES_URL"):
        return download(f"{base}/{name}", Path(out_dir) / name, progress=progress, overwrite=overwrite)


def _base_url(base_url: str | None, variable: str, default: str) -> str:
    """The base URL: ``base_url``, else the environment variable ``variable`` (when set and not
    empty), else ``default``; one that is no http(s):// or file:// URL is a ValueError naming where it
    came from (urllib had said only "Invalid IPv6 URL" or "unknown url type: 'notaurl/train.en.gz'")."""
    source = "base_url" if base_url else variable if os.environ.get(variable) else None
    given = base_url or os.environ.get(variable) or default
    base = given.rstrip("/")
    if source is None:
        return base
    try:
        parts = urllib.parse.urlsplit(base)
        parts.port  # noqa: B018 -- a port that is not a number raises here
    except ValueError as e:
        raise ValueError(f"{source}: {given!r} is not a valid URL ({e}); give the http://, https:// or file:// URL "
                         "of the folder that holds the files") from None
    if parts.scheme not in ("http", "https", "file") or (parts.scheme != "file" and not parts.hostname):
        raise ValueError(f"{source}: {given!r} is not an http://, https:// or file:// URL; give the URL of the "
                         "folder that holds the files")
    return base


@contextlib.contextmanager
def _naming_env(base_url: str | None, variable: str):
    """Say in a download error that the URL came from the environment variable, when it did (not in an
    error of this machine's disk, which the URL is no part of); when the usual host cannot be reached,
    that the variable takes a mirror or a local copy."""
    try:
        yield
    except DownloadError as e:
        if base_url:
            raise
        if not os.environ.get(variable):
            if str(e).endswith(" (offline?)"):
                raise DownloadError(f"{str(e)[:-1]}; for a mirror or a local copy, set {variable}, e.g. "
                                    f"{variable}=file:///path/to/folder)") from None
            raise
        raise DownloadError(f"{e} (the URL is from {variable})") from None


def download_multi30k(out_dir: str | os.PathLike = "data/multi30k", *, base_url: str | None = None,
                      progress: bool = True, overwrite: bool = False) -> list[Path]:
    """Fetch Multi30k task 1 En-De (train 29,000, val 1,014, test_2016_flickr 1,000 pairs; 1.3 MB) into ``out_dir``.

    Six files, ``{train,val,test_2016_flickr}.{en,de}.gz``, from the GitHub repository
    multi30k/dataset at commit :data:`MULTI30K_COMMIT` (``LM_MULTI30K_URL`` overrides the base URL);
    each one's size and SHA-256 are checked. A complete file already there is kept; one whose
    checksum is wrong is replaced only with ``overwrite``.
    """
    base = _base_url(base_url, "LM_MULTI30K_URL", MULTI30K_URL)
    out_dir = check_out_dir(out_dir)
    for name in MULTI30K_FILES:  # all six before any is fetched
        check_download_dest(out_dir / name)
    for name, (size, sha) in MULTI30K_FILES.items():  # a file to replace: refused before any is fetched
        dest = out_dir / name
        if not overwrite and dest.is_file() and (dest.stat().st_size != size or _sha256_of(dest).hexdigest() != sha):
            other = (f"the size of {name} but another SHA-256" if dest.stat().st_size == size
                     else f"{dest.stat().st_size:,} bytes, not the {size:,} of {name}")
            raise ValueError(f"--out: {str(dest)!r} exists with {other}; "
                             "pass --overwrite to download it again")
    paths = []
    with _naming_env(base_url, "LM_MULTI30K_URL"):
        for name, (size, sha) in MULTI30K_FILES.items():  # download() replaces a wrong file only when the new is good
            paths.append(download(f"{base}/{name}", out_dir / name, expected_size=size, expected_sha256=sha,
                                  progress=progress, overwrite=overwrite))
    return paths
