"""Content-addressed blobs on disk: operand panels and output tiles, named by blake3."""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kernels import blob_id, decode_array, encode_array, is_blob_id, verify_blob

log = logging.getLogger(__name__)

WRITE_RETRY = 1.0  # seconds between attempts of a writer that met a disk error
# Seconds between attempts at the files a disk would not delete: at most one pass over them
# so often, whatever the number of deletes meanwhile (a disk that refuses some folders only
# would otherwise cost every delete a failing call for each file it keeps).
DELETE_RETRY = 5.0
# How far the writer may fall behind (beyond the blobs held in memory) before whoever
# stores a blob waits for it: a disk slower than the network.
WRITE_BACKLOG = 256 << 20
# Blobs this large are written around the page cache (O_DIRECT), through an aligned buffer
# of DIRECT_CHUNK: nobody reads a written blob soon (it is written when it is the oldest in
# memory), and copying it into the page cache cost 3 CPU-seconds a gigabyte on the
# reference machine, against 0.25 through the buffer (benchmarks/blob_writes.py).
DIRECT_BYTES = 1 << 20
DIRECT_CHUNK = 8 << 20
DIRECT_ALIGN = 4096  # O_DIRECT's alignment of memory, offsets and lengths
RELEASED_KEPT = 1 << 16  # ids of blobs let go of, remembered to answer fetches of them
_direct_buffers = threading.local()


def write_direct(fd: int, view: memoryview) -> None:
    """All of `view` to `fd` (opened with O_DIRECT): copied a chunk at a time into this
    thread's page-aligned buffer, the last chunk padded with zeros, the file then cut to
    its length. OSError(EINVAL) where the file system does not take it."""
    buffer = getattr(_direct_buffers, "buffer", None)
    if buffer is None:
        buffer = _direct_buffers.buffer = mmap.mmap(-1, DIRECT_CHUNK)  # page-aligned
    aligned = memoryview(buffer)
    try:
        for start in range(0, len(view), DIRECT_CHUNK):
            piece = view[start : start + DIRECT_CHUNK]
            size = len(piece)
            padded = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
            aligned[:size] = piece
            aligned[size:padded] = bytes(padded - size)
            out = aligned[:padded]
            while out:
                out = out[os.write(fd, out) :]
        os.ftruncate(fd, len(view))
    finally:
        aligned.release()


def sweep_temporary(folder: Path) -> int:
    """Delete the temporary files of `write_atomic` in `folder` that a kill in the middle
    of a write left (`.tmp-*`); returns how many. Only for the one process that writes
    there (holding the project's lock), before it writes: another's would go too."""
    swept = 0
    for tmp in folder.glob(".tmp-*"):
        try:
            tmp.unlink()
        except OSError:
            continue  # gone already, or not a file: not ours to force
        swept += 1
    return swept


def write_atomic(path: Path, data: bytes | memoryview) -> None:
    """After a crash the file is whole or absent: temp file, fsync, rename, fsync the dir."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def frozen(data: bytes | bytearray | memoryview) -> bytes | memoryview:
    """Bytes that cannot change under the store: bytes and read-only views (a tile framed in
    a report body, kernels/frames.py) as they are, anything writable copied."""
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        return data
    return bytes(data)


class BlobNotFound(KeyError):
    """No blob with this id is stored."""


def _remove(path: str) -> OSError | None:
    """Unlink a file (gone already is fine); the error if the disk refused."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc
    return None


class RecentBlobs:
    """The blobs written last, up to `capacity` bytes, kept in memory: every volunteer
    fetches the operand panels of the current product (a file response costs a stat, a
    sendfile and two epoll calls each time), and the validator reads each tile right after
    it arrives (a read from disk costs a hash to check it). Thread-safe: blobs are written
    off the loop."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, blob: str, data: bytes) -> None:
        if len(data) > self.capacity // 4:
            return
        with self._lock:
            if blob in self._blobs:
                self._blobs.move_to_end(blob)
                return
            self._blobs[blob] = frozen(data)
            self.size += len(data)
            while self.size > self.capacity:
                _, dropped = self._blobs.popitem(last=False)
                self.size -= len(dropped)

    def get(self, blob: str) -> bytes | None:
        with self._lock:
            return self._blobs.get(blob)

    def discard(self, blob: str) -> None:
        with self._lock:
            data = self._blobs.pop(blob, None)
            if data is not None:
                self.size -= len(data)


class BlobStore:
    """Blobs under `root/<first two hex digits>/<id>`, each written once and atomically.

    A blob is written to a temporary file in its final directory and renamed into place, so
    it is whole or absent. Reads verify the bytes against the id, so a corrupted disk never
    feeds a tile: a reader that finds a blob missing or damaged recomputes it.

    A step's blobs may be written back (`put_many(..., behind=True)`): they are held in
    memory, up to `behind_bytes`, and a writer thread puts the oldest on disk only when more
    than that is waiting, or when the store closes. Most of a step's blobs are deleted at the
    next checkpoint before they are ever written: writing them all made a tiny-gpt step 15%
    longer (benchmarks/blob_memory.py).
    Until written they are as a power cut leaves unsynced blobs: gone after a crash, and made
    again from what is committed (docs/architecture.md, "Durability").
    """

    def __init__(
        self,
        root: Path | str,
        max_blob_bytes: int,
        memory_bytes: int = 64 << 20,
        behind_bytes: int = 256 << 20,
    ) -> None:
        self.root = Path(root)
        self._root = str(self.root)
        self._folders: set[str] = set()  # fan-out folders known to exist
        self.direct = hasattr(os, "O_DIRECT")  # large blobs around the page cache
        self.max_blob_bytes = max_blob_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.recent = RecentBlobs(memory_bytes)
        self.behind_bytes = behind_bytes  # blobs held unwritten in memory at most
        self._draining = 0  # drain() calls waiting: the writer writes everything meanwhile
        self._unwritten: dict[str, bytes] = {}  # accepted, not yet on disk (oldest first)
        self._unwritten_size = 0
        self._writing: str | None = None
        self._deleted: set[str] = set()  # deleted while the writer was writing them
        # Files the disk would not delete (read-only, immutable): tried again once it does.
        self._undeleted: set[str] = set()
        self._undeleted_lock = threading.Lock()
        self._undeleted_tried = 0.0  # monotonic time of the last pass over them
        # One lock, two queues of waiters: the writer waits on `_due` for a write to become
        # due, callers on `_room` for memory or the disk. Waking the writer at every put
        # and delete, to find nothing due, cost a tiny-gpt coordinator a thread switch and
        # a GIL hand-off each time: 11% of its CPU (docs/performance-history.md).
        self._lock = threading.RLock()  # re-entered: release() deletes under it
        self._due = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        # Holders of each blob (put with `hold`): it leaves memory when the last lets go.
        self._holds: Counter[str] = Counter()
        # Blobs let go of lately: a host fetching one holds work nobody needs any more.
        self._released: OrderedDict[str, None] = OrderedDict()
        self._writer: threading.Thread | None = None
        self._closed = False
        # The writer's last error, until a write succeeds again: new blobs are refused
        # meanwhile, so that callers wait and retry instead of piling blobs up in memory.
        self.failure: OSError | None = None

    def sweep_temporary(self) -> int:
        """Delete the temporary files that a kill in the middle of a write left behind
        (`.tmp-*`: never a blob, never read); returns how many. Only for the one process
        that writes this store (the coordinator, holding the project's lock), before it
        writes anything: another writer's temporary files would go too."""
        folders = (self.root, *(p for p in self.root.iterdir() if p.is_dir()))
        return sum(sweep_temporary(folder) for folder in folders)

    def path(self, blob: str) -> Path:
        if not is_blob_id(blob):
            raise ValueError(f"not a blob id: {blob!r}")
        return Path(self._path_of(blob))

    def _folder_of(self, blob: str) -> str:
        return os.path.join(self._root, blob[:2])  # of an id known to be well formed

    def _path_of(self, blob: str) -> str:
        return os.path.join(self._folder_of(blob), blob)

    def has(self, blob: str) -> bool:
        return blob in self._unwritten or self.path(blob).is_file()

    def size(self, blob: str) -> int:
        data = self._unwritten.get(blob)
        if data is not None:
            return len(data)
        try:
            return self.path(blob).stat().st_size
        except FileNotFoundError as exc:
            raise BlobNotFound(blob) from exc

    def in_memory(self, blob: str) -> bytes | memoryview | None:
        """The blob's bytes if they are in memory (kept, or not yet written), else None."""
        data = self.recent.get(blob)
        return data if data is not None else self._unwritten.get(blob)

    def put(
        self, data: bytes, expected: str | None = None, *, keep: bool = False, hold: bool = False
    ) -> str:
        """Store bytes (checked against `expected` when given) and return their id; `keep`
        holds them in memory too, for blobs about to be read (panels volunteers fetch,
        tiles the validator checks)."""
        return self.put_many([(data, expected)], keep=keep, hold=hold)[0]

    def put_many(
        self,
        blobs: list[tuple[bytes, str | None]],
        *,
        keep: bool = False,
        verified: bool = False,
        behind: bool = False,
        hold: bool = False,
    ) -> list[str]:
        """Store several blobs, each whole or absent: written to a temporary file and renamed
        into place. `verified`: the caller has checked each blob against its `expected` id
        already (a blob is hashed once). `behind`: return at once and let the writer thread
        write them when they must (OSError if it is failing). `hold`: each is held once
        more, until `release` (the product it belongs to is done). Never synced: blobs are a
        step's intermediate products, which the step recomputes bit for bit from its inputs
        after a kill (that loses the blobs not yet written) or a power cut; see "Durability"
        in docs/architecture.md for what is synced and when."""
        ids = []
        for data, expected in blobs:
            if len(data) > self.max_blob_bytes:
                raise ValueError(
                    f"blob of {len(data)} bytes exceeds the limit {self.max_blob_bytes}"
                )
            if expected is None:
                expected = blob_id(data)
            elif not verified:
                verify_blob(data, expected)
            ids.append(expected)
        if hold:
            # Before they are stored: a release by another holder meanwhile cannot take them.
            self.hold(ids)
        else:
            self._keep_on_disk(ids)
        try:
            if behind:
                self._behind(list(zip(ids, (data for data, _ in blobs), strict=True)))
            else:
                for blob, (data, _) in zip(ids, blobs, strict=True):
                    if not self.has(blob):
                        self._write(blob, data)
        except BaseException:
            if hold:
                with self._lock:
                    self._holds.subtract(ids)
                    for blob in ids:
                        if self._holds[blob] <= 0:
                            del self._holds[blob]
            raise
        if keep:
            for blob, (data, _) in zip(ids, blobs, strict=True):
                self.recent.add(blob, data)
        return ids

    def _behind(self, blobs: list[tuple[str, bytes]]) -> None:
        with self._lock:
            if self.failure is not None and self._unwritten:
                raise self.failure
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_behind, name="tilehive-blob-writer", daemon=True
                )
                self._writer.start()
            for blob, data in blobs:
                # Stored again while the writer writes its deleted twin: keep the file.
                self._deleted.discard(blob)
                # Whether it is on disk already is the writer's question, off the loop.
                if blob in self._unwritten:
                    continue
                self._unwritten[blob] = frozen(data)
                self._unwritten_size += len(data)
            if self._write_due():
                self._due.notify()
            # A disk slower than the network: the caller waits for it rather than memory
            # filling up (rare; off the event loop whenever the blobs are large).
            self._room.wait_for(
                lambda: (
                    self._unwritten_size <= self.behind_bytes + WRITE_BACKLOG
                    or self.failure is not None
                )
            )

    def _write_due(self) -> bool:
        """More is held than the memory allows, everything must reach the disk, or the
        disk failed (it is tried again until it works, and new blobs wait for it)."""
        if not self._unwritten:
            return False
        return (
            self._unwritten_size > self.behind_bytes
            or self._draining > 0
            or self.failure is not None
        )

    def _write_behind(self) -> None:
        while True:
            with self._lock:
                self._due.wait_for(lambda: self._write_due() or self._closed)
                if not self._write_due():
                    return
                blob, data = next(iter(self._unwritten.items()))
                self._writing = blob
            try:
                if not os.path.exists(self._path_of(blob)):
                    self._write(blob, data)
            except OSError as exc:
                with self._lock:
                    if self.failure is None:
                        log.error("blob store %s cannot be written: %s", self.root, exc)
                    self.failure = exc
                    self._writing = None
                    self._deleted.discard(blob)  # not written: nothing to unlink
                    self._room.notify_all()
                    self._due.wait(WRITE_RETRY)  # the operator fixes the disk meanwhile
                continue
            with self._lock:
                self._writing = None
                if self.failure is not None:
                    log.info("blob store %s is written again", self.root)
                self.failure = None
                if self._unwritten.pop(blob, None) is not None:
                    self._unwritten_size -= len(data)
                if blob in self._deleted:
                    self._deleted.discard(blob)
                    self._unlink(blob)
                self._room.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Write every blob held in memory to disk and wait for it; False if `timeout` came
        first."""
        with self._lock:
            self._draining += 1
            self._due.notify()
            try:
                return self._room.wait_for(lambda: not self._unwritten, timeout)
            finally:
                self._draining -= 1

    def close(self, timeout: float = 10.0) -> None:
        """Write what is waiting (up to `timeout` seconds, unless the disk is failing), then
        stop the writer; what is left is as after a crash (docs/architecture.md)."""
        if self.failure is None:
            self.drain(timeout)
        with self._lock:
            if self._unwritten:
                log.warning(
                    "blob store %s: %d blobs (%.0f MB) not written at the stop; a restart "
                    "makes them again from what is committed",
                    self.root,
                    len(self._unwritten),
                    self._unwritten_size / (1 << 20),
                )
            self._closed = True
            self._unwritten.clear()
            self._unwritten_size = 0
            self._due.notify()
            self._room.notify_all()

    def _write(self, blob: str, data: bytes) -> None:
        """One blob, whole or absent: a temporary file in its folder, renamed into place.

        Plain os calls on strings, four system calls a blob (mkstemp, pathlib and a folder
        check on each made more): a coordinator of tiny tiles writes thousands a second.
        Most of a small blob's cost is the file system's own (0.9 ms a file measured under
        the throughput benchmark); a large one's was the copy into the page cache, which
        write_direct avoids where the file system allows it."""
        direct = self.direct and len(data) >= DIRECT_BYTES
        folder = self._folder_of(blob)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        final = os.path.join(folder, blob)
        # Named for the writing thread: two threads storing the same blob never share one.
        tmp = os.path.join(folder, f".tmp-{blob[:16]}-{threading.get_ident()}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags | (os.O_DIRECT if direct else 0), 0o600)
        except FileNotFoundError:
            self._folders.discard(folder)  # removed under us: made again on the next try
            raise
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            fd = os.open(tmp, flags, 0o600)  # a file system without O_DIRECT (tmpfs)
            direct = self.direct = False
        try:
            try:
                view = memoryview(data).cast("B")
                if direct:
                    write_direct(fd, view)
                else:
                    while view:
                        view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if direct and exc.errno == errno.EINVAL:  # alignment it does not take
                self.direct = False
                self._write(blob, data)
                return
            raise
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def hold(self, blobs: Iterable[str]) -> None:
        """Hold blobs once more, stored yet or not (`put_many(hold=True)` holds what it
        stores so): a reader of blobs another holder may let go of (a product made before a
        restart shares a panel with a new one) holds them before it looks, and releases
        them when done."""
        blobs = list(blobs)
        self._keep_on_disk(blobs)
        with self._lock:
            for blob in blobs:
                self._holds[blob] += 1
                self._released.pop(blob, None)

    def release(self, blobs: Iterable[str]) -> None:
        """Let go of blobs put with `hold`, once each: one nobody holds any more is deleted.
        A finished product's panels and tiles leave memory this way, unwritten, rather
        than fill it until the next checkpoint and spill to disk."""
        with self._lock:
            free = []
            for blob in blobs:
                self._holds[blob] -= 1
                if self._holds[blob] <= 0:
                    del self._holds[blob]
                    free.append(blob)
            for blob in free:
                self.delete(blob)
                self._released[blob] = None
            while len(self._released) > RELEASED_KEPT:
                self._released.popitem(last=False)

    def released(self, blob: str) -> bool:
        """True for a blob let go of lately (its product is done) and not stored since."""
        return blob in self._released

    def delete(self, blob: str) -> None:
        """Forget a blob, in memory and on disk. One held unwritten costs no system call
        (a file written before and stored again since is unlinked by a later delete: the
        checkpoint's, which deletes every blob of the products before it)."""
        self.recent.discard(blob)
        with self._lock:
            data = self._unwritten.pop(blob, None)
            if data is not None:
                self._unwritten_size -= len(data)
            if self._writing == blob:
                self._deleted.add(blob)  # the writer unlinks it once written
            if self.failure is not None and not self._unwritten:
                # What the disk refused is gone unwritten (a checkpoint let it go): nothing
                # waits for the disk now, and new blobs are taken until one must be written.
                self.failure = None
                log.info("blob store %s: nothing waits to be written any more", self.root)
            self._room.notify_all()  # no syscall unless a caller waits
        if data is None:
            self._unlink(blob)

    def _unlink(self, blob: str) -> None:
        """Delete a blob's file. A disk that refuses (remounted read-only, an immutable
        folder) keeps it for now: deleting is housekeeping, never a reason to stop training,
        and a whole, checked blob left behind costs only its space. The files refused are
        deleted once the disk deletes again (at most a pass over them every DELETE_RETRY
        seconds), unless stored or held again meanwhile."""
        exc = _remove(str(self.path(blob)))
        if exc is not None:
            with self._undeleted_lock:
                if not self._undeleted:
                    log.warning(
                        "blob store %s cannot delete blobs (%s); they stay on disk until it can",
                        self.root,
                        exc,
                    )
                    self._undeleted_tried = time.monotonic()
                self._undeleted.add(blob)
            return
        if self._undeleted and time.monotonic() - self._undeleted_tried >= DELETE_RETRY:
            self._delete_refused()

    def _delete_refused(self) -> None:
        # The set stays as it is until each file is gone: a put or hold of one of them meanwhile
        # sees it, waits for the lock, and then finds the file gone and stores it again.
        with self._undeleted_lock:
            self._undeleted_tried = time.monotonic()
            for blob in list(self._undeleted):
                if _remove(self._path_of(blob)) is None:
                    self._undeleted.discard(blob)
            if not self._undeleted:
                log.info("blob store %s deletes again: the blobs it kept are removed", self.root)

    def _keep_on_disk(self, blobs: list[str]) -> None:
        """Blobs stored or held again are live: a file the disk would not delete before
        must not go with the others once it does."""
        if self._undeleted:
            with self._undeleted_lock:
                self._undeleted.difference_update(blobs)

    def put_array(self, array: np.ndarray, *, keep: bool = False) -> str:
        return self.put(encode_array(array), keep=keep)

    def get(self, blob: str) -> bytes | memoryview:
        """The blob's bytes: from memory when it was kept (checked when it was stored),
        else from disk, checked against its id."""
        kept = self.in_memory(blob)
        if kept is not None:
            return kept
        try:
            data = self.path(blob).read_bytes()
        except FileNotFoundError as exc:
            raise BlobNotFound(blob) from exc
        verify_blob(data, blob)
        return data

    def get_array(self, blob: str) -> np.ndarray:
        return decode_array(self.get(blob))
