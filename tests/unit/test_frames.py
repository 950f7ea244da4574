"""Framed messages: msgpack with large binaries behind the document, read back as views."""

from __future__ import annotations

import msgpack
import pytest

from coordinator.work import protocol
from coordinator.work.protocol import BadRequest
from kernels import frames


def body_of(parts) -> bytearray:
    return bytearray(b"".join(bytes(part) for part in parts))


def test_a_message_round_trips_its_large_binaries_as_views_of_the_body():
    tile, panel = bytes(range(256)) * 512, b"\x07" * (frames.BIG_BINARY + 1)
    message = {"results": [{"id": "r", "tile": tile, "note": b"small"}], "blobs": {"p": panel}}
    parts = frames.pack(message)
    assert parts[1] is tile and parts[2] is panel  # sent from where they are, uncopied
    body = body_of(parts)
    got = frames.unpack(body)
    view = got["results"][0]["tile"]
    assert isinstance(view, memoryview) and view.readonly and view.obj is body
    assert bytes(view) == tile and bytes(got["blobs"]["p"]) == panel
    assert got["results"][0]["note"] == b"small"  # small binaries stay in the document


def test_fields_added_to_an_encoded_map_go_behind_it_or_stay_plain():
    document = msgpack.packb({"assignments": [], "delay": 0.0})
    panel = b"\x01" * frames.BIG_BINARY
    trailer = frames.Trailer()
    framed = frames.unpack(
        body_of(
            frames.frame(frames.extend_map(document, {"blobs": {"p": panel}}, trailer), trailer)
        )
    )
    assert framed["delay"] == 0.0 and bytes(framed["blobs"]["p"]) == panel
    plain = msgpack.unpackb(frames.extend_map(document, {"blobs": {"p": panel}}, None))
    assert plain == {"assignments": [], "delay": 0.0, "blobs": {"p": panel}}
    many = msgpack.packb({str(i): i for i in range(20)})  # a map16 header
    assert msgpack.unpackb(frames.extend_map(many, {"x": 1}, None))["x"] == 1


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"THF1", "at least 8 bytes"),
        (b"NOPE\x00\x00\x00\x00", "bad magic"),
        (b"THF1\xff\x00\x00\x00\x80", "claims 255 bytes"),
        (b"THF1\x01\x00\x00\x00\xc1", "not valid msgpack"),
        (
            b"THF1\x12\x00\x00\x00"
            + msgpack.packb(msgpack.ExtType(1, b"\x00" * 8 + b"\x05" + b"\x00" * 7)),
            "runs past",
        ),
        (
            b"THF1\x03\x00\x00\x00" + msgpack.packb(msgpack.ExtType(9, b"")),
            "unknown msgpack extension",
        ),
    ],
)
def test_malformed_frames_are_refused_with_what_is_wrong(body, words):
    with pytest.raises(frames.FrameError, match=words):
        frames.unpack(body)


def test_a_message_read_apart_gives_each_binary_memory_of_its_own():
    tile, panel = bytes(range(256)) * 512, b"\x07" * (frames.BIG_BINARY + 1)
    body = body_of(frames.pack({"tile": tile, "blobs": {"p": panel}}))
    length = frames.document_length(body[: frames.HEAD_BYTES], len(body))
    end = frames.HEAD_BYTES + length
    message, buffers = frames.unpack_apart(body[frames.HEAD_BYTES : end], len(body) - end)
    assert [len(b) for b in buffers] == [len(tile), len(panel)]  # in trailer order
    offset = end
    for buffer in buffers:  # what a reader does as the trailer arrives
        buffer[:] = body[offset : offset + len(buffer)]
        offset += len(buffer)
    assert bytes(message["tile"]) == tile and bytes(message["blobs"]["p"]) == panel
    assert message["tile"].readonly and message["tile"].obj is not message["blobs"]["p"].obj


def ref(offset: int, size: int) -> msgpack.ExtType:
    return msgpack.ExtType(frames.REF, offset.to_bytes(8, "little") + size.to_bytes(8, "little"))


@pytest.mark.parametrize(
    ("document", "trailer", "words"),
    [
        (msgpack.packb([ref(0, 4), ref(8, 4)]), 12, "at 8 where the trailer is at 4"),
        (msgpack.packb([ref(0, 4), ref(0, 4)]), 8, "at 0 where the trailer is at 4"),
        (msgpack.packb([ref(0, 4)]), 12, "fill 4 of the trailer's 12"),
        (msgpack.packb([ref(0, 1 << 40)]), 12, "runs past the body"),
    ],
)
def test_a_document_read_apart_must_lay_its_binaries_end_to_end(document, trailer, words):
    """A reader allocates each binary before its bytes arrive: a document may not claim
    more, or other, binaries than the trailer it announced holds."""
    with pytest.raises(frames.FrameError, match=words):
        frames.unpack_apart(document, trailer)


@pytest.mark.parametrize("body", [b"\xc1", b"\x91" * 2000], ids=["FormatError", "StackError"])
def test_msgpack_that_says_nothing_of_its_error_is_named_without_an_empty_detail(body):
    """They read `body is not valid msgpack: FormatError: ` (their words are empty)."""
    with pytest.raises(BadRequest) as refused:
        protocol.decode(body, 1 << 20)
    assert refused.value.message.endswith(("FormatError", "StackError"))
