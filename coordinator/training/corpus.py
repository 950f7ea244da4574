"""Training text as bytes: the running Python's standard library, or the user's own files.

Files are read in sorted order and split into train and validation by a hash of their
relative path, so the split depends on the corpus alone, never on the order the disk
lists files in. A corpus of too few files for that (one file, a handful) is split
inside each file instead: its last `validation_share` of bytes validate. Nothing is
downloaded and nothing of the corpus is committed.
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from blake3 import blake3

SEPARATOR = b"\n\n"


class CorpusError(ValueError):
    """The corpus source is missing or holds no text."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # uint8 tokens
    validation: np.ndarray
    files: int

    def batch(self, seed: int, step: int, batch_size: int, context: int, split: str = "train"):
        """Inputs and next-byte targets for one step: a pure function of (seed, step)."""
        data = self.train if split == "train" else self.validation
        rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(data) - context - 1, size=batch_size)
        index = starts[:, None] + np.arange(context + 1)[None, :]
        window = data[index].astype(np.int64)
        return window[:, :-1], window[:, 1:]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(source: str) -> tuple[Path, list[Path]]:
    if source == "python-stdlib":
        root = stdlib_root()
        files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]
        return root, files
    path = Path(source).expanduser()
    if path.is_file():
        return path.parent, [path]
    if path.is_dir():
        return path, [p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")]
    if not path.exists():
        raise CorpusError(
            f"corpus source {source!r}: no such file or folder (give a text file, a folder "
            "of text files, or python-stdlib)"
        )
    raise CorpusError(f"corpus source {source!r} is neither python-stdlib, a file nor a folder")


MIN_TRAIN, MIN_VALIDATION = 4096, 1024  # bytes: enough for a batch of windows each


def load(source: str, max_mb: int, validation_share: float) -> Corpus:
    root, files = _files(source)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    texts, budget = [], max_mb << 20
    for path in files:
        if budget <= 0:
            break
        data = path.read_bytes()[:budget]
        budget -= len(data)
        texts.append((path.relative_to(root).as_posix(), data))
    train, validation = split_by_file(texts, validation_share)
    if not _enough(train, validation):
        train, validation = split_in_files(texts, validation_share)
    if not _enough(train, validation):
        needed = max(MIN_TRAIN + MIN_VALIDATION, math.ceil(MIN_VALIDATION / validation_share))
        raise CorpusError(
            f"corpus {source!r} is too small: {len(train)} bytes to train on and "
            f"{len(validation)} to validate on (need {MIN_TRAIN} and {MIN_VALIDATION}); "
            f"add text: with a validation share of {validation_share:g}, {needed} bytes "
            "or more"
        )
    return Corpus(
        train=np.frombuffer(train, np.uint8),
        validation=np.frombuffer(validation, np.uint8),
        files=len(texts),
    )


def split_by_file(texts: list[tuple[str, bytes]], share: float) -> tuple[bytes, bytes]:
    """Whole files to one side or the other, by a hash of their relative path: a corpus of
    many files validates on text unlike any it trains on."""
    train, validation = [], []
    threshold = int(share * 2**32)
    for name, data in texts:
        key = blake3(name.encode()).digest()[:4]
        (validation if int.from_bytes(key, "little") < threshold else train).append(data)
    return SEPARATOR.join(train), SEPARATOR.join(validation)


def split_in_files(texts: list[tuple[str, bytes]], share: float) -> tuple[bytes, bytes]:
    """Each file's last `share` of bytes to validation, the rest to training: for a corpus
    of too few files to split whole."""
    train, validation = [], []
    for _, data in texts:
        cut = len(data) - int(len(data) * share)
        train.append(data[:cut])
        validation.append(data[cut:])
    return SEPARATOR.join(train), SEPARATOR.join(validation)


def _enough(train: bytes, validation: bytes) -> bool:
    return len(train) >= MIN_TRAIN and len(validation) >= MIN_VALIDATION
