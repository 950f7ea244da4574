"""Training text as bytes: the running Python's standard library, or the user's own files.

Files are read in sorted order and split into train and validation by a hash of their
relative path, so the split depends on the corpus alone, never on the order the disk
lists files in. Nothing is downloaded and nothing of the corpus is committed.
"""

from __future__ import annotations

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
    raise CorpusError(f"corpus source {source!r} is neither python-stdlib, a file nor a folder")


def load(source: str, max_mb: int, validation_share: float) -> Corpus:
    root, files = _files(source)
    files.sort(key=lambda p: p.relative_to(root).as_posix())
    train, validation, budget = [], [], max_mb << 20
    threshold = int(validation_share * 2**32)
    for path in files:
        if budget <= 0:
            break
        data = path.read_bytes()[:budget]
        budget -= len(data)
        key = blake3(path.relative_to(root).as_posix().encode()).digest()[:4]
        (validation if int.from_bytes(key, "little") < threshold else train).append(data)
    join = SEPARATOR.join
    train_bytes, validation_bytes = join(train), join(validation)
    if len(train_bytes) < 4096 or len(validation_bytes) < 1024:
        raise CorpusError(
            f"corpus {source!r} is too small: {len(train_bytes)} bytes to train on and "
            f"{len(validation_bytes)} to validate on (need 4096 and 1024); add text or raise "
            "corpus.validation_share"
        )
    return Corpus(
        train=np.frombuffer(train_bytes, np.uint8),
        validation=np.frombuffer(validation_bytes, np.uint8),
        files=len(train) + len(validation),
    )
