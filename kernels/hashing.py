"""Content addressing: arrays as canonical blobs, and blobs named by their blake3 hash.

A blob is a fixed header followed by the array's bytes in C order, little-endian:

    magic  b"THARR1\\0\\0"         8 bytes
    dtype  e.g. b"<f4\\0"          4 bytes, one of ALLOWED_DTYPES
    ndim   uint32 LE               4 bytes, at most MAX_NDIM
    shape  uint64 LE x ndim
    data   prod(shape) * itemsize bytes

The blob's id is the hex blake3 of all of it, so two arrays share an id exactly when dtype,
shape and every byte agree; a receiver checks bytes against the id before decoding them.
"""

from __future__ import annotations

import functools
import math
import re
import struct

import numpy as np
from blake3 import blake3

from kernels.malloc import empty_bytes

MAGIC = b"THARR1\0\0"
MAX_NDIM = 4
ALLOWED_DTYPES: dict[bytes, np.dtype] = {
    b"<f4\0": np.dtype("<f4"),
    b"<f8\0": np.dtype("<f8"),
    b"<i4\0": np.dtype("<i4"),
    b"<i8\0": np.dtype("<i8"),
    b"|u1\0": np.dtype("|u1"),
}
_CODES = {dtype: code for code, dtype in ALLOWED_DTYPES.items()}
_ID = re.compile(r"[0-9a-f]{64}")


class BlobDecodeError(ValueError):
    """These bytes are not a well-formed tilehive array blob."""


class BlobMismatchError(ValueError):
    """These bytes do not hash to the id they were fetched under."""


def _canonical(x: np.ndarray) -> tuple[np.ndarray, bytes]:
    code = _CODES.get(x.dtype.newbyteorder("<"))
    if code is None:
        allowed = ", ".join(str(d) for d in ALLOWED_DTYPES.values())
        raise ValueError(f"cannot hash dtype {x.dtype}: allowed are {allowed}")
    if x.ndim > MAX_NDIM:
        raise ValueError(f"cannot hash a {x.ndim}-D array: at most {MAX_NDIM} dimensions")
    data = np.ascontiguousarray(x, dtype=ALLOWED_DTYPES[code])
    return data, _header(code, x.shape)


def _header(code: bytes, shape: tuple[int, ...]) -> bytes:
    return MAGIC + code + struct.pack(f"<I{len(shape)}Q", len(shape), *shape)


@functools.lru_cache(maxsize=256)
def _float32_header(shape: tuple[int, ...]) -> bytes:
    return _header(_CODES[np.dtype("<f4")], shape)


def is_float32_blob(blob: bytes | bytearray | memoryview, shape: tuple[int, ...]) -> bool:
    """True if `blob` is exactly the blob of a float32 array of `shape` (a tile as a report
    must carry it): its header compared as bytes, its length checked, nothing decoded
    (0.4 us for a small tile, against 1.9 for decode_array; docs/performance-history.md,
    the twenty-first round)."""
    header = _float32_header(tuple(shape))
    view = memoryview(blob).cast("B")
    return len(view) == len(header) + 4 * math.prod(shape) and view[: len(header)] == header


def encode_array(x: np.ndarray) -> bytes:
    """The canonical blob of an array (header + little-endian C-order bytes)."""
    data, header = _canonical(np.asarray(x))
    # One copy of the data (a panel is megabytes): not tobytes() and then a concatenation.
    return b"".join((header, memoryview(data).cast("B") if data.size else b""))


def array_blob(x: np.ndarray) -> memoryview:
    """encode_array(x) in a read-only buffer of its own, copied in one pass whether or not x is
    contiguous, with the GIL released: an operand panel is megabytes, and `bytes.join`
    holds the GIL for the whole copy of a memoryview (CPython drops it only for `bytes`
    items), which stalls every other thread of the process, the server's event loop among
    them, for milliseconds."""
    x = np.asarray(x)
    blob, data = blob_array(x.shape, x.dtype)  # ValueError for a dtype or rank not allowed
    np.copyto(data, x, casting="equiv")
    # Read-only, as bytes are: a store keeps it as it is instead of copying it to be safe.
    return blob.toreadonly()


def blob_array(
    shape: tuple[int, ...], dtype: np.dtype | type = np.float32
) -> tuple[memoryview, np.ndarray]:
    """A blob whose array is yet to be written: (the blob, a writable array over its data).

    A kernel writes its output straight into the blob (`out=`), so the tile is never copied
    to be encoded: for a 16 MB tile that is a copy and 4,096 fresh pages saved. In a
    volunteer a large one is in huge pages (`malloc.empty_bytes`)."""
    dtype = np.dtype(dtype)
    code = _CODES.get(dtype.newbyteorder("<"))
    if code is None or len(shape) > MAX_NDIM:
        raise ValueError(f"cannot make a blob of {dtype} {shape}")
    header = _header(code, shape)
    buffer = empty_bytes(len(header) + dtype.itemsize * math.prod(shape))
    buffer[: len(header)] = np.frombuffer(header, np.uint8)
    array = buffer[len(header) :].view(dtype.newbyteorder("<")).reshape(shape)
    return memoryview(buffer), array


def array_id(x: np.ndarray) -> str:
    """The id of encode_array(x), computed without building the blob."""
    data, header = _canonical(np.asarray(x))
    hasher = blake3(header)
    hasher.update(memoryview(data).cast("B") if data.size else b"")
    return hasher.hexdigest()


def blob_id(data: bytes | bytearray | memoryview) -> str:
    """The hex blake3 of some bytes: the name of a blob."""
    return blake3(data).hexdigest()


def is_blob_id(value: object) -> bool:
    """True for a well-formed id: 64 lowercase hex digits."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def verify_blob(data: bytes | bytearray | memoryview, expected_id: str) -> None:
    """Raise BlobMismatchError unless the bytes hash to expected_id."""
    actual = blob_id(data)
    if actual != expected_id:
        raise BlobMismatchError(
            f"blob hash mismatch: expected {expected_id}, the bytes hash to {actual}"
        )


def decode_array(
    blob: bytes | bytearray | memoryview, *, max_bytes: int | None = None
) -> np.ndarray:
    """Parse a blob into a read-only array; raise BlobDecodeError on anything malformed."""
    view = memoryview(blob).cast("B")
    if max_bytes is not None and len(view) > max_bytes:
        raise BlobDecodeError(f"blob of {len(view)} bytes exceeds the limit of {max_bytes}")
    fixed = len(MAGIC) + 8
    if len(view) < fixed or bytes(view[: len(MAGIC)]) != MAGIC:
        raise BlobDecodeError("not a tilehive array blob (bad magic)")
    code = bytes(view[len(MAGIC) : len(MAGIC) + 4])
    dtype = ALLOWED_DTYPES.get(code)
    if dtype is None:
        raise BlobDecodeError(f"unsupported dtype code {code!r}")
    (ndim,) = struct.unpack_from("<I", view, len(MAGIC) + 4)
    if ndim > MAX_NDIM:
        raise BlobDecodeError(f"{ndim} dimensions, at most {MAX_NDIM} allowed")
    if len(view) < fixed + 8 * ndim:
        raise BlobDecodeError("blob ends inside its shape")
    shape = struct.unpack_from(f"<{ndim}Q", view, fixed)
    payload = len(view) - fixed - 8 * ndim
    expected = dtype.itemsize * math.prod(shape)
    if expected != payload:
        raise BlobDecodeError(
            f"shape {tuple(shape)} of {dtype} needs {expected} data bytes, the blob has {payload}"
        )
    array = np.frombuffer(view, dtype=dtype, offset=fixed + 8 * ndim).reshape(shape)
    array.flags.writeable = False
    return array
