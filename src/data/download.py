"""Locating data files under ``data.root``, and fetching missing ones from their original source.

A file ``<subdir>/<filename>`` is looked for at ``<root>/<subdir>/<filename>`` (the layout of the shared
data folder) and then at ``<root>/<filename>``. When it is in neither place and ``download=True`` it is
fetched with :mod:`urllib` into a temporary file next to its destination and renamed into place with
:func:`os.replace` only once complete (and, where a checksum is known, verified): a crash or a failed
transfer never leaves a truncated file behind that a later run would trust. Every failure (no network,
HTTP error, checksum mismatch, or ``download=False``) ends in a :class:`FileNotFoundError` whose message
names the file, the places searched, the URL, and what to do about it.

The network is never needed to test this: the opener is the module attribute :data:`_urlopen`, which tests
replace.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# the opener the downloader uses; tests replace it (the network is never needed to test this module)
_urlopen = urllib.request.urlopen
DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 16


@dataclass(frozen=True)
class RemoteFile:
    """A data file: where it lives under the data root, where it comes from, and its md5 (if known)."""

    filename: str
    subdir: str
    url: str
    md5: str | None = None

    def candidates(self, root: str | os.PathLike) -> list[Path]:
        """The paths searched, in order: ``root/subdir/filename``, then ``root/filename``."""
        root = Path(root).expanduser()
        return [root / self.subdir / self.filename, root / self.filename]

    def destination(self, root: str | os.PathLike) -> Path:
        """Where a download is written: ``root/subdir/filename``."""
        return self.candidates(root)[0]


def md5sum(path: str | os.PathLike) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def find_file(spec: RemoteFile, root: str | os.PathLike) -> Path | None:
    """The first existing candidate path of ``spec`` under ``root``, or None."""
    for path in spec.candidates(root):
        if path.is_file():
            return path
    return None


def download_file(
    url: str, dest: str | os.PathLike, md5: str | None = None, timeout: float = DOWNLOAD_TIMEOUT_S
) -> Path:
    """Fetch ``url`` to ``dest`` atomically (temp file in the same folder, then :func:`os.replace`).

    Raises :class:`OSError` (``urllib.error.URLError`` is one) on a network failure and :class:`IOError`
    on an empty body or an md5 mismatch; in every failure case ``dest`` is left untouched and the temporary
    file is removed.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, _urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, out, _CHUNK)
            out.flush()
            os.fsync(out.fileno())
        size = tmp.stat().st_size
        if size == 0:
            raise OSError(f"empty response from {url}")
        if md5 is not None:
            got = md5sum(tmp)
            if got != md5:
                raise OSError(f"md5 mismatch for {url}: expected {md5}, got {got} ({size} bytes)")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log.info("downloaded %s -> %s", url, dest)
    return dest


def _missing_message(spec: RemoteFile, root: str | os.PathLike, reason: str) -> str:
    searched = ", ".join(str(p) for p in spec.candidates(root))
    return (
        f"data file '{spec.filename}' not found (searched: {searched}); {reason}. "
        f"Its original source is {spec.url}. Place the file at {spec.destination(root)} (or directly in "
        f"{Path(root).expanduser()}), or set data.root to the folder that holds it "
        f"(e.g. data.root=../shared/data)."
    )


def ensure_file(
    spec: RemoteFile, root: str | os.PathLike, download: bool = True, timeout: float = DOWNLOAD_TIMEOUT_S
) -> Path:
    """The path of ``spec`` under ``root``, downloading it first when missing and ``download`` is set.

    Raises :class:`FileNotFoundError` (with the file, the paths searched, the URL and the remedy in the
    message) when the file is missing and cannot be downloaded.
    """
    found = find_file(spec, root)
    if found is not None:
        return found
    if not download:
        raise FileNotFoundError(_missing_message(spec, root, "download=False, so it was not downloaded"))
    dest = spec.destination(root)
    log.info("%s not found under %s; downloading %s", spec.filename, root, spec.url)
    try:
        return download_file(spec.url, dest, md5=spec.md5, timeout=timeout)
    except (OSError, ValueError, http.client.HTTPException) as err:  # URLError, HTTPError, timeouts: OSError
        raise FileNotFoundError(
            _missing_message(spec, root, f"downloading it failed ({type(err).__name__}: {err})")
        ) from err
