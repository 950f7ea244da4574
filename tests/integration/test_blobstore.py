"""The blob store: blobs are whole or absent, named by their hash, written in batches."""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

import kernels
from coordinator.state import blobs as blobs_module
from coordinator.state.blobs import DIRECT_BYTES, DIRECT_CHUNK, BlobNotFound, BlobStore
from tests.factories import running


def tiles(count: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [
        kernels.encode_array(rng.standard_normal((16, 8)).astype(np.float32)) for _ in range(count)
    ]


def test_a_batch_of_blobs_is_stored_under_their_hashes_and_read_back_whole(tmp_path):
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    blobs = tiles(20)
    ids = store.put_many([(data, None) for data in blobs] + [(blobs[0], None)])
    assert ids == [kernels.blob_id(data) for data in blobs] + [kernels.blob_id(blobs[0])]
    assert [store.get(blob) for blob in ids[:20]] == blobs
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # no temporary file left behind
    # Storing them again changes nothing; a blob under the wrong name is refused.
    assert store.put_many([(blobs[1], ids[1])]) == [ids[1]]
    with pytest.raises(ValueError):
        store.put_many([(blobs[1], ids[2])])


def test_a_batch_that_fails_part_way_leaves_whole_blobs_or_none(tmp_path, monkeypatch):
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    blobs = tiles(6, seed=1)
    first = store.put(blobs[0])
    renamed = []

    def replace_then_fail(src, dst):  # the disk fills up after the third rename
        if len(renamed) == 3:
            raise OSError(28, "No space left on device")
        renamed.append(Path(dst))
        os.rename(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_fail)
    with pytest.raises(OSError, match="No space left"):
        store.put_many([(data, None) for data in blobs[1:]])
    monkeypatch.undo()
    assert store.get(first) == blobs[0]
    # What was renamed before the failure is whole; the rest is absent, and no temporary
    # file is left.
    for data in blobs[1:]:
        blob = kernels.blob_id(data)
        if store.path(blob) in renamed:
            assert store.get(blob) == data
        else:
            with pytest.raises(BlobNotFound):
                store.get(blob)
    assert not list(tmp_path.rglob(".tmp-*"))


def test_blobs_written_behind_are_readable_at_once_and_reach_the_disk(tmp_path, monkeypatch):
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20, behind_bytes=0)  # none held back
    blobs = tiles(8, seed=2)
    real_write = BlobStore._write
    failing = [True]

    def write(self, blob, data):  # the disk is full until the test frees it
        if failing[0]:
            raise OSError(28, "No space left on device")
        real_write(self, blob, data)

    monkeypatch.setattr(BlobStore, "_write", write)
    ids = store.put_many([(data, None) for data in blobs[:4]], behind=True)
    # Readable at once, from memory, whatever the disk does.
    assert [store.get(blob) for blob in ids] == blobs[:4] and all(map(store.has, ids))
    deadline = time.monotonic() + 30
    while store.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the writer's state, with a deadline
    assert isinstance(store.failure, OSError)  # the writer met the fault: nothing is lost...
    assert all(map(store.has, ids))
    with pytest.raises(OSError, match="No space left"):  # ...and new blobs wait for it
        store.put_many([(blobs[4], None)], behind=True)
    failing[0] = False
    assert store.drain(timeout=30)  # the writer tries again every WRITE_RETRY seconds
    assert store.failure is None
    store.put_many([(data, None) for data in blobs[4:]], behind=True)
    store.delete(ids[0])
    store.close()
    # On disk, read back and checked against their ids, except the one deleted.
    fresh = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    assert [fresh.get(kernels.blob_id(data)) for data in blobs[1:]] == blobs[1:]
    with pytest.raises(BlobNotFound):
        fresh.get(ids[0])


def test_blobs_are_held_in_memory_until_more_wait_than_it_allows(tmp_path, monkeypatch):
    """Write-back: a blob deleted while held is never written; the oldest are written once
    more than `behind_bytes` waits; a clean close writes the rest."""
    written: list[str] = []
    real_write = BlobStore._write

    def write(self, blob, data):
        written.append(blob)
        real_write(self, blob, data)

    monkeypatch.setattr(BlobStore, "_write", write)
    size = len(tiles(1)[0])
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20, behind_bytes=3 * size)
    blobs = tiles(5, seed=3)
    ids = store.put_many([(data, None) for data in blobs[:3]], behind=True)
    store.delete(ids[0])  # a checkpoint let it go before it was ever written
    assert [store.get(blob) for blob in ids[1:]] == blobs[1:3]
    assert not store._write_due() and written == []  # two held, within the limit
    more = store.put_many([(data, None) for data in blobs[3:]], behind=True)  # 4 held: 1 over
    deadline = time.monotonic() + 30
    while store._write_due() and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the writer's work, with a deadline
    assert written == [ids[1]]  # the oldest went to disk, the newer stay in memory
    assert [store.get(blob) for blob in ids[1:] + more] == blobs[1:]
    store.close()
    assert ids[0] not in written and sorted(written) == sorted(ids[1:] + more)
    fresh = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    assert [fresh.get(blob) for blob in ids[1:] + more] == blobs[1:]


def test_a_disk_fault_stops_blocking_once_what_it_refused_is_deleted(tmp_path, monkeypatch):
    """Blobs the disk refused, deleted by a checkpoint before the disk came back, leave
    nothing waiting for it: new blobs are taken again."""

    def write(self, blob, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(BlobStore, "_write", write)
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20, behind_bytes=0)
    blobs = tiles(2, seed=4)
    (refused,) = store.put_many([(blobs[0], None)], behind=True)
    deadline = time.monotonic() + 30
    while store.failure is None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the writer's state, with a deadline
    with pytest.raises(OSError, match="No space left"):
        store.put_many([(blobs[1], None)], behind=True)
    store.delete(refused)
    assert store.failure is None
    (taken,) = store.put_many([(blobs[1], None)], behind=True)
    assert store.get(taken) == blobs[1]
    store.close(timeout=0)


def test_a_disk_that_will_not_delete_leaves_blobs_behind_and_stops_nothing(
    tmp_path, monkeypatch, caplog
):
    """A disk that refuses to delete (remounted read-only, a folder made immutable) fails no
    caller: the blob a finished product lets go of stays on disk, where the chaos test saw
    the refusal stop training. The operator hears it once; the files refused go at the
    first delete the disk allows again, but not one stored again meanwhile."""
    monkeypatch.setattr(blobs_module, "DELETE_RETRY", 0.0)  # the first delete that works
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    data = tiles(5, seed=5)
    ids = store.put_many([(d, None) for d in data[:3]], hold=True)
    refusing = True
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if refusing and str(path).startswith(str(tmp_path)):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    stored_again, held_again = store.put(data[3]), store.put(data[4])
    with caplog.at_level(logging.WARNING, logger="coordinator.state.blobs"):
        store.release(ids[:1])  # a finished product lets go of its panel
        store.delete(ids[1])  # a checkpoint deletes the blobs before it
        store.delete(stored_again)
        store.delete(held_again)
    assert all(store.path(blob).exists() for blob in [*ids, stored_again, held_again])
    assert len([r for r in caplog.records if "cannot delete" in r.getMessage()]) == 1
    assert store.put(data[3]) == stored_again  # a new product's panel, the same bytes
    store.hold([held_again])  # a product made before, asked for again, reads its blobs
    refusing = False
    store.delete(ids[2])
    assert not any(store.path(blob).exists() for blob in ids)
    assert store.get(stored_again) == data[3]
    assert store.get(held_again) == data[4]
    store.close(timeout=0)


def direct_writes(monkeypatch) -> list[int]:
    """Sizes of the blobs written through write_direct, as they are written."""
    calls: list[int] = []
    real = blobs_module.write_direct

    def counted(fd, view):
        calls.append(len(view))
        real(fd, view)

    monkeypatch.setattr(blobs_module, "write_direct", counted)
    return calls


@pytest.mark.parametrize("extra", [1, 4096, DIRECT_CHUNK + 5])
def test_a_large_blob_written_around_the_page_cache_reads_back_whole(tmp_path, monkeypatch, extra):
    """O_DIRECT writes whole aligned blocks: the last is padded and the file cut back to
    the blob's length, whatever that is."""
    calls = direct_writes(monkeypatch)
    store = BlobStore(tmp_path, max_blob_bytes=64 << 20, behind_bytes=0)
    data = os.urandom(DIRECT_BYTES + extra)
    blob = store.put(data)
    if not store.direct:
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    assert calls == [len(data)]
    assert store.path(blob).stat().st_size == len(data)
    assert BlobStore(tmp_path, max_blob_bytes=64 << 20).get(blob) == data


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    refused: list[int] = []

    def refuse(fd, view):
        refused.append(len(view))
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(blobs_module, "write_direct", refuse)
    store = BlobStore(tmp_path, max_blob_bytes=64 << 20)
    data = os.urandom(DIRECT_BYTES + 7)
    blob = store.put(data)
    assert not store.direct  # asked once, then never again
    assert len(refused) <= 1  # tried once, unless open() refused O_DIRECT already
    assert not list(tmp_path.rglob(".tmp-*"))
    assert BlobStore(tmp_path, max_blob_bytes=64 << 20).get(blob) == data


def test_the_temporary_files_of_writes_a_kill_cut_short_are_swept_and_blobs_kept(tmp_path):
    store = BlobStore(tmp_path / "blobs", max_blob_bytes=1 << 20)
    kept = store.put_many([(blob, None) for blob in tiles(3)])
    folder = store.path(kept[0]).parent
    # What a kill leaves: the temporary files of writes it cut short.
    (folder / ".tmp-abc123").write_bytes(b"half a tile")
    (store.root / ".tmp-0123456789abcdef-42").write_bytes(b"")
    assert store.sweep_temporary() == 2
    assert sorted(p.name for p in store.root.rglob(".tmp-*")) == []
    assert all(store.get(blob) is not None for blob in kept)


async def test_a_coordinator_starting_sweeps_what_a_kill_left_in_its_blob_store(tmp_path):
    leftover = tmp_path / "project" / "blobs" / "ab" / ".tmp-abcdef0123456789-7"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"a tile cut short")
    async with running(tmp_path) as (co, _queue, _url):
        assert not leftover.exists()
        assert co.blobs.root == leftover.parent.parent


def test_a_held_blob_leaves_memory_when_its_last_holder_lets_go(tmp_path):
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    shared, own = tiles(2, seed=3)
    ids = store.put_many([(shared, None), (own, None)], keep=True, behind=True, hold=True)
    store.put_many([(shared, None)], keep=True, behind=True, hold=True)  # a second product
    store.release(ids)  # the first product is done
    assert store.in_memory(ids[0]) == shared  # the second still reads it
    assert store.in_memory(ids[1]) is None and not store.has(ids[1])
    assert store.released(ids[1]) and not store.released(ids[0])
    store.release(ids[:1])
    assert store.in_memory(ids[0]) is None and store.released(ids[0])
    # Stored again (a later product with the same panel): served, no longer "released".
    store.put_many([(shared, None)], keep=True, behind=True, hold=True)
    assert store.get(ids[0]) == shared and not store.released(ids[0])
    assert not list(tmp_path.rglob("*/*"))  # none of them was ever written


def test_a_hold_on_a_blob_the_disk_refused_is_not_kept(tmp_path, monkeypatch):
    store = BlobStore(tmp_path, max_blob_bytes=1 << 20)
    (data,) = tiles(1, seed=4)

    def refuse(_blob, _data):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(store, "_write", refuse)
    with pytest.raises(OSError):
        store.put_many([(data, None)], hold=True)
    monkeypatch.undo()
    blob = store.put(data, hold=True)
    store.release([blob])  # one hold, one release: gone
    assert not store.has(blob) and store.in_memory(blob) is None
