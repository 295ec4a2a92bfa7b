"""The one downloader of deqsm: locating data files under ``data.root``, fetching missing ones.

Every data set (UCI, MNIST, CIFAR-10; CelebA only to locate its files) describes its files as
:class:`RemoteFile` specs. A file is looked for at ``<root>/<subdir>/<filename>``, then in the spec's
``extra_dirs``, then at ``<root>/<filename>`` (under each of its names). When it is in none of these places
and ``download=True`` it is fetched with :mod:`urllib` from its URL, then from each mirror in turn, into a
temporary file next to its destination and renamed into place with :func:`os.replace` only once complete
and, where a checksum is known, md5-verified: a crash or a failed transfer never leaves a truncated file
behind that a later run would trust. Every failure (no network, HTTP error, checksum mismatch,
``download=False``, or a file with no programmatic download) ends in a :class:`FileNotFoundError` whose
message names the file, the places searched, every URL tried and why it failed, and what to do about it.

The network is never needed to test this: the opener is the module attribute :data:`_urlopen`, which tests
replace.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from src.runtime.atomic import atomic_file

log = logging.getLogger(__name__)

# the opener the downloader uses; tests replace it (the network is never needed to test this module)
_urlopen = urllib.request.urlopen
DOWNLOAD_TIMEOUT_S = 60.0
_CHUNK = 1 << 16


@dataclass(frozen=True)
class RemoteFile:
    """A data file: where it lives under the data root, where it comes from, and its md5 (if known).

    ``url`` is the original source, ``mirrors`` further URLs tried in order when it fails; ``url=None``
    marks a file with no programmatic download, to be fetched by hand from ``page``. ``extra_dirs`` are
    further folders (relative to the root) searched after ``subdir``, and ``alt_names`` further names of the
    same file (e.g. the uncompressed form of a ``.gz``).
    """

    filename: str
    subdir: str
    url: str | None
    md5: str | None = None
    mirrors: tuple[str, ...] = ()
    extra_dirs: tuple[str, ...] = ()
    alt_names: tuple[str, ...] = ()
    page: str | None = None

    @property
    def urls(self) -> tuple[str, ...]:
        """Every download URL, in the order tried (empty when the file cannot be downloaded)."""
        return (self.url, *self.mirrors) if self.url else tuple(self.mirrors)

    def candidates(self, root: str | os.PathLike) -> list[Path]:
        """The paths searched, in order: each folder (``subdir``, ``extra_dirs``, then ``root`` itself), each
        name (``filename``, then ``alt_names``)."""
        root = Path(root).expanduser()
        folders = [root / d for d in (self.subdir, *self.extra_dirs) if d] + [root]
        return [folder / name for folder in folders for name in (self.filename, *self.alt_names)]

    def destination(self, root: str | os.PathLike) -> Path:
        """Where a download is written: ``root/subdir/filename``."""
        return self.candidates(root)[0]


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
    digest, size = hashlib.md5(usedforsecurity=False), 0
    with atomic_file(dest, suffix=".part", fsync=True) as out:
        with _urlopen(url, timeout=timeout) as response:
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
        if size == 0:
            raise OSError(f"empty response from {url}")
        if md5 is not None and digest.hexdigest() != md5:
            raise OSError(f"md5 mismatch for {url}: expected {md5}, got {digest.hexdigest()} ({size} bytes)")
    log.info("downloaded %s -> %s", url, dest)
    return dest


def _missing_message(spec: RemoteFile, root: str | os.PathLike, reason: str) -> str:
    searched = ", ".join(str(p) for p in spec.candidates(root))
    if spec.urls:
        mirrors = f" (mirrors: {', '.join(spec.urls[1:])})" if len(spec.urls) > 1 else ""
        source = f"It is downloaded from {spec.urls[0]}{mirrors}."
    else:
        source = "It has no programmatic download" + (f": get it from {spec.page}." if spec.page else ".")
    return (
        f"data file '{spec.filename}' not found (searched: {searched}); {reason}. {source} "
        f"Place the file at {spec.destination(root)} (or directly in {Path(root).expanduser()}), "
        "or set data.root to the folder that holds it."
    )


def ensure_file(
    spec: RemoteFile, root: str | os.PathLike, download: bool = True, timeout: float = DOWNLOAD_TIMEOUT_S
) -> Path:
    """The path of ``spec`` under ``root``, downloading it first when missing and ``download`` is set.

    The URLs of ``spec`` are tried in order until one delivers the file (with the right md5, if known).
    Raises :class:`FileNotFoundError` (with the file, the paths searched, every URL tried and why it failed,
    and the remedy in the message) when the file is missing and cannot be downloaded.
    """
    found = find_file(spec, root)
    if found is not None:
        return found
    if not spec.urls:
        raise FileNotFoundError(_missing_message(spec, root, "it must be downloaded by hand"))
    if not download:
        raise FileNotFoundError(_missing_message(spec, root, "download=False, so it was not downloaded"))
    dest = spec.destination(root)
    failures = []
    for url in spec.urls:
        log.info("%s not found under %s; downloading %s", spec.filename, root, url)
        try:
            return download_file(url, dest, md5=spec.md5, timeout=timeout)
        except (OSError, ValueError, http.client.HTTPException) as err:  # URLError, HTTPError, timeouts: OSError
            failures.append(f"{url}: {type(err).__name__}: {err}")
    raise FileNotFoundError(_missing_message(spec, root, "downloading it failed (" + "; ".join(failures) + ")"))
