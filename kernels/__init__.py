"""Deterministic compute for tilehive: the GEMM kernel, its numpy twin, content hashing, and
the framed messages that carry blobs uncopied (kernels/frames.py)."""

from kernels.gemm import batched_gemm, gemm, kernel_name
from kernels.hashing import (
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

# Part of every work unit's id: bump it whenever a kernel could return different bits.
KERNEL_VERSION = 1

__all__ = [
    "KERNEL_VERSION",
    "BlobDecodeError",
    "BlobMismatchError",
    "array_blob",
    "array_id",
    "batched_gemm",
    "blob_array",
    "blob_id",
    "decode_array",
    "encode_array",
    "gemm",
    "is_blob_id",
    "is_float32_blob",
    "kernel_name",
    "verify_blob",
]
