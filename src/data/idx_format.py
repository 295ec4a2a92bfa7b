"""The IDX file format of the original MNIST files (LeCun et al.): read and write, gzipped or not."""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np
import torch

# IDX type codes -> big-endian numpy dtypes
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


_IDX_CODES = {np.dtype(v).newbyteorder("=").str: k for k, v in _IDX_DTYPES.items()}


class IDXFormatError(ValueError):
    """An IDX file that is not one, or is truncated/corrupt (the message names the file)."""


def read_idx(path: str | os.PathLike) -> torch.Tensor:
    """Read an IDX file (gzipped or raw, detected from the content) into a tensor of its shape and type.

    Raises :class:`IDXFormatError` naming the file when it is not valid gzip, its magic number is wrong, or
    its payload does not match the header's dimensions.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise IDXFormatError(
            f"{path}: corrupt or truncated gzip file ({exc}). Delete it and download it again "
            "(or copy a verified one)."
        ) from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES or data[3] < 1:
        raise IDXFormatError(
            f"{path}: not an IDX file (magic number {data[:4].hex() or 'missing'}; expected 0000 followed by "
            "a type code in {08,09,0b,0c,0d,0e} and the number of dimensions). Delete it and download it again."
        )
    dtype = np.dtype(_IDX_DTYPES[data[2]])
    ndim = data[3]
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IDXFormatError(f"{path}: truncated IDX file: the header of {ndim} dimensions is incomplete.")
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    found = len(data) - header
    if found != expected:
        raise IDXFormatError(
            f"{path}: truncated or corrupt IDX file: the header says shape {dims} ({expected} bytes of "
            f"{dtype.name}), the file holds {found}. Delete it and download it again."
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(dims)
    return torch.from_numpy(array.astype(dtype.newbyteorder("="), copy=True))


def write_idx(path: str | os.PathLike, tensor: torch.Tensor | np.ndarray, compress: bool | None = None) -> Path:
    """Write an array as an IDX file (gzipped when ``compress`` or the name ends in ``.gz``)."""
    path = Path(path)
    array = np.ascontiguousarray(tensor.numpy() if isinstance(tensor, torch.Tensor) else tensor)
    code = _IDX_CODES.get(array.dtype.newbyteorder("=").str)
    if code is None:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    body = (bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
            + array.astype(_IDX_DTYPES[code]).tobytes())
    if compress if compress is not None else path.suffix == ".gz":
        body = gzip.compress(body, compresslevel=1)
    path.write_bytes(body)
    return path
