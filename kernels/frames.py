"""Framed messages: a msgpack document whose large binaries travel after it, uncopied.

A tile or a panel inside a plain msgpack body is copied once into the body by the sender and
once out of it by the receiver, each copy into fresh memory (for the larger project, a
gigabyte a step each way). A framed body carries the same message with every binary of
BIG_BINARY bytes or more moved behind the document:

    magic     b"THF1"                4 bytes
    length    uint32 LE              4 bytes: the document's length
    document  msgpack                each moved binary replaced by ExtType(REF, offset, size)
    trailer   the moved binaries, one after another (offset: from the trailer's start)

The sender writes the binaries from where they are, one after another in the order the
document names them. The receiver gets each one as a read-only view of the body it read
(`unpack`), or, reading the document before the trailer, in memory of its own
(`unpack_apart`: the volunteer, so that a panel it keeps holds no other). Coordinator and
volunteer both speak it (the content type CONTENT_TYPE, docs/protocol.md) and fall back to
plain msgpack with a peer that does not.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgpack

from kernels.malloc import empty_bytes

CONTENT_TYPE = "application/x-tilehive-frames"
MAGIC = b"THF1"
BIG_BINARY = 64 << 10  # smaller binaries stay in the document: a copy there costs nothing
REF = 1  # the msgpack extension type of a moved binary
_REF = struct.Struct("<QQ")
_HEAD = struct.Struct("<4sI")
HEAD_BYTES = _HEAD.size  # magic and the document's length

Buffer = bytes | bytearray | memoryview


class FrameError(ValueError):
    """These bytes are not a well-formed framed message."""


class Trailer:
    """The binaries moved behind a document, in order: `ref` one, get its placeholder."""

    def __init__(self) -> None:
        self.parts: list[Buffer] = []
        self.size = 0

    def ref(self, data: Buffer) -> msgpack.ExtType:
        size = memoryview(data).nbytes
        placeholder = msgpack.ExtType(REF, _REF.pack(self.size, size))
        self.parts.append(data)
        self.size += size
        return placeholder

    def moved(self, value: Any) -> Any:
        """`value` with each large binary in it replaced by a reference to the trailer (maps
        and lists are walked; the rest is left as it is)."""
        if isinstance(value, bytes | bytearray | memoryview):
            return self.ref(value) if memoryview(value).nbytes >= BIG_BINARY else value
        if isinstance(value, dict):
            return {k: self.moved(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.moved(v) for v in value]
        return value


def body_buffer(size: int) -> memoryview:
    """A writable buffer of `size` bytes for a body about to be read into it, left as the
    allocator gives it: `bytearray(size)` first writes zeros over all of it, a pass over
    every byte that the body then overwrites. In a volunteer a large one is in huge pages
    (`malloc.empty_bytes`)."""
    return memoryview(empty_bytes(size))


def frame(document: bytes, trailer: Trailer) -> list[Buffer]:
    """The body of a framed message from its encoded document and its trailer, as buffers
    to send one after another (the binaries are not copied)."""
    return [_HEAD.pack(MAGIC, len(document)) + document, *trailer.parts]


def pack(message: Any) -> list[Buffer]:
    """`message` framed, as buffers (their sum is the body)."""
    trailer = Trailer()
    document = msgpack.packb(trailer.moved(message), use_bin_type=True)
    return frame(document, trailer)


def unpack(body: Buffer) -> Any:
    """The message in a framed body, its moved binaries as read-only views of `body`.
    FrameError when the bytes are not a well-formed frame."""
    view = memoryview(body).cast("B").toreadonly()
    end = HEAD_BYTES + document_length(view, len(view))
    trailer = view[end:]

    def moved(code: int, data: bytes) -> memoryview:
        if code != REF or len(data) != _REF.size:
            raise FrameError(f"unknown msgpack extension {code}")
        offset, size = _REF.unpack(data)
        if offset + size > len(trailer):
            raise FrameError(f"a binary of {size} bytes at {offset} runs past the body")
        return trailer[offset : offset + size]

    return _unpack_document(view[HEAD_BYTES:end], moved)


def _unpack_document(document: Buffer, moved: Callable[[int, bytes], Any]) -> Any:
    try:
        return msgpack.unpackb(document, raw=False, strict_map_key=True, ext_hook=moved)
    except FrameError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise FrameError(f"the document is not valid msgpack: {msgpack_failure(exc)}") from exc


def msgpack_failure(exc: Exception) -> str:
    """What msgpack said of bad input: its error's name, and its words where it has any
    (a FormatError or a StackError has none)."""
    said = str(exc)
    return f"{type(exc).__name__}: {said}" if said else type(exc).__name__


def document_length(head: Buffer, body_size: int) -> int:
    """The document's length from the first HEAD_BYTES of a framed body of `body_size`
    bytes; FrameError if they are no frame's head or the document overruns the body."""
    if body_size < HEAD_BYTES or len(head) < HEAD_BYTES:
        raise FrameError(f"a framed body needs at least {HEAD_BYTES} bytes")
    magic, length = _HEAD.unpack_from(head)
    if magic != MAGIC:
        raise FrameError("not a framed message (bad magic)")
    if HEAD_BYTES + length > body_size:
        raise FrameError(f"the document claims {length} bytes, the body holds {body_size}")
    return length


def unpack_apart(document: Buffer, trailer_size: int) -> tuple[Any, list[memoryview]]:
    """The message of a framed body whose trailer is still to be read, each moved binary
    in memory of its own: (the message, with read-only views of them; the writable buffers,
    in trailer order, to read the trailer into). A binary kept from such a message holds
    only its own bytes, where a view of a whole body would hold every other binary in it.
    FrameError unless the binaries fill the trailer exactly, one after another, as
    `pack` lays them out (so a lying document cannot make the reader allocate more than
    the body it announced)."""
    buffers: list[memoryview] = []
    filled = 0

    def moved(code: int, data: bytes) -> memoryview:
        nonlocal filled
        if code != REF or len(data) != _REF.size:
            raise FrameError(f"unknown msgpack extension {code}")
        offset, size = _REF.unpack(data)
        if offset != filled:
            raise FrameError(f"a binary at {offset} where the trailer is at {filled}")
        if offset + size > trailer_size:
            raise FrameError(f"a binary of {size} bytes at {offset} runs past the body")
        filled += size
        buffer = body_buffer(size)
        buffers.append(buffer)
        return buffer.toreadonly()

    message = _unpack_document(document, moved)
    if filled != trailer_size:
        raise FrameError(f"the binaries fill {filled} of the trailer's {trailer_size} bytes")
    return message, buffers


def extend_map(document: bytes, fields: dict[str, Any], trailer: Trailer | None) -> bytes:
    """An encoded msgpack map with more fields, without decoding it: the fields' large
    binaries go to `trailer` (None: they stay in the document, for a plain msgpack body)."""
    if not fields:
        return document
    first = document[0]
    if 0x80 <= first <= 0x8F:
        count, rest = first & 0x0F, document[1:]
    elif first == 0xDE:
        count, rest = struct.unpack_from(">H", document, 1)[0], document[3:]
    elif first == 0xDF:
        count, rest = struct.unpack_from(">I", document, 1)[0], document[5:]
    else:
        raise ValueError("not an encoded msgpack map")
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_map_header(count + len(fields)), rest]
    for key, value in fields.items():
        value = trailer.moved(value) if trailer is not None else value
        parts += (packer.pack(key), packer.pack(value))
    return b"".join(parts)
