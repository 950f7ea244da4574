"""Content hashing: canonical blobs, their ids, and decoding untrusted bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kernels import (
    BlobDecodeError,
    BlobMismatchError,
    array_blob,
    array_id,
    blob_array,
    blob_id,
    decode_array,
    encode_array,
    is_blob_id,
    is_float32_blob,
    verify_blob,
)
from kernels.hashing import MAGIC


@pytest.fixture
def x(rng) -> np.ndarray:
    return rng.standard_normal((5, 7)).astype(np.float32)


def test_same_array_same_id_and_id_is_the_blob_hash(x):
    assert array_id(x) == array_id(x.copy())
    assert array_id(x) == blob_id(encode_array(x))
    assert is_blob_id(array_id(x))


def test_layout_does_not_change_the_id(x):
    fortran = np.asfortranarray(x)
    big_endian = x.astype(">f4")
    assert array_id(fortran) == array_id(x)
    assert array_id(big_endian) == array_id(x)
    assert array_id(x.T) == array_id(np.ascontiguousarray(x.T))


def test_any_byte_shape_or_dtype_change_changes_the_id(x):
    original = array_id(x)
    raw = x.view(np.uint8).reshape(-1)
    for position in (0, 1, raw.size // 2, raw.size - 1):
        changed = raw.copy()
        changed[position] ^= 1
        assert array_id(changed.view(np.float32).reshape(x.shape)) != original
    assert array_id(x.reshape(7, 5)) != original
    assert array_id(x.reshape(35)) != original
    assert array_id(x.view(np.int32)) != original
    assert array_id(np.zeros((0, 3), np.float32)) != array_id(np.zeros((3, 0), np.float32))


def test_an_array_blob_is_the_encoded_blob_whatever_the_layout(x):
    """A panel is a strided view of its operand; its blob must be the canonical bytes that
    its id names, however it was laid out."""
    for view in (x, x[:, 2:5], x.T, np.asfortranarray(x), x.astype(">f4"), x[:0]):
        assert bytes(array_blob(view)) == encode_array(view)
        assert blob_id(array_blob(view)) == array_id(view)
    assert array_blob(x).readonly
    with pytest.raises(ValueError):
        array_blob(x.astype(np.float16))
    with pytest.raises(ValueError):
        array_blob(np.zeros((1,) * 9, np.float32))


def test_decode_round_trips_and_is_read_only(x):
    decoded = decode_array(encode_array(x))
    assert decoded.dtype == np.float32 and decoded.shape == x.shape
    assert np.array_equal(decoded.view(np.uint32), x.view(np.uint32))
    assert not decoded.flags.writeable


def test_verify_blob_accepts_the_right_bytes_and_names_the_mismatch(x):
    blob = encode_array(x)
    verify_blob(blob, blob_id(blob))
    tampered = bytearray(blob)
    tampered[-1] ^= 0x80
    with pytest.raises(BlobMismatchError, match="hash mismatch"):
        verify_blob(bytes(tampered), blob_id(blob))


def _header(code: bytes, shape: tuple[int, ...]) -> bytes:
    return MAGIC + code + struct.pack(f"<I{len(shape)}Q", len(shape), *shape)


MALFORMED = [
    (b"", "bad magic"),
    (b"NOTARRAY" + bytes(20), "bad magic"),
    (_header(b"<c8\0", (2,)) + bytes(32), "unsupported dtype"),
    (MAGIC + b"<f4\0" + struct.pack("<I", 9), "dimensions"),
    (MAGIC + b"<f4\0" + struct.pack("<I", 2) + bytes(8), "ends inside its shape"),
    (_header(b"<f4\0", (2, 3)) + bytes(23), "needs 24 data bytes"),
    (_header(b"<f4\0", (2, 3)) + bytes(25), "needs 24 data bytes"),
    (_header(b"<f4\0", (2**62, 2**62)) + bytes(8), "data bytes"),
]


@pytest.mark.parametrize(("blob", "message"), MALFORMED)
def test_malformed_blobs_raise_a_decode_error(blob, message):
    with pytest.raises(BlobDecodeError, match=message):
        decode_array(blob)


def test_a_float32_blob_of_a_shape_is_exactly_what_decodes_to_it(x):
    """The report's fast check of a tile agrees with decoding it, for every malformed blob
    above and for well-formed blobs of another shape or dtype."""
    assert is_float32_blob(encode_array(x), x.shape)
    others = [encode_array(x.T), encode_array(x.astype(np.float64)), encode_array(x[:, :6])]
    for blob in [b for b, _ in MALFORMED] + others + [encode_array(x) + b"\0"]:
        assert not is_float32_blob(blob, x.shape)


def test_decode_enforces_a_size_limit(x):
    blob = encode_array(x)
    with pytest.raises(BlobDecodeError, match="exceeds the limit"):
        decode_array(blob, max_bytes=len(blob) - 1)
    assert decode_array(blob, max_bytes=len(blob)).shape == x.shape


def test_unsupported_arrays_are_refused_clearly():
    with pytest.raises(ValueError, match="cannot hash dtype"):
        array_id(np.ones(3, np.complex64))
    with pytest.raises(ValueError, match="dimensions"):
        array_id(np.ones((1,) * 5, np.float32))


@pytest.mark.parametrize("value", ["", "ab", "G" * 64, "A" * 64, 7, None, "0" * 65])
def test_is_blob_id_rejects_anything_but_64_lowercase_hex_digits(value):
    assert not is_blob_id(value)


@pytest.mark.parametrize("shape", [(3, 5), (0, 4), (7,), (2, 3, 4)])
def test_an_array_written_into_its_blob_is_the_blob_of_that_array(shape):
    rng = np.random.default_rng(0)
    values = rng.standard_normal(shape).astype(np.float32)
    blob, array = blob_array(shape, np.float32)
    array[...] = values  # as the kernel writes its output (out=)
    assert bytes(blob) == encode_array(values)
    assert np.array_equal(decode_array(blob), values)
    with pytest.raises(ValueError):
        blob_array((2, 2), np.complex64)
